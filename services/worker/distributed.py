"""A worker's process groups: every rank together (rank 0's commands, agreement), the tensor-parallel
collectives of its pipeline stage, and the point-to-point hop between stages.

Ranks are laid out stage-major, as vLLM's: rank = stage * tensor_parallel_size + tp_rank, so a stage's
TP ranks are contiguous (one host's devices) and rank 0 (stage 0, TP rank 0) drives the worker."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

# Followers wait on the command channel while the worker is idle, which may last for days; gloo
# times out every operation, so the channel's timeout is effectively "never".
COMMAND_TIMEOUT = datetime.timedelta(days=3650)
# Startup and collectives inside a forward: long enough for the slowest rank to load its weights.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class DistInit:
    """Where this process sits in the worker's ranks and how they meet."""

    rank: int
    world_size: int
    local_rank: int
    # tcp://host:port of rank 0's rendezvous store.
    init_method: str
    # The store rank 0 already listens with (open_local_rendezvous), or None: rank 0 opens it at init_method.
    # It stays in the process that opened it: each spawned rank gets a DistInit of its own without it.
    store: Any = field(default=None, compare=False, repr=False)


def open_local_rendezvous(world_size: int) -> tuple[str, Any]:
    """Rank 0's store on a loopback port the kernel picks as it binds, and the init_method for the others.

    Picking a free port first and binding it later leaves a gap in which another process (a service the
    same launcher is starting) can bind that port; binding port 0 leaves none."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                          wait_for_workers=False)  # fmt: skip
    return f"tcp://127.0.0.1:{store.port}", store


def _rendezvous_store(init: DistInit) -> Any:
    """This rank's handle on rank 0's store: the one already open, or a new server (rank 0) or client."""
    if init.store is not None:
        return init.store
    address = urlparse(init.init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        raise ValueError(f"init_method {init.init_method!r} is not tcp://host:port")
    return dist.TCPStore(address.hostname, address.port, init.world_size, is_master=init.rank == 0,
                         timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)  # fmt: skip


class RankGroup:
    """Every rank of one worker over gloo: rank 0's commands reach all, and all agree on shared numbers.

    Every method is a no-op for a worker of one rank."""

    def __init__(self, rank: int = 0, size: int = 1, cpu_group: Any = None) -> None:
        self.rank = rank
        self.size = size
        self._cpu_group = cpu_group

    @property
    def is_driver(self) -> bool:
        """Rank 0 talks to the scheduler and sends every other rank its commands."""
        return self.rank == 0

    def broadcast_ints(self, values: list[int] | None, count: int, src: int = 0) -> list[int]:
        """Rank `src`'s `count` integers, on every rank (others pass None)."""
        if self.size == 1:
            assert values is not None
            return values
        buffer = torch.tensor(values, dtype=torch.int64) if self.rank == src else torch.empty(count, dtype=torch.int64)
        dist.broadcast(buffer, src=src, group=self._cpu_group)
        return [int(v) for v in buffer.tolist()]

    def broadcast_bytes(self, payload: bytes | None, length: int, src: int = 0) -> bytes:
        """Rank `src`'s payload of `length` bytes (known to every rank beforehand) on every rank."""
        if self.size == 1 or length == 0:
            return payload or b""
        if self.rank == src:
            assert payload is not None and len(payload) == length
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buffer = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(buffer, src=src, group=self._cpu_group)
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


class TPGroup:
    """Device collectives over the tensor-parallel ranks; every method is a no-op for a group of one."""

    def __init__(self, rank: int = 0, size: int = 1, device_group: Any = None) -> None:
        self.rank = rank
        self.size = size
        # None: the default group (every rank of the worker is one tensor-parallel group).
        self._device_group = device_group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks in place; returns the tensor."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self._device_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's tensor along the last dim, in rank order."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self._device_group)
        return torch.cat(parts, dim=-1)


