"""Rank 0's rendezvous store on one host listens from the moment its address is known."""

from __future__ import annotations

import datetime
from urllib.parse import urlparse

import torch.distributed as dist

from services.worker.distributed import DistInit, open_local_rendezvous


def test_the_local_rendezvous_listens_at_the_address_the_other_ranks_are_given() -> None:
    init_method, store = open_local_rendezvous(world_size=2)
    address = urlparse(init_method)
    assert address.scheme == "tcp" and address.hostname == "127.0.0.1"
    assert address.port == store.port
    # A follower rank connects to init_method as a client; what it writes, rank 0's store holds.
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("hello", "rank-1")
    assert store.get("hello") == b"rank-1"


def test_the_store_stays_with_rank_0_and_out_of_the_spawned_ranks_description() -> None:
    init_method, store = open_local_rendezvous(world_size=2)
    rank0 = DistInit(0, 2, 0, init_method, store)
    # Equality and repr leave the store out: ranks compare by place, and logs never print a socket.
    assert rank0 == DistInit(0, 2, 0, init_method)
    assert "TCPStore" not in repr(rank0)
