"""Tensor-parallel linears and vocab-parallel embedding; weights held in one dtype, matmuls run in another.

Column-parallel layers own a slice of output rows (fused parts such as q/k/v each sliced on their
own), row-parallel layers a slice of input columns with an all-reduce after the matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.distributed import TPGroup
from services.worker.layers.decode_stack import StackLinear
from services.worker.layers.dtypes import to_dtype
from services.worker.layers.quantization import (
    HalfWeight,
    Int8Weight,
    KernelBinder,
    QuantizedMatmul,
    QuantizedWeight,
    cat_weight_rows,
    pad_weight_rows,
    quantize_int8,
    weight_columns,
    weight_rows,
)

# A linear with its weights bound: x [rows, in] -> [rows, out] in the compute dtype.
LinearFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shard:
    """The slice [start, start + size) of one checkpoint dimension this rank holds."""

    start: int
    size: int


def balanced_shard(total: int, parts: int, index: int) -> Shard:
    """Part `index` of `total` split into `parts` contiguous pieces whose sizes differ by at most one."""
    base, extra = divmod(total, parts)
    return Shard(index * base + min(index, extra), base + (1 if index < extra else 0))


def _matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    compute_dtype: torch.dtype,
    packed: torch.Tensor | None,
    quantized: QuantizedMatmul | None = None,
) -> torch.Tensor:
    """x W^T + b in the compute dtype, through the oneDNN-packed weight when pack_linears made one.

    A weight packed in fp32 for a half-precision compute dtype takes the input widened (exactly) and
    rounds the fp32-accumulated result once, as a half-precision GEMM does. Inside the platform's one-row
    scope (oneDNN off) a layer without a small-step kernel uses its plain weight.

    A layer with a small-step kernel (quantized set: a quantised weight, or its half-precision weight where
    the packed GEMM widens) runs steps of up to quantized.max_rows rows on that weight; larger ones take the
    packed weight, else the quantised one dequantised at load (quantized.dense).
    """
    if quantized is not None:
        if x.shape[0] <= quantized.max_rows:
            out = quantized.run(to_dtype(x, compute_dtype))
            return out if bias is None else out + to_dtype(bias, compute_dtype)
        if packed is None and quantized.dense is not None:
            weight = quantized.dense
    if packed is not None and (packed.dtype == compute_dtype or torch._C._get_mkldnn_enabled()):
        bias = None if bias is None else to_dtype(to_dtype(bias, compute_dtype), packed.dtype)
        out = torch.ops.mkldnn._linear_pointwise(to_dtype(x, packed.dtype), packed, bias, "none", [], "")
        return to_dtype(out, compute_dtype)
    bias = None if bias is None else to_dtype(bias, compute_dtype)
    return F.linear(x, to_dtype(weight, compute_dtype), bias)


def _stack_linear(
    quantized: QuantizedMatmul | None, bias: torch.Tensor | None, compute_dtype: torch.dtype
) -> StackLinear | None:
    return (
        None if quantized is None else StackLinear(quantized, None if bias is None else to_dtype(bias, compute_dtype))
    )


def _check_shape(name: str, got: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(got.shape) != expected:
        raise ValueError(f"{name}: checkpoint slice has shape {tuple(got.shape)}, expected {expected}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with this rank's output rows of each fused part; no communication."""

    def __init__(self, input_size: int, parts: list[Shard], bias: bool, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.parts = parts
        self.offsets = [sum(p.size for p in parts[:i]) for i in range(len(parts))]
        out = sum(p.size for p in parts)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.compute_dtype = compute_dtype
        # The weight in oneDNN's blocked layout, once pack_linears has run (CPU only).
        self.packed: torch.Tensor | None = None
        # The weight quantised (int8 rows and scales), once quantize_matmuls has run (--quantization).
        self.quantized: QuantizedMatmul | None = None
        # A checkpoint's own quantised parts by part index, until attach_quantized fuses them.
        self.quantized_parts: dict[int, QuantizedWeight] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bind()(x)

    def bind(self) -> LinearFn:
        """This layer's matmul with its weights fetched once (a step's linears run these: a module call and its
        attribute lookups cost more than a small matmul here). Bind after the weights are final."""
        weight, bias, compute_dtype, packed, quantized = (
            self.weight, self.bias, self.compute_dtype, self.packed, self.quantized
        )  # fmt: skip
        return lambda x: _matmul(x, weight, bias, compute_dtype, packed, quantized)

    def stack_linear(self) -> StackLinear | None:
        """This layer as a fused decode stack runs it (layers/decode_stack.py); None without a small-step kernel."""
        return _stack_linear(self.quantized, self.bias, self.compute_dtype)

    def load_quantized(self, weight: QuantizedWeight, part: int) -> None:
        """Keep this rank's rows of checkpoint part `part` in the checkpoint's quantised format."""
        p = self.parts[part]
        self.quantized_parts[part] = weight_rows(weight, p.start, p.size)

    def checkpoint_quantized(self) -> QuantizedWeight | None:
        """The fused quantised weight, when the checkpoint gave every part in one format (else None)."""
        if len(self.quantized_parts) != len(self.parts):
            return None
        try:
            return cat_weight_rows([self.quantized_parts[i] for i in range(len(self.parts))])
        except ValueError:
            return None

    def load(self, kind: str, tensor: torch.Tensor, part: int) -> None:
        """Copy this rank's rows of checkpoint part `part` (a whole q_proj, gate_proj, ...)."""
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {kind} this layer does not take")
        p = self.parts[part]
        piece = tensor.narrow(0, p.start, p.size)
        dest = target.narrow(0, self.offsets[part], p.size)
        _check_shape(kind, piece, tuple(dest.shape))
        with torch.no_grad():
            dest.copy_(piece)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b: this rank holds a slice of the input columns."""

    def __init__(
        self, input_shard: Shard, output_size: int, bias: bool, compute_dtype: torch.dtype, tp: TPGroup
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_shard = input_shard
        self.weight = nn.Parameter(torch.empty(output_size, input_shard.size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.compute_dtype = compute_dtype
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedMatmul | None = None
        self.quantized_parts: dict[int, QuantizedWeight] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bind()(x)

    def bind(self) -> LinearFn:
        """As ColumnParallelLinear.bind, with the all-reduce (none on one rank) and then the bias."""
        weight, compute_dtype, packed, quantized = self.weight, self.compute_dtype, self.packed, self.quantized
        reduce = self.tp.all_reduce if self.tp.size > 1 else None
        bias = None if self.bias is None else to_dtype(self.bias, compute_dtype)

        def linear(x: torch.Tensor) -> torch.Tensor:
            y = _matmul(x, weight, None, compute_dtype, packed, quantized)
            if reduce is not None:
                y = reduce(y)
            # After the reduce, so the bias is added once rather than once per rank.
            return y if bias is None else y + bias

        return linear

    def stack_linear(self) -> StackLinear | None:
        """As ColumnParallelLinear.stack_linear; None on more than one rank too (a stack has no all-reduce)."""
        return None if self.tp.size > 1 else _stack_linear(self.quantized, self.bias, self.compute_dtype)

    def load(self, kind: str, tensor: torch.Tensor, part: int) -> None:
        """Copy this rank's input columns of the weight, or the whole bias."""
        if kind == "bias":
            if self.bias is None:
                raise ValueError("checkpoint has a bias this layer does not take")
            _check_shape(kind, tensor, tuple(self.bias.shape))
            with torch.no_grad():
                self.bias.copy_(tensor)
            return
        piece = tensor.narrow(1, self.input_shard.start, self.input_shard.size)
        _check_shape(kind, piece, tuple(self.weight.shape))
        with torch.no_grad():
            self.weight.copy_(piece)

    def load_quantized(self, weight: QuantizedWeight, part: int) -> None:
        """Keep this rank's input columns in the checkpoint's quantised format; ValueError when the shard does
        not fall on the format's blocks."""
        self.quantized_parts[part] = weight_columns(weight, self.input_shard.start, self.input_shard.size)

    def checkpoint_quantized(self) -> QuantizedWeight | None:
        return self.quantized_parts.get(0)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary is split in equal (last one padded) ranges over ranks; doubles as the LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        # The LM-head matmul's copies of the weight (oneDNN's layout, quantised); the lookup keeps the plain one.
        self.packed: torch.Tensor | None = None
        self.quantized: QuantizedMatmul | None = None
        self.quantized_parts: dict[int, QuantizedWeight] = {}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
        """Float32 logits [N, vocab]: each rank's vocab slice, gathered in rank order."""
        local = _matmul(to_dtype(hidden, compute_dtype), self.weight, None, compute_dtype, self.packed, self.quantized)
        return self.tp.all_gather_last_dim(local.float())[:, : self.vocab_size]

    def load(self, kind: str, tensor: torch.Tensor, part: int) -> None:
        """Copy this rank's vocabulary rows; padding rows past the vocabulary stay zero."""
        piece = tensor.narrow(0, self.start, max(0, self.end - self.start))
        _check_shape(kind, piece, (self.end - self.start, self.weight.shape[1]))
        with torch.no_grad():
            self.weight.zero_()
            self.weight[: piece.shape[0]].copy_(piece)

    def load_quantized(self, weight: QuantizedWeight, part: int) -> None:
        """Keep this rank's vocabulary rows quantised (for the LM head), padded as the plain weight is."""
        rows = weight_rows(weight, self.start, max(0, self.end - self.start))
        self.quantized_parts[part] = pad_weight_rows(rows, self.per_rank)

    def checkpoint_quantized(self) -> QuantizedWeight | None:
        return self.quantized_parts.get(0)


MatmulModule = ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding


def pack_linears(
    modules: Iterable[MatmulModule], compute_dtype: torch.dtype, pack_dtype: torch.dtype, batch_hint: int
) -> None:
    """Reorder each linear's (or LM head's) weight, rounded to compute_dtype, once into oneDNN's layout in pack_dtype.

    Unpacked, oneDNN reorders a bf16 weight on every call, which costs more than the matmul itself at
    decode batch sizes. A column or row linear packed in its compute dtype drops its plain weight, which
    only the matmul read; one packed in fp32 keeps it, for its half-precision kernel's small steps (which
    then hold it) or, without that kernel, one-row matmuls; an embedding keeps it for the lookup.
    """
    for module in modules:
        # A quantised layer packs its quantised weight dequantised: every step size computes the same model.
        source = module.weight if module.quantized is None else module.quantized.weight.dequantize(compute_dtype)
        module.packed = torch.ops.mkldnn._reorder_linear_weight(
            to_dtype(to_dtype(source, compute_dtype), pack_dtype), batch_hint
        )
        if pack_dtype == compute_dtype and not isinstance(module, VocabParallelEmbedding):
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def quantize_matmuls(
    modules: Iterable[MatmulModule],
    bind: KernelBinder,
    max_rows: Callable[[Int8Weight], int],
    int8_weight: Callable[[Int8Weight], Int8Weight] = lambda weight: weight,
) -> None:
    """Give each linear (and the LM head) an int8 copy of its weight as the op table lays it out (int8_weight), run
    by its bound kernel for steps of up to max_rows(weight) rows. Run before pack_linears, which may drop the plain
    weight it packs."""
    for module in modules:
        weight = int8_weight(quantize_int8(module.weight))
        rows = max_rows(weight)
        if rows < 1:
            raise ValueError(f"int8 max_rows must be >= 1, got {rows}")
        module.quantized = QuantizedMatmul(weight, bind, rows)


def attach_half_weights(
    modules: Iterable[MatmulModule],
    compute_dtype: torch.dtype,
    half_weight: Callable[[torch.Tensor], HalfWeight],
    bind: KernelBinder,
    max_rows: Callable[[HalfWeight], int],
) -> None:
    """Give each linear (and the LM head) its own weight in compute_dtype as the op table lays it out (half_weight),
    run by its bound kernel for steps of up to max_rows(weight) rows (where the platform's GEMM would read fp32
    copies, or read few rows slowly). Run before pack_linears."""
    for module in modules:
        weight = half_weight(to_dtype(module.weight.detach(), compute_dtype))
        rows = max_rows(weight)
        if rows < 1:
            raise ValueError(f"half max_rows must be >= 1, got {rows}")
        module.quantized = QuantizedMatmul(weight, bind, rows)


def attach_quantized(modules: Iterable[MatmulModule], bind: KernelBinder, max_rows: int) -> int:
    """Give each module whose checkpoint came quantised (load_quantized) its weight as a QuantizedMatmul, run
    by its bound kernel for steps of up to max_rows rows; returns how many got one. Each must dequantise to exactly the
    plain weight loaded beside it (the same checkpoint, dequantised by its own library): a block layout read
    wrongly fails here, at load, instead of computing another model. Run before pack_linears."""
    if max_rows < 1:
        raise ValueError(f"quantized max_rows must be >= 1, got {max_rows}")
    attached = 0
    for module in modules:
        weight = module.checkpoint_quantized()
        module.quantized_parts = {}
        if weight is None:
            continue
        if not torch.equal(weight.dequantize(module.weight.dtype), module.weight):
            raise ValueError(
                f"a {type(module).__name__} of shape {tuple(module.weight.shape)}: the checkpoint's quantised blocks "
                "do not dequantise to its weight (a block layout this worker reads wrongly)"
            )
        module.quantized = QuantizedMatmul(weight, bind, max_rows)
        attached += 1
    return attached


def release_quantized_weights(modules: Iterable[MatmulModule], compute_dtype: torch.dtype) -> None:
    """After pack_linears: a quantised module without a packed copy gets its quantised weight dequantised
    once into compute_dtype for the steps past max_rows (the LM head too, whose plain weight is the
    unquantised one); then quantised linears drop their plain weight, which nothing reads any more.
    The embedding keeps its own for the token lookup."""
    for module in modules:
        if module.quantized is None:
            continue
        if module.packed is None:
            module.quantized = replace(module.quantized, dense=module.quantized.weight.dequantize(compute_dtype))
        if not isinstance(module, VocabParallelEmbedding):
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
