"""CPU op table backed by the native kernels (services/worker/kernels/)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from services.worker.layers import attention
from services.worker.layers.decode_stack import DecodeStack, FusedDecode
from services.worker.layers.quantization import (
    BoundKernel,
    HalfWeight,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    can_tile,
    can_tile_int8,
    tile_half_weight,
    tile_int8_weight,
)
from services.worker.platforms.reference_ops import ReferenceOps

# A quantised weight's kernel, told by how many tensors it takes after x (kernel_operands): decode_layers.cpp picks
# the same kernels by the same counts.
_KERNEL_BY_OPERANDS = {1: "half_linear", 2: "int8_linear", 3: "int4_linear"}


def kernel_operands(weight: QuantizedWeight) -> tuple[torch.Tensor, ...]:
    """The tensors the weight's kernel takes after x, in its signature's order."""
    if isinstance(weight, Int4Weight):
        return weight.packed, weight.scales, weight.offsets
    if isinstance(weight, HalfWeight):
        return (weight.weight,)
    assert isinstance(weight, Int8Weight)
    return weight.qweight, weight.scales


@functools.cache
def _native_decode_shape(head_dim: int, group: int) -> bool:
    return bool(torch.ops.meshserve_cpu.decode_attention_supported(head_dim, group))


@functools.cache
def _native_prefill_shape(head_dim: int, block_size: int) -> bool:
    return bool(torch.ops.meshserve_cpu.prefill_attention_supported(head_dim, block_size))


def causal_pairs(query_len: int, seq_len: int) -> int:
    """Query-key pairs a sequence's prefill chunk attends: each query sees its context and itself."""
    return query_len * (seq_len - query_len) + query_len * (query_len + 1) // 2


