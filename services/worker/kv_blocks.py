"""KV blocks between the paged cache and the kvstore's canonical slice layout (pure tensor code).

The store keeps a block head-major, [num_kv_heads][num_layers][2 (K, V)][block_size][head_dim], so one
tensor-parallel rank's heads are one contiguous byte range and a block written from an NHD cache reads
back into an HND one (and the other way round): the cache layout never reaches the bytes. A rank handles
its own heads only, as a slice [local_kv_heads][num_layers][2][block_size][head_dim].

Gather and scatter are vectorised over blocks: when the layers are views of one stacked tensor (the CPU
cache, kv_cache.KVCache.allocate) one index_select / indexed copy covers every layer and K/V; otherwise one
per layer and K/V. Never a Python loop over tokens.

A CPU scatter copies through numpy, never a torch op: it runs on the kvstore's load thread, and a torch op on
enough elements opens an OpenMP team on the thread that calls it. GNU OpenMP then counts more threads than
the host has CPUs for as long as that thread lives, and stops spinning at every barrier of the model thread's
team (each then waits on a futex): on the AMX Xeon a one-row int8 step took 16.9 ms instead of 6.6 once a
live thread had run one index_copy_ (docs/benchmarks.md, issue 15's twenty-first step). Gathers run on the
model thread and keep torch's. Bytes are the machine's (little-endian on every
platform the worker runs on, which is what the store's contract says).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.kv_store_limits import DTYPE_BYTES
from services.worker.layers.attention import HND, LAYOUTS, head_major

# The store's dtype names and the torch dtypes they stand for.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Device memory one gather or scatter may take at a time: a step's saves (hundreds of blocks of a big
# model) must not need a device copy of all of them at once next to the cache.
DEVICE_STAGING_BYTES = 64 * 1024 * 1024


def dtype_name(dtype: torch.dtype) -> str:
    """The store's name of a KV dtype ("float32", "bfloat16", "float16")."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"KV dtype {dtype} cannot be stored; the kvstore holds {sorted(DTYPES)}")


@dataclass(frozen=True)
class SliceGeometry:
    """One rank's heads of a block: the whole model's block shape, and which of its KV heads this rank holds."""

    # KV heads of the whole model (every rank together).
    num_kv_heads: int
    num_layers: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    # This rank's KV heads are [head_start, head_start + head_count) of the model's.
    head_start: int
    head_count: int

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        if min(self.num_kv_heads, self.num_layers, self.block_size, self.head_dim, self.head_count) < 1:
            raise ValueError(f"every dimension of a KV block must be >= 1: {self}")
        if self.head_start < 0 or self.head_start + self.head_count > self.num_kv_heads:
            raise ValueError(
                f"heads [{self.head_start}, {self.head_start + self.head_count}) are outside the model's "
                f"{self.num_kv_heads} KV heads"
            )

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def slice_shape(self) -> tuple[int, int, int, int, int]:
        """One block's slice in the canonical layout: [head_count, num_layers, 2, block_size, head_dim]."""
        return (self.head_count, self.num_layers, 2, self.block_size, self.head_dim)

    @property
    def slice_nbytes(self) -> int:
        """Bytes of one block's slice (what a Put sends and a Get returns for this rank)."""
        count = self.head_count * self.num_layers * 2 * self.block_size * self.head_dim
        return count * DTYPE_BYTES[self.dtype_name]


