"""KV blocks to and from the kvstore's canonical head-major slices, for both cache layouts and TP head slices."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv_blocks import (
    SliceGeometry,
    dtype_name,
    gather_blocks,
    scatter_blocks,
    slice_bytes,
    slices_from_bytes,
    stacked_view,
)
from services.worker.kv_cache import KVCache
from services.worker.layers.attention import HND, NHD

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM, NUM_BLOCKS = 3, 4, 2, 8, 10
DTYPES = [torch.float32, torch.bfloat16]


def _random_cache(layout: str, dtype: torch.dtype, heads: int = HEADS, seed: int = 0) -> KVCache:
    cache = KVCache.allocate(
        num_blocks=NUM_BLOCKS,
        num_layers=LAYERS,
        block_size=BLOCK_SIZE,
        num_kv_heads=heads,
        head_dim=HEAD_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
        layout=layout,
    )
    generator = torch.Generator().manual_seed(seed)
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape, generator=generator))
        v.copy_(torch.randn(v.shape, generator=generator))
    return cache


def _empty_like(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in cache.layers]


def _token(cache_layer: torch.Tensor, layout: str, block: int, head: int, offset: int) -> torch.Tensor:
    """One token's head vector, read the obvious way for the layout."""
    if layout == NHD:
        return cache_layer[block, offset, head]
    return cache_layer[block, head, offset]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [NHD, HND])
def test_gather_is_head_major_canonical(layout: str, dtype: torch.dtype) -> None:
    cache = _random_cache(layout, dtype)
    blocks = [7, 2, 5]
    slices = gather_blocks(cache.layers, blocks, layout)
    assert slices.shape == (3, HEADS, LAYERS, 2, BLOCK_SIZE, HEAD_DIM)
    assert slices.dtype == dtype and slices.device.type == "cpu" and slices.is_contiguous()
    for i, block in enumerate(blocks):
        for head in range(HEADS):
            for layer, (k, v) in enumerate(cache.layers):
                for offset in range(BLOCK_SIZE):
                    assert torch.equal(slices[i, head, layer, 0, offset], _token(k, layout, block, head, offset))
                    assert torch.equal(slices[i, head, layer, 1, offset], _token(v, layout, block, head, offset))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [NHD, HND])
def test_round_trip_into_other_block_ids(layout: str, dtype: torch.dtype) -> None:
    source = _random_cache(layout, dtype)
    slices = gather_blocks(source.layers, [1, 4, 9], layout)
    target = _empty_like(source)
    scatter_blocks(target, [6, 0, 3], slices, layout)
    for (sk, sv), (tk, tv) in zip(source.layers, target, strict=True):
        for src, dst in ((1, 6), (4, 0), (9, 3)):
            assert torch.equal(tk[dst], sk[src]) and torch.equal(tv[dst], sv[src])
        # Nothing else was written.
        untouched = [b for b in range(NUM_BLOCKS) if b not in (6, 0, 3)]
        assert not tk[untouched].any() and not tv[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("saved", "loaded"), [(NHD, HND), (HND, NHD)])
def test_block_saved_in_one_layout_loads_into_the_other(saved: str, loaded: str, dtype: torch.dtype) -> None:
    source = _random_cache(saved, dtype)
    blocks = [3, 8]
    geometry = SliceGeometry(HEADS, LAYERS, BLOCK_SIZE, HEAD_DIM, dtype, head_start=0, head_count=HEADS)
    # Through bytes, as the store carries them.
    gathered = gather_blocks(source.layers, blocks, saved)
    payloads = [bytes(slice_bytes(gathered, i)) for i in range(len(blocks))]
    assert all(len(p) == geometry.slice_nbytes for p in payloads)
    target = _random_cache(loaded, dtype, seed=1)
    scatter_blocks(target.layers, [5, 0], slices_from_bytes(payloads, geometry), loaded)
    for (sk, sv), (tk, tv) in zip(source.layers, target.layers, strict=True):
        for src, dst in ((3, 5), (8, 0)):
            for head in range(HEADS):
                for offset in range(BLOCK_SIZE):
                    assert torch.equal(_token(tk, loaded, dst, head, offset), _token(sk, saved, src, head, offset))
                    assert torch.equal(_token(tv, loaded, dst, head, offset), _token(sv, saved, src, head, offset))
    assert torch.equal(gather_blocks(target.layers, [5, 0], loaded), gathered)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [NHD, HND])
