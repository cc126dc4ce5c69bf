"""One tensor-parallel group: the device collectives layers use and a gloo channel for rank 0's commands."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Followers wait on the command channel while the worker is idle, which may last for days; gloo
# times out every operation, so the channel's timeout is effectively "never".
COMMAND_TIMEOUT = datetime.timedelta(days=3650)
# Startup and collectives inside a forward: long enough for the slowest rank to load its weights.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class DistInit:
    """Where this process sits in the group and how the group meets."""

    rank: int
    world_size: int
    local_rank: int
    # tcp://host:port of rank 0's rendezvous store.
    init_method: str


class TPGroup:
    """Collectives over the tensor-parallel ranks; every method is a no-op for a group of one."""

    def __init__(self, rank: int = 0, size: int = 1, cpu_group: Any = None) -> None:
        self.rank = rank
        self.size = size
        self._cpu_group = cpu_group

    @property
    def is_driver(self) -> bool:
        """Rank 0 talks to the scheduler, samples and sends every other rank its commands."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks in place; returns the tensor."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's tensor along the last dim, in rank order."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts, dim=-1)

    def broadcast_ints(self, values: list[int] | None, count: int) -> list[int]:
        """Rank 0's `count` integers, on every rank (others pass None)."""
        if self.size == 1:
            assert values is not None
            return values
        buffer = torch.tensor(values, dtype=torch.int64) if self.is_driver else torch.empty(count, dtype=torch.int64)
        dist.broadcast(buffer, src=0, group=self._cpu_group)
        return [int(v) for v in buffer.tolist()]

    def broadcast_bytes(self, payload: bytes | None, length: int) -> bytes:
        """Rank 0's payload of `length` bytes (known to every rank beforehand) on every rank."""
        if self.size == 1 or length == 0:
            return payload or b""
        if self.is_driver:
            assert payload is not None and len(payload) == length
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buffer = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self._cpu_group)
        return bytes(buffer.numpy())

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (ranks agree on one KV block count)."""
        if self.size == 1:
            return value
        buffer = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(buffer, op=dist.ReduceOp.MIN, group=self._cpu_group)
        return int(buffer.item())

    def min_ints(self, values: list[int]) -> list[int]:
        """Element-wise smallest of every rank's values (same length everywhere; ranks agree on KV loads done)."""
        if self.size == 1 or not values:
            return values
        buffer = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(buffer, op=dist.ReduceOp.MIN, group=self._cpu_group)
        return [int(v) for v in buffer.tolist()]

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's values (same length everywhere), in rank order, on every rank."""
        if self.size == 1:
            return [list(values)]
        parts = [torch.empty(len(values), dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(parts, torch.tensor(values, dtype=torch.int64), group=self._cpu_group)
        return [[int(v) for v in part.tolist()] for part in parts]


SINGLE = TPGroup()


def init_tp_group(backend: str, init: DistInit) -> TPGroup:
    """Join the process group (blocks until every rank arrives) and open the command channel."""
    if init.world_size == 1:
        return SINGLE
    dist.init_process_group(
        backend=backend,
        init_method=init.init_method,
        rank=init.rank,
        world_size=init.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    cpu_group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return TPGroup(init.rank, init.world_size, cpu_group)


def destroy_tp_group(group: TPGroup) -> None:
    """Leave the process group, if one was joined."""
    if group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
