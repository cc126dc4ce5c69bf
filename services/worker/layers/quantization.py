"""Weight-only int8 (`--quantization int8`): each linear's weight rounded to int8 with one float32 scale
per output row (torchao's int8 weight-only), activations left in the compute dtype (W8A16) -- except where
the native kernel multiplies in integers: a one-row step (a single decode) in bf16 or fp16 on the plain
layout, and every step the int8 tile kernel takes (weights packed into tiles on an AVX-512 CPU, steps of up to
the platform's rows), where each row of x is rounded to int16 codes (a 16-bit activation with one scale a
row): see int8_rounded_row_reference. Rounded row by row, a request's output there does not depend on its batch.

Scales per group of input columns (llama.cpp's Q8_0 idea) are supported by quantize_int8 and the
kernel, but not the default: on SmolLM2, groups of 64 took the logit error from 4.9% to 4.1% and
groups of 16 to 2.8% (bf16 alone: 1.4%) while the one-row step got 1.4x slower (docs/benchmarks.md).

Decode is bound by the bytes of weights a step reads (docs/benchmarks.md): int8 reads a quarter of
fp32's and half of bf16's. Steps with more rows than the platform's `int8_max_rows` are bound by
arithmetic instead; they keep the platform's fastest GEMM, run on the int8 weight dequantised (packed
once for oneDNN where the CPU packs, dequantised once at load where it does not), so every step size computes the
same model and quantising never slows a prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

# Symmetric: the largest magnitude of a group maps to 127 (-128 is never used, so negation is exact).
INT8_LEVELS = 127


@dataclass(frozen=True)
class Int8Weight:
    """A weight [out, in] as int8 and float32 scales [out, groups]: weight ~ qweight * scales per group
    of in / groups consecutive columns.

    qweight is [out, in] as it is, or, for the int8 tile kernel, packed into tiles (tile_int8_weight: 5-D)."""

    qweight: torch.Tensor
    scales: torch.Tensor

    @property
    def tiled(self) -> bool:
        return self.qweight.dim() == 5

    @property
    def in_features(self) -> int:
        return _in_features(self.qweight)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the int8 values stand for, in dtype (float32 products, one rounding)."""
        codes = untile(self.qweight) if self.tiled else self.qweight
        out_features, in_features = codes.shape
        groups = self.scales.shape[1]
        grouped = codes.float().view(out_features, groups, in_features // groups) * self.scales[:, :, None]
        return grouped.view(out_features, in_features).to(dtype)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Round weight to int8 with scale max|group| / 127 per group of group_size columns (None, or a size
    that does not divide the width: one group per row; an all-zero group gets scale 1)."""
    rows = weight.detach().float()
    out_features, in_features = rows.shape
    size = group_size if group_size is not None and in_features % group_size == 0 else in_features
    grouped = rows.view(out_features, in_features // size, size)
    absmax = grouped.abs().amax(dim=2)
    scales = torch.where(absmax > 0, absmax / INT8_LEVELS, torch.ones_like(absmax))
    qweight = torch.round(grouped / scales[:, :, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return Int8Weight(qweight.view(out_features, in_features).contiguous(), scales.contiguous())


# GGUF's 4-bit block (Q4_0, Q4_1): 32 columns, 16 bytes of codes.
INT4_BLOCK = 32


@dataclass(frozen=True)
class Int4Weight:
    """A weight [out, in] as 4-bit codes with a float32 scale and offset per block of 32 columns, GGUF's
    Q4_1 (Q4_0 is offset = -8 * scale): weight = scale * q + offset, q in 0..15.

    packed [out, in / 2] uint8 keeps GGUF's byte order, so a file's blocks are used as they are: in each
    block's 16 bytes, byte j holds column j in its low nibble and column j + 16 in its high one."""

    packed: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.offsets))

    def codes(self) -> torch.Tensor:
        """The 4-bit codes [out, in] as uint8, in column order."""
        out_features = self.packed.shape[0]
        blocks = self.packed.view(out_features, -1, INT4_BLOCK // 2)
        return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).view(out_features, -1)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the codes stand for, in dtype: scale * q + offset in float32 (scale * q is exact, so
        this is the value gguf's own dequantisation gives), one rounding to dtype."""
        out_features = self.packed.shape[0]
        codes = self.codes().float().view(out_features, -1, INT4_BLOCK)
        weight = codes * self.scales[:, :, None] + self.offsets[:, :, None]
        return weight.view(out_features, -1).to(dtype)


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """Round weight [out, in] (in a multiple of 32) to GGUF's Q4_1: per block of 32 columns offset = min,
    scale = (max - min) / 15, codes round((w - min) / scale); for tests and benchmarks (served 4-bit
    weights come from a GGUF file as they are)."""
    rows = weight.detach().float()
    out_features, in_features = rows.shape
    if in_features % INT4_BLOCK:
        raise ValueError(f"4-bit weights need in_features a multiple of {INT4_BLOCK}, got {in_features}")
    blocks = rows.view(out_features, -1, INT4_BLOCK)
    low, high = blocks.amin(dim=2), blocks.amax(dim=2)
    scales = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
    codes = torch.round((blocks - low[:, :, None]) / scales[:, :, None]).clamp_(0, 15).to(torch.uint8)
    half = INT4_BLOCK // 2
    packed = codes[:, :, :half] | (codes[:, :, half:] << 4)
    packed = packed.reshape(out_features, in_features // 2)
    return Int4Weight(packed.contiguous(), scales.contiguous(), low.contiguous())


# An AMX tile's shape for a bf16 weight: 16 output rows by 32 input columns, held as 16 rows of 16 column pairs.
TILE_ROWS = 16
TILE_COLUMNS = 32


@dataclass(frozen=True)
class HalfWeight:
    """A bf16 or fp16 weight [out, in], not quantised: where the CPU has no native half-precision GEMM, the
    packed GEMM runs on fp32 copies (twice the bytes a decode step reads), and where it has one (oneDNN on
    avx512_bf16 or AMX) that GEMM reads a small step's weights below the memory's rate; either way small steps
    take a kernel that reads this one instead, as quantised weights' small steps do (platform.half_max_rows).

    weight is [out, in] as it is, or, for the tile kernels (AMX, or vdpbf16ps without it), packed into tiles
    (tile_half_weight: 5-D)."""

    weight: torch.Tensor

    @property
    def tiled(self) -> bool:
        return self.weight.dim() == 5

    @property
    def in_features(self) -> int:
        return _in_features(self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (untile(self.weight) if self.tiled else self.weight).to(dtype)


def _in_features(weight: torch.Tensor) -> int:
    """The input columns of a weight [out, in], or of one packed into tiles (tile)."""
    return weight.shape[1] * TILE_COLUMNS if weight.dim() == 5 else weight.shape[1]


def _whole_tiles(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return out_features % TILE_ROWS == 0 and in_features % TILE_COLUMNS == 0


def can_tile(weight: torch.Tensor) -> bool:
    """Whether a bf16 weight [out, in] falls into whole AMX tiles (every Llama-family shape does)."""
    return weight.dtype == torch.bfloat16 and _whole_tiles(weight)


def tile(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (whole tiles) as [out/16, in/32, 16, 16, 2]: tile (n, k) is rows n*16.. and columns
    k*32.. as 16 rows of 16 column pairs (row p holds each weight row's columns 2p and 2p + 1), the B operand of
    AMX's bf16 tile product as it lies in memory, and one vector of 16 outputs' column pairs for the dot-product
    tile kernels; the tiles of 16 weight rows follow each other along the columns, so a kernel streams each row
    block's bytes in order. A new tensor: the plain weight can be dropped."""
    out_features, in_features = weight.shape
    tiles = weight.reshape(out_features // TILE_ROWS, TILE_ROWS, in_features // TILE_COLUMNS, TILE_COLUMNS // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


def untile(tiles: torch.Tensor) -> torch.Tensor:
    """The [out, in] weight that tile() packed into tiles."""
    n_tiles, k_tiles = tiles.shape[:2]
    return tiles.permute(0, 3, 1, 2, 4).reshape(n_tiles * TILE_ROWS, k_tiles * TILE_COLUMNS)


def tile_half_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [out, in] (can_tile) packed into tiles (tile)."""
    if not can_tile(weight):
        raise ValueError(f"a {weight.dtype} weight of shape {tuple(weight.shape)} does not fall into bf16 tiles")
    return tile(weight)


def can_tile_int8(weight: Int8Weight) -> bool:
    """Whether an int8 weight falls into the int8 tile kernel's layout: one scale a row, whole tiles."""
    return not weight.tiled and weight.scales.shape[1] == 1 and _whole_tiles(weight.qweight)


def tile_int8_weight(weight: Int8Weight) -> Int8Weight:
    """An int8 weight of one scale a row (can_tile_int8) with its codes packed into tiles (tile): one 32-byte
    vector is 16 outputs' pair of columns, as vpdpwssd takes them (kernels/quantized_linear.cpp)."""
    if not can_tile_int8(weight):
        raise ValueError(
            f"an int8 weight of shape {tuple(weight.qweight.shape)} with {weight.scales.shape[1]} scale groups a row "
            "does not fall into int8 tiles"
        )
    return Int8Weight(tile(weight.qweight), weight.scales.contiguous())


# The weight formats a small-step kernel may hold; each has nbytes and dequantize(dtype).
QuantizedWeight = Int8Weight | Int4Weight | HalfWeight
# A platform's kernel for a quantised weight: x [rows, in] -> [rows, out] in x's dtype.
QuantizedLinearOp = Callable[[torch.Tensor, QuantizedWeight], torch.Tensor]
# The same kernel with one weight bound: x [rows, in] -> [rows, out].
BoundKernel = Callable[[torch.Tensor], torch.Tensor]
# What binds a weight to its kernel (a platform's Ops.quantized_kernel), once per layer at load: a decode step
# calls a linear's kernel 121 times in SmolLM2, where a chain of wrappers and format checks per call cost
# ~1.6 ms of a 20 ms step on the Zen 3 EPYC.
KernelBinder = Callable[[QuantizedWeight], BoundKernel]


def binder_of(op: QuantizedLinearOp) -> KernelBinder:
    """A KernelBinder that calls op with the weight (for ops with no binding of their own: the reference)."""

    def bind(weight: QuantizedWeight) -> BoundKernel:
        return lambda x: op(x, weight)

    return bind


def weight_parts(weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    """A quantised weight's tensors by field name (each has the weight's rows as its first dimension)."""
    return {f.name: getattr(weight, f.name) for f in fields(weight)}


def _rebuilt(weight: QuantizedWeight, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
    """A weight of the same format from new tensors (parts by field name)."""
    cls: type[Int8Weight] | type[Int4Weight] | type[HalfWeight] = type(weight)
    return cls(**parts)


def reorder_rows(weight: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    """The weight's rows in the given order (row i of the result is row order[i])."""
    return _rebuilt(weight, {name: t[order].contiguous() for name, t in weight_parts(weight).items()})


def weight_rows(weight: QuantizedWeight, start: int, size: int) -> QuantizedWeight:
    """Output rows [start, start + size) of a quantised weight (a column-parallel shard, a fused part)."""
    return _rebuilt(weight, {name: t.narrow(0, start, size) for name, t in weight_parts(weight).items()})


def weight_columns(weight: QuantizedWeight, start: int, size: int) -> QuantizedWeight:
    """Input columns [start, start + size) (a row-parallel shard); ValueError unless both ends fall on the
    format's block (or scale group) boundaries."""
    sliced = {}
    for name, t in weight_parts(weight).items():
        ratio = t.shape[1] / weight.in_features  # 1 for int8 codes, 1/2 for packed nibbles, 1/group for scales
        begin, width = start * ratio, size * ratio
        if not (begin.is_integer() and width.is_integer()):
            per_unit = round(1 / ratio) if ratio < 1 else 1
            raise ValueError(
                f"columns {start}..{start + size} of a {type(weight).__name__} do not fall on its blocks of "
                f"{per_unit} columns"
            )
        sliced[name] = t.narrow(1, int(begin), int(width))
    return _rebuilt(weight, sliced)


def cat_weight_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Fused parts stacked by rows (q, k, v; gate, up); ValueError if their formats or widths differ."""
    first = parts[0]
    for part in parts[1:]:
        if type(part) is not type(first) or part.in_features != first.in_features:
            raise ValueError(f"fused parts in different formats: {type(first).__name__}, {type(part).__name__}")
        widths = zip(weight_parts(first).values(), weight_parts(part).values(), strict=True)
        if any(a.shape[1] != b.shape[1] for a, b in widths):
            raise ValueError(f"fused parts of {type(first).__name__} with different block sizes")
    names = weight_parts(first)
    return _rebuilt(first, {name: torch.cat([getattr(p, name) for p in parts]) for name in names})


def pad_weight_rows(weight: QuantizedWeight, total: int) -> QuantizedWeight:
    """total rows, the ones past the weight's zero (codes, scales and offsets 0: they dequantise to 0)."""
    extra = total - weight_rows_count(weight)
    if extra <= 0:
        return weight
    return _rebuilt(
        weight,
        {name: torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) for name, t in weight_parts(weight).items()},
    )


def weight_rows_count(weight: QuantizedWeight) -> int:
    return next(iter(weight_parts(weight).values())).shape[0]


def quantized_linear_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x W^T with W dequantised: float32 products and sums, rounded once to x's dtype (the oracle)."""
    return F.linear(x.float(), weight.dequantize(torch.float32)).to(x.dtype)


# The native kernel's one-row steps on one scale a row (a single decode, the default int8) with bf16 or fp16 x
# round x's row to int16 codes, max|x| -> X_CODE_LEVELS, and sum exactly in integers (quantized_linear.cpp,
# round_row). float32 x keeps float products.
X_CODE_LEVELS = 32767


def int8_rounded_row_reference(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """What the native kernel computes for a one-row step on one scale a row (the oracle): each row of x
    rounded half to even at float32 scale max|x| / X_CODE_LEVELS, exact integer products and sums, times
    x's scale, then the weight row's, rounded once to x's dtype."""
    rows = x.float()
    amax = rows.abs().amax(dim=1, keepdim=True)
    levels = torch.tensor(float(X_CODE_LEVELS))
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    codes = torch.round(rows * inv)
    # Integers far below 2^53: float64 sums them exactly.
    exact = (codes.double() @ weight.qweight.double().T).float()
    return (exact * (amax / levels) * weight.scales[:, 0]).to(x.dtype)


@dataclass(frozen=True)
class QuantizedMatmul:
    """What a quantised linear needs at run time: its quantised weight, the platform's kernel for it, the row
    count up to which that kernel beats the platform's GEMM, and, where no packed copy takes the larger
    steps, the weight dequantised once (at load, never per step)."""

    weight: QuantizedWeight
    bind: KernelBinder
    max_rows: int
    dense: torch.Tensor | None = None
    # x [rows, in] -> [rows, out] through the platform's kernel on this weight (steps of up to max_rows rows).
    run: BoundKernel = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The kernel with this weight bound, decided once (frozen: set through object.__setattr__).
        object.__setattr__(self, "run", self.bind(self.weight))