def test_tp_head_slices_are_contiguous_byte_ranges_of_the_whole_block(layout: str, dtype: torch.dtype) -> None:
    """What each rank of a 2-way split holds is its heads' byte range of the TP=1 block, and loads back."""
    heads = 4
    full = _random_cache(layout, dtype, heads=heads)
    blocks = [2, 6]
    whole = gather_blocks(full.layers, blocks, layout)
    head_axis = 2 if layout == NHD else 1
    geometry_full = SliceGeometry(heads, LAYERS, BLOCK_SIZE, HEAD_DIM, dtype, head_start=0, head_count=heads)
    for start, count in [(0, 2), (2, 2)]:
        # Rank r's cache holds the same values for its own heads only.
        rank_layers = [
            (k.narrow(head_axis, start, count).contiguous(), v.narrow(head_axis, start, count).contiguous())
            for k, v in full.layers
        ]
        own = gather_blocks(rank_layers, blocks, layout)
        assert torch.equal(own, gather_blocks(full.layers, blocks, layout, heads=slice(start, start + count)))
        geometry = SliceGeometry(heads, LAYERS, BLOCK_SIZE, HEAD_DIM, dtype, head_start=start, head_count=count)
        for i in range(len(blocks)):
            begin = start * geometry.slice_nbytes // count
            whole_bytes = bytes(slice_bytes(whole, i))
            assert len(whole_bytes) == geometry_full.slice_nbytes
            assert bytes(slice_bytes(own, i)) == whole_bytes[begin : begin + geometry.slice_nbytes]
        # A rank loads its heads of a block a TP=1 worker saved.
        target = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in rank_layers]
        payloads = [bytes(slice_bytes(whole, i))[begin : begin + geometry.slice_nbytes] for i in range(2)]
        scatter_blocks(target, [0, 1], slices_from_bytes(payloads, geometry), layout)
        for (rk, rv), (tk, tv) in zip(rank_layers, target, strict=True):
            assert torch.equal(tk[:2], rk[blocks]) and torch.equal(tv[:2], rv[blocks])


def test_empty_block_lists() -> None:
    cache = _random_cache(HND, torch.float32)
    assert gather_blocks(cache.layers, [], HND).shape == (0, HEADS, LAYERS, 2, BLOCK_SIZE, HEAD_DIM)
    geometry = SliceGeometry(HEADS, LAYERS, BLOCK_SIZE, HEAD_DIM, torch.float32, head_start=0, head_count=HEADS)
    scatter_blocks(cache.layers, [], slices_from_bytes([], geometry), HND)


def test_mismatched_slices_are_refused() -> None:
    cache = _random_cache(HND, torch.float32)
    slices = gather_blocks(cache.layers, [0], HND)
    with pytest.raises(ValueError, match=r"do not fit a torch\.bfloat16 cache"):
        scatter_blocks(_random_cache(HND, torch.bfloat16).layers, [0], slices.to(torch.bfloat16).float(), HND)
    with pytest.raises(ValueError, match="do not fit this cache"):
        scatter_blocks(_random_cache(HND, torch.float32, heads=1).layers, [0], slices, HND)
    with pytest.raises(ValueError, match="expected 2 block slices"):
        scatter_blocks(cache.layers, [0, 1], slices, HND)
    geometry = SliceGeometry(HEADS, LAYERS, BLOCK_SIZE, HEAD_DIM, torch.float32, head_start=0, head_count=HEADS)
    with pytest.raises(ValueError, match="expected"):
        slices_from_bytes([b"\0" * 12], geometry)
    with pytest.raises(ValueError, match="outside the model's 2 KV heads"):
        SliceGeometry(HEADS, LAYERS, BLOCK_SIZE, HEAD_DIM, torch.float32, head_start=1, head_count=2)


def test_dtype_names() -> None:
    assert dtype_name(torch.float32) == "float32"
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(torch.float16) == "float16"
    with pytest.raises(ValueError, match="cannot be stored"):
        dtype_name(torch.int8)
    geometry = SliceGeometry(8, 2, 16, 64, torch.bfloat16, head_start=4, head_count=4)
    assert geometry.slice_nbytes == 4 * 2 * 2 * 16 * 64 * 2


def test_device_staging_is_bounded() -> None:
    from services.worker.kv_blocks import DEVICE_STAGING_BYTES, _staging_groups

    # The CPU stages everything at once; a device at most DEVICE_STAGING_BYTES' worth of blocks per copy.
    assert _staging_groups(10, DEVICE_STAGING_BYTES, torch.device("cpu")) == [(0, 10)]
    assert _staging_groups(5, DEVICE_STAGING_BYTES // 2, torch.device("meta")) == [(0, 2), (2, 4), (4, 5)]
    assert _staging_groups(3, DEVICE_STAGING_BYTES * 4, torch.device("meta")) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [NHD, HND])