def stacked_view(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: str) -> torch.Tensor | None:
    """Every layer's K and V as one view in the store's canonical order, [num_blocks, Hk, num_layers, 2,
    block_size, D], when the layers are evenly spaced views of one CPU tensor (KVCache.allocate's CPU cache);
    None otherwise (a device cache keeps a tensor per layer).

    Built from the layers' own offsets and strides, it reads and writes exactly the memory the per-layer
    tensors do, and block i of it is block i's slice: one index_select gathers blocks straight into their
    canonical bytes, one index_copy_ writes them back.
    """
    k0, v0 = layers[0]
    if k0.device.type != "cpu":
        return None
    # Views of one tensor share its _base (a view of a view too); separate tensors have none.
    base = k0._base
    tensors = [t for pair in layers for t in pair]
    if base is None or any(t._base is not base for t in tensors):
        return None
    kv_step = v0.storage_offset() - k0.storage_offset()
    layer_step = layers[1][0].storage_offset() - k0.storage_offset() if len(layers) > 1 else 2 * kv_step
    # V after K within a layer, layers in order: as_strided takes no negative strides, and other spacings
    # are not a stacked cache.
    if kv_step <= 0 or layer_step <= kv_step:
        return None
    first = k0.storage_offset()
    expected = [first + layer * layer_step + kv * kv_step for layer in range(len(layers)) for kv in (0, 1)]
    if [t.storage_offset() for t in tensors] != expected:
        return None
    if len({(t.shape, t.stride(), t.dtype) for t in tensors}) != 1:
        return None
    whole = torch.as_strided(k0, (len(layers), 2, *k0.shape), (layer_step, kv_step, *k0.stride()), k0.storage_offset())
    # [layers, 2, blocks, ...] in the cache's layout -> [blocks, heads, layers, 2, block_size, head_dim].
    return whole.permute(2, 3, 0, 1, 4, 5) if layout == HND else whole.permute(2, 4, 0, 1, 3, 5)