class NativeCpuOps(ReferenceOps):
    """The reference ops with native fused norms, SwiGLU, rotary, KV cache write, decode and prefill attention.

    The elementwise kernels round exactly as the reference does; attention keeps scores and
    probabilities in float32 where the reference rounds them to the compute dtype.

    sdpa_prefill_pairs: where torch's own SDPA beats the native prefill kernel on bf16 (its flash attention
    runs on AMX tiles), the chunks of at least that many causal pairs go to it; None: every chunk native.
    half_tiles: half_linear multiplies bf16 weights packed into tiles here (half_linear_takes_tiles: on AMX
    tiles, or by vdpbf16ps over the same layout), so half_weight packs every bf16 weight that falls into whole
    tiles.
    int8_tiles: int8_linear multiplies int8 weights packed into tiles here (int8_linear_takes_tiles), so int8_weight
    packs every int8 weight of one scale a row that falls into whole tiles, for bf16 or fp16 activations (the tile
    kernel rounds them to int16 codes; float32 activations keep float products).
    """

    def __init__(
        self,
        layout: str = attention.NHD,
        sdpa_prefill_pairs: int | None = None,
        half_tiles: bool = False,
        int8_tiles: bool = False,
    ) -> None:
        super().__init__(layout)
        self.sdpa_prefill_pairs = sdpa_prefill_pairs
        self.half_tiles = half_tiles
        self.int8_tiles = int8_tiles

    def half_weight(self, weight: torch.Tensor) -> HalfWeight:
        return HalfWeight(tile_half_weight(weight) if self.half_tiles and can_tile(weight) else weight)

    def int8_weight(self, weight: Int8Weight, compute_dtype: torch.dtype) -> Int8Weight:
        half = compute_dtype in (torch.bfloat16, torch.float16)
        return tile_int8_weight(weight) if self.int8_tiles and half and can_tile_int8(weight) else weight

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.meshserve_cpu.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, new_residual = torch.ops.meshserve_cpu.add_rms_norm(x, residual, weight, eps)
        return out, new_residual

    def apply_rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # RotaryTable's cos and sin are float32 already, as the kernel takes them (it checks).
        q_out, k_out = torch.ops.meshserve_cpu.apply_rotary(q, k, cos, sin)
        return q_out, k_out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.meshserve_cpu.silu_and_mul(gate_up)

    def quantized_kernel(self, weight: QuantizedWeight) -> BoundKernel:
        """The weight's kernel overload with its tensors bound: a step's call goes straight to the kernel."""
        operands = kernel_operands(weight)
        kernel = getattr(torch.ops.meshserve_cpu, _KERNEL_BY_OPERANDS[len(operands)]).default
        return lambda x: kernel(x, *operands)

    def fused_decode(self, stack: DecodeStack) -> FusedDecode | None:
        """decode_layers.cpp: the same kernels in the same order as the per-layer path, without the Python between
        them. It takes steps whose every sequence has one query token, of at most stack.max_rows rows (every linear
        on its small-step kernel), with the KV cache in the compute dtype (the native cache write and decode
        attention; another KV dtype goes through the reference ops). A head shape the decode attention kernel has
        no register layout for gets none."""
        if not stack.layers or not _native_decode_shape(stack.head_dim, stack.num_heads // stack.num_kv_heads):
            return None
        norms = [norm for layer in stack.layers for norm in (layer.input_norm, layer.post_norm)]
        weights: list[torch.Tensor] = []
        counts: list[int] = []
        biases: list[torch.Tensor | None] = []
        for layer in stack.layers:
            for linear in layer.linears:
                operands = kernel_operands(linear.matmul.weight)
                weights.extend(operands)
                counts.append(len(operands))
                biases.append(linear.bias)
        op, layout, max_rows, compute = (
            torch.ops.meshserve_cpu.decode_layers.default,
            self.kv_layout,
            stack.max_rows,
            stack.compute,
        )
        shape = (stack.eps, stack.scale, stack.num_heads, stack.num_kv_heads, stack.head_dim, stack.accum, compute)

        def fused(
            hidden: torch.Tensor,
            residual: torch.Tensor | None,
            cos: torch.Tensor,
            sin: torch.Tensor,
            kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
            meta: attention.AttentionMetadata,
        ) -> tuple[torch.Tensor, torch.Tensor] | None:
            rows = hidden.shape[0]
            if rows > max_rows or rows != meta.seq_lens.shape[0] or kv_caches[0][0].dtype != compute:
                return None
            k_caches = [attention.head_major(k, layout) for k, _ in kv_caches]
            v_caches = [attention.head_major(v, layout) for _, v in kv_caches]
            out, new_residual = op(
                hidden, residual, cos, sin, norms, weights, counts, biases, k_caches, v_caches,
                meta.slot_mapping, meta.block_tables, meta.seq_lens, *shape,
            )  # fmt: skip
            return out, new_residual

        return fused

    def int8_linear(self, x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
        """Each int8 weight vector widened once in registers and used for every row (kernels/quantized_linear.cpp)."""
        return torch.ops.meshserve_cpu.int8_linear(x, weight.qweight, weight.scales)

    def int4_linear(self, x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
        """Each block of 4-bit codes dequantised once in registers and used for every row (quantized_linear.cpp)."""
        return torch.ops.meshserve_cpu.int4_linear(x, weight.packed, weight.scales, weight.offsets)

    def half_linear(self, x: torch.Tensor, weight: HalfWeight) -> torch.Tensor:
        """The bf16/fp16 weight widened in registers, each vector used for every row, or bf16 by vdpbf16ps, or
        tile-packed bf16 on AMX tiles or by vdpbf16ps (quantized_linear.cpp)."""
        return torch.ops.meshserve_cpu.half_linear(x, weight.weight)

    def reshape_and_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if k.dtype != k_cache.dtype:
            # The reference converts to the KV dtype on the way in.
            super().reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
            return
        layout = self.kv_layout
        torch.ops.meshserve_cpu.reshape_and_cache(
            k, v, attention.head_major(k_cache, layout), attention.head_major(v_cache, layout), slot_mapping
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        layout: str,
    ) -> torch.Tensor:
        """Reads each sequence's blocks in place (no gather, no padding to the longest)."""
        k_view, v_view = attention.head_major(k_cache, layout), attention.head_major(v_cache, layout)
        group = q.shape[1] // k_view.shape[1]
        if k_cache.dtype != q.dtype or not _native_decode_shape(q.shape[2], group):
            # A KV dtype unlike the compute dtype (e.g. fp16 KV under fp32 compute), or a head shape the
            # kernel has no register layout for: the reference handles both.
            return super().decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, layout)
        return torch.ops.meshserve_cpu.paged_decode_attention(q, k_view, v_view, block_tables, seq_lens, scale)

    def prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        layout: str,
    ) -> torch.Tensor:
        """Every prefill chunk in one call, reading its blocks in place. torch's CPU SDPA ran SmolLM2's
        512-token causal prefill at ~60 GFLOP/s in bf16, a third of a prefill step (docs/benchmarks.md), except
        on AMX, where its flash attention beats the kernel on chunks of sdpa_prefill_pairs and more."""
        k_view, v_view = attention.head_major(k_cache, layout), attention.head_major(v_cache, layout)
        if k_cache.dtype != q.dtype or not _native_prefill_shape(q.shape[2], k_view.shape[2]):
            return super().prefill_attention(
                q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout
            )
        large = self._sdpa_chunks(q.dtype, seq_lens, query_start_loc)
        if not large:
            return torch.ops.meshserve_cpu.paged_prefill_attention(
                q, k_view, v_view, block_tables, seq_lens, query_start_loc, scale
            )
        starts = query_start_loc.tolist()
        out = torch.empty_like(q)
        small = [b for b in range(seq_lens.shape[0]) if b not in large]
        if small:  # in one native call, their rows gathered
            rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in small])
            lengths = torch.tensor([starts[b + 1] - starts[b] for b in small])
            index = torch.tensor(small)
            out[rows] = torch.ops.meshserve_cpu.paged_prefill_attention(
                q[rows], k_view, v_view, block_tables[index], seq_lens[index],
                torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]), scale,
            )  # fmt: skip
        for b in large:  # one SDPA each, as the reference
            start, end = starts[b], starts[b + 1]
            out[start:end] = attention.prefill_attention(
                q[start:end], k_cache, v_cache, block_tables[b : b + 1], seq_lens[b : b + 1],
                torch.tensor([0, end - start]), scale, layout,
            )  # fmt: skip
        return out

    def _sdpa_chunks(self, dtype: torch.dtype, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> set[int]:
        """The sequences whose chunk goes to torch's SDPA (see sdpa_prefill_pairs)."""
        if self.sdpa_prefill_pairs is None or dtype != torch.bfloat16:
            return set()
        starts = query_start_loc.tolist()
        return {
            b
            for b, seq_len in enumerate(seq_lens.tolist())
            if starts[b + 1] - starts[b] > 1
            and causal_pairs(starts[b + 1] - starts[b], seq_len) >= self.sdpa_prefill_pairs
        }