class PipelineChannel:
    """This rank's hop to the same TP rank of the neighbouring stages, over the platform's backend; and the
    sampling rank's channel back to rank 0 (gloo, a group of their own), for pipelined steps' tokens."""

    def __init__(
        self, rank: int = 0, tp_size: int = 1, stage: int = 0, num_stages: int = 1, result_group: Any = None
    ) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self._prev = rank - tp_size
        self._next = rank + tp_size
        self._sampling_rank = (num_stages - 1) * tp_size
        # Its own group: rank 0's command broadcasts and this channel run on different threads.
        self._result_group = result_group

    def send_next(self, tensors: list[torch.Tensor]) -> None:
        """Hand the step's activations to the next stage (blocks until it has taken them)."""
        assert self.stage < self.num_stages - 1
        for tensor in tensors:
            dist.send(tensor.contiguous(), dst=self._next)

    def recv_prev(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Fill buffers (shapes and dtypes both sides know from the step) with the previous stage's activations."""
        assert self.stage > 0
        for buffer in buffers:
            dist.recv(buffer, src=self._prev)
        return buffers

    def send_result(self, token_ids: list[int] | None, payload: bytes = b"") -> None:
        """Sampling rank: a step's sampled ids (every row, drafts' too) and its serialized answer to rank 0;
        None says goodbye (the worker is shutting down)."""
        count = -1 if token_ids is None else len(token_ids)
        dist.send(torch.tensor([count, len(payload)], dtype=torch.int64), dst=0, group=self._result_group)
        if token_ids:
            dist.send(torch.tensor(token_ids, dtype=torch.int64), dst=0, group=self._result_group)
        if payload:
            dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=0, group=self._result_group)

    def recv_result(self) -> tuple[list[int], bytes] | None:
        """Rank 0: the next step's (sampled ids, serialized answer) from the sampling rank; None at goodbye."""
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, src=self._sampling_rank, group=self._result_group)
        count, length = (int(v) for v in header.tolist())
        if count < 0:
            return None
        tokens = torch.empty(count, dtype=torch.int64)
        if count:
            dist.recv(tokens, src=self._sampling_rank, group=self._result_group)
        payload = torch.empty(length, dtype=torch.uint8)
        if length:
            dist.recv(payload, src=self._sampling_rank, group=self._result_group)
        return [int(v) for v in tokens.tolist()], bytes(payload.numpy())


SINGLE = TPGroup()
ONE_RANK = RankGroup()
NO_PIPELINE = PipelineChannel()


@dataclass(frozen=True)
class WorkerGroups:
    """The groups one rank belongs to."""

    ranks: RankGroup
    tp: TPGroup
    pipe: PipelineChannel = NO_PIPELINE


def init_groups(backend: str, init: DistInit, tensor_parallel_size: int) -> WorkerGroups:
    """Join the process group (blocks until every rank arrives), open the command channel and, with pipeline
    stages, each stage's tensor-parallel group."""
    if init.world_size == 1:
        return WorkerGroups(ONE_RANK, SINGLE)
    if init.world_size % tensor_parallel_size:
        raise ValueError(f"{init.world_size} ranks do not split into TP groups of {tensor_parallel_size}")
    # Every rank passes a store (none the tcp:// URL), so all of them see its keys under the same prefix.
    dist.init_process_group(
        backend=backend,
        store=_rendezvous_store(init),
        rank=init.rank,
        world_size=init.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    cpu_group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    ranks = RankGroup(init.rank, init.world_size, cpu_group)
    num_stages = init.world_size // tensor_parallel_size
    stage, tp_rank = divmod(init.rank, tensor_parallel_size)
    if num_stages == 1:
        # The default group is the TP group (as before pipeline stages existed).
        return WorkerGroups(ranks, TPGroup(init.rank, init.world_size))
    device_group = None
    # Every rank creates every stage's group, in the same order (torch.distributed requires it).
    for other in range(num_stages):
        members = list(range(other * tensor_parallel_size, (other + 1) * tensor_parallel_size))
        group = dist.new_group(ranks=members, backend=backend) if tensor_parallel_size > 1 else None
        if other == stage:
            device_group = group
    tp = TPGroup(tp_rank, tensor_parallel_size, device_group)
    sampling_rank = (num_stages - 1) * tensor_parallel_size
    result_group = dist.new_group(ranks=[0, sampling_rank], backend="gloo", timeout=COMMAND_TIMEOUT)
    pipe = PipelineChannel(init.rank, tensor_parallel_size, stage, num_stages, result_group)
    return WorkerGroups(ranks, tp, pipe)


def destroy_groups(ranks: RankGroup) -> None:
    """Leave the process group, if one was joined."""
    if ranks.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