def gather_blocks(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_ids: Sequence[int],
    layout: str,
    *,
    heads: slice | None = None,
    stacked: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blocks' KV as one contiguous CPU tensor [n, heads, num_layers, 2, block_size, head_dim].

    `layers` holds each layer's (K, V) cache in `layout`; `heads` picks some of the cache's heads (all by
    default); `stacked` is stacked_view(layers, layout) when the caller keeps it (found here otherwise).
    Entry i is block_ids[i]'s slice in the canonical layout, contiguous, so its bytes are what the store
    takes. The result is a copy: the blocks may be overwritten as soon as this returns.
    """
    _check_layout(layout)
    if not layers:
        raise ValueError("the KV cache has no layers")
    k0 = head_major(layers[0][0], layout)
    _, total_heads, block_size, head_dim = k0.shape
    picked = heads or slice(0, total_heads)
    num_heads = len(range(total_heads)[picked])
    n = len(block_ids)
    out = torch.empty((n, num_heads, len(layers), 2, block_size, head_dim), dtype=k0.dtype, device="cpu")
    if n == 0:
        return out
    whole = stacked if stacked is not None else stacked_view(layers, layout)
    if whole is not None:
        # The CPU cache: one index_select over every layer and K/V, straight into the slices.
        torch.index_select(whole[:, picked], 0, torch.tensor(block_ids, dtype=torch.int64), out=out)
        return out
    device = k0.device
    for start, stop in _staging_groups(n, out[0].numel() * out.element_size(), device):
        index = torch.tensor(block_ids[start:stop], dtype=torch.int64, device=device)
        # On a device: gathered there into canonical order, then one device-to-host copy per group.
        on_cpu = device.type == "cpu"
        staged = out[start:stop] if on_cpu else torch.empty_like(out[start:stop], device=device)
        for layer, (k_cache, v_cache) in enumerate(layers):
            for kv, cache in enumerate((k_cache, v_cache)):
                staged[:, :, layer, kv] = head_major(cache, layout)[:, picked].index_select(0, index)
        if not on_cpu:
            out[start:stop].copy_(staged)
    return out


def slice_bytes(slices: torch.Tensor, i: int) -> memoryview:
    """Block i of gather_blocks' result as the bytes of its canonical slice (a view, not a copy)."""
    block = slices[i]
    if not block.is_contiguous() or block.device.type != "cpu":
        raise ValueError("block slices must be a contiguous CPU tensor (gather_blocks' result)")
    return block.view(-1).view(torch.uint8).numpy().data


def slices_from_bytes(payloads: Sequence[bytes | bytearray | memoryview], geometry: SliceGeometry) -> torch.Tensor:
    """Slices received from the store as a CPU tensor [n, heads, num_layers, 2, block_size, head_dim]."""
    for payload in payloads:
        if len(payload) != geometry.slice_nbytes:
            raise ValueError(f"a block slice of {len(payload)} bytes, expected {geometry.slice_nbytes}")
    if not payloads:
        return torch.empty((0, *geometry.slice_shape), dtype=geometry.dtype)
    # One writable buffer (torch.frombuffer warns on read-only bytes); the tensor owns it from here.
    joined = bytearray().join(payloads)
    flat = torch.frombuffer(joined, dtype=geometry.dtype)
    return flat.view(len(payloads), *geometry.slice_shape)


def scatter_blocks(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_ids: Sequence[int],
    slices: torch.Tensor,
    layout: str,
    *,
    stacked: torch.Tensor | None = None,
) -> None:
    """Write slices [n, heads, num_layers, 2, block_size, head_dim] (any device) into block_ids of the cache.

    `stacked` is stacked_view(layers, layout) when the caller keeps it (found here otherwise).

    The cache must hold exactly `heads` KV heads (a rank's own); the caller has checked that the slices are
    whole blocks of this model in the cache's dtype.
    """
    _check_layout(layout)
    n = len(block_ids)
    if slices.dim() != 6 or slices.shape[0] != n:
        raise ValueError(f"expected {n} block slices [n, heads, layers, 2, block_size, head_dim], got {slices.shape}")
    if n == 0:
        return
    k0 = head_major(layers[0][0], layout)
    expected = (k0.shape[1], len(layers), 2, k0.shape[2], k0.shape[3])
    if tuple(slices.shape[1:]) != expected:
        raise ValueError(f"block slices of shape {tuple(slices.shape[1:])} do not fit this cache's {expected}")
    if slices.dtype != k0.dtype:
        raise ValueError(f"block slices in {slices.dtype} do not fit a {k0.dtype} cache")
    whole = stacked if stacked is not None else stacked_view(layers, layout)
    if whole is not None:
        # The CPU cache: one indexed copy over every layer and K/V.
        _copy_rows(whole, block_ids, slices)
        return
    device = k0.device
    if device.type == "cpu":
        for layer, (k_cache, v_cache) in enumerate(layers):
            for kv, cache in enumerate((k_cache, v_cache)):
                _copy_rows(head_major(cache, layout), block_ids, slices[:, :, layer, kv])
        return
    for start, stop in _staging_groups(n, slices[0].numel() * slices.element_size(), device):
        index = torch.tensor(block_ids[start:stop], dtype=torch.int64, device=device)
        staged = slices[start:stop].to(device)
        for layer, (k_cache, v_cache) in enumerate(layers):
            for kv, cache in enumerate((k_cache, v_cache)):
                # index_copy_ on the head-major view writes the cache itself, in whichever layout it is.
                head_major(cache, layout).index_copy_(0, index, staged[:, :, layer, kv])


def _copy_rows(target: torch.Tensor, rows: Sequence[int], source: torch.Tensor) -> None:
    """target[rows[i]] = source[i] for CPU tensors of one dtype, in numpy on the calling thread alone (the module
    docstring says why not torch): both are viewed as integers of the element's width, sharing their memory."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[target.element_size()]
    view = target.view(width).numpy()
    view[list(rows)] = source.view(width).numpy()


def _staging_groups(n: int, block_bytes: int, device: torch.device) -> list[tuple[int, int]]:
    """[start, stop) ranges of blocks to stage at once: all of them on the CPU (no second copy is made there
    that matters), at most DEVICE_STAGING_BYTES' worth on a device."""
    if device.type == "cpu":
        return [(0, n)]
    per_group = max(1, DEVICE_STAGING_BYTES // max(1, block_bytes))
    return [(start, min(n, start + per_group)) for start in range(0, n, per_group)]


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV cache layout {layout!r}; expected one of {LAYOUTS}")