def test_stacked_cache_moves_blocks_in_one_op_with_the_per_layer_result(layout: str, dtype: torch.dtype) -> None:
    """KVCache.allocate's CPU layers are views of one tensor, so gather and scatter take the one-op path;
    a cache of separate tensors takes the per-layer one, and both move the same bytes."""
    heads = 4
    stacked = _random_cache(layout, dtype, heads=heads, seed=3)
    separate = [(k.clone(), v.clone()) for k, v in stacked.layers]
    assert stacked_view(stacked.layers, layout) is not None
    assert stacked_view(separate, layout) is None
    # The view is the cache itself: a write through it lands in the layer tensors.
    whole = stacked_view(stacked.layers, layout)
    assert whole is not None and whole.shape == (NUM_BLOCKS, heads, LAYERS, 2, BLOCK_SIZE, HEAD_DIM)
    for layer, (k, v) in enumerate(stacked.layers):
        assert torch.equal(whole[4, 1, layer, 0, 2], _token(k, layout, 4, 1, 2))
        assert torch.equal(whole[9, 3, layer, 1, 0], _token(v, layout, 9, 3, 0))
    blocks = [8, 0, 3, 3]
    for heads_picked in (None, slice(1, 3)):
        expected = gather_blocks(separate, blocks, layout, heads=heads_picked)
        assert torch.equal(gather_blocks(stacked.layers, blocks, layout, heads=heads_picked), expected)
    slices = gather_blocks(separate, [1, 5, 7], layout)
    target_stacked = _random_cache(layout, dtype, heads=heads, seed=4)
    target_separate = [(k.clone(), v.clone()) for k, v in target_stacked.layers]
    scatter_blocks(target_stacked.layers, [9, 2, 6], slices, layout)
    scatter_blocks(target_separate, [9, 2, 6], slices, layout)
    for (sk, sv), (pk, pv) in zip(target_stacked.layers, target_separate, strict=True):
        assert torch.equal(sk, pk) and torch.equal(sv, pv)
    assert torch.equal(gather_blocks(target_stacked.layers, [9, 2, 6], layout), slices)


def test_layers_spaced_unevenly_are_not_stacked() -> None:
    """A list that is not one evenly spaced tensor (layers out of order, K and V swapped) takes the per-layer path."""
    cache = _random_cache(HND, torch.float32, seed=5)
    shuffled = [cache.layers[0], cache.layers[2], cache.layers[1]]
    assert stacked_view(shuffled, HND) is None
    copies = [(k.clone(), v.clone()) for k, v in shuffled]
    assert torch.equal(gather_blocks(shuffled, [2, 1], HND), gather_blocks(copies, [2, 1], HND))
    assert stacked_view([(v, k) for k, v in cache.layers], HND) is None
    # Evenly spaced is enough: the stack's last layers, or every other one, are one strided view as well.
    for part in (cache.layers[1:], cache.layers[::2]):
        whole = stacked_view(part, HND)
        assert whole is not None and torch.equal(whole[:, :, -1, 1], part[-1][1])


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs one thread here: no op would open a team")
@pytest.mark.parametrize("stacked", [True, False])
def test_a_cpu_scatter_opens_no_openmp_team_on_the_thread_that_runs_it(stacked: bool) -> None:
    """The kvstore's load thread scatters, and lives on: an OpenMP team opened there would count its threads
    against the host's CPUs for good and stop the model thread's team from spinning at its barriers. Enough
    blocks that one torch copy of them would run in parallel; the thread count must not grow by that team's
    threads while the scattering thread is alive."""
    import os
    import threading

    cache = KVCache.allocate(
        num_blocks=64, num_layers=8, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16,
        device=torch.device("cpu"), layout=HND,
    )  # fmt: skip
    layers = cache.layers if stacked else [(k.clone(), v.clone()) for k, v in cache.layers]
    assert (stacked_view(layers, HND) is not None) is stacked
    blocks = list(range(0, 64, 2))
    slices = torch.randn(len(blocks), 4, 8, 2, 16, 64).to(torch.bfloat16)
    assert slices.numel() > 4 * 32768  # torch's grain: a copy of this many elements would be split over threads
    done, finish = threading.Event(), threading.Event()

    def load() -> None:
        scatter_blocks(layers, blocks, slices, HND)
        done.set()
        finish.wait()

    before = len(os.listdir("/proc/self/task"))
    thread = threading.Thread(target=load)
    thread.start()
    try:
        assert done.wait(30)
        assert len(os.listdir("/proc/self/task")) == before + 1  # the loading thread itself, nothing more
    finally:
        finish.set()
        thread.join()
    assert torch.equal(gather_blocks(layers, blocks, HND), slices)
