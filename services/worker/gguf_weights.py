"""A GGUF file's matmul weights in their quantised blocks, as they are (`--quantization gguf`).

transformers loads a GGUF by dequantising every tensor to float (weights.iter_weights); this reads the
blocks themselves of the formats the worker has kernels for, so small steps multiply by them directly:
Q4_0 and Q4_1 as 4-bit codes with a scale and offset per 32 columns (Int4Weight), Q8_0 as int8 with a
scale per 32 columns (Int8Weight). Every other format (the K-quants, F16, ...) stays with the dense
weights transformers dequantised.

Names are mapped to the Hugging Face names the model loads (llama and qwen2 layouts), and llama.cpp's
row permutation of a llama model's q and k projections is undone as transformers undoes it, so block
rows line up with the dequantised tensors (model_runner checks that they do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from services.worker.layers.quantization import (
    INT4_BLOCK,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    reorder_rows,
    weight_rows_count,
)

# Bytes a block of the formats read here; each block holds INT4_BLOCK (32) columns, Q8_0's too.
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
# Per decoder layer: GGUF's tensor name -> the Hugging Face module it loads into.
_LAYER_MATMULS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Outside the layers: the embedding (the LM head too, where tied) and an untied LM head.
_TOP_MATMULS = {"token_embd": "model.embed_tokens", "output": "lm_head"}
# Architectures whose converter permuted the q/k rows (llama.cpp's LlamaModel; Mistral files say llama).
_PERMUTED_ARCHITECTURES = ("llama",)


@dataclass
class GGUFMatmulWeights:
    """What read_matmul_weights found: quantised weights by HF name, and matmul weights left dense (by
    HF name, with their GGUF format) for want of a kernel."""

    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    dense: dict[str, str] = field(default_factory=dict)


def hf_matmul_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF matmul weight (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight),
    None for anything else (norms, rope tables, biases)."""
    parts = gguf_name.split(".")
    if parts[-1] != "weight":
        return None
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_MATMULS:
        return f"model.layers.{int(parts[1])}.{_LAYER_MATMULS[parts[2]]}.weight"
    if len(parts) == 2 and parts[0] in _TOP_MATMULS:
        return f"{_TOP_MATMULS[parts[0]]}.weight"
    return None


def _halves(raw: np.ndarray, start: int) -> torch.Tensor:
    """Float16 fields (scale d, offset m) of every block at byte `start`, widened to float32 (exactly)."""
    halves = np.ascontiguousarray(raw[:, :, start : start + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(halves.astype(np.float32))


def decode_blocks(kind: str, data: np.ndarray, in_features: int) -> QuantizedWeight:
    """One tensor's blocks ([rows, bytes a row], GGUF's row-major order) as the worker's weight format."""
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"no kernel for GGUF format {kind}")
    raw = data.reshape(data.shape[0], in_features // INT4_BLOCK, _BLOCK_BYTES[kind])
    rows = raw.shape[0]
    if kind == "Q8_0":  # d (f16), 32 x int8
        codes = np.ascontiguousarray(raw[:, :, 2:]).view(np.int8).reshape(rows, in_features)
        return Int8Weight(torch.from_numpy(codes.copy()), _halves(raw, 0).contiguous())
    if kind == "Q4_0":  # d (f16), 16 bytes of nibbles; w = d * (q - 8)
        scales = _halves(raw, 0)
        packed = np.ascontiguousarray(raw[:, :, 2:]).reshape(rows, in_features // 2)
        # -8 * d is exact, and so is d * q - 8 * d (it is d * (q - 8), which float32 holds exactly).
        return Int4Weight(torch.from_numpy(packed.copy()), scales.contiguous(), (-8 * scales).contiguous())
    # Q4_1: d (f16), m (f16), 16 bytes of nibbles; w = d * q + m
    packed = np.ascontiguousarray(raw[:, :, 4:]).reshape(rows, in_features // 2)
    return Int4Weight(torch.from_numpy(packed.copy()), _halves(raw, 0).contiguous(), _halves(raw, 2).contiguous())


def unpermute_rows(weight: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    """Undo llama.cpp's q/k permutation (rows of each head interleaved in pairs), on whole rows of blocks."""
    rows = weight_rows_count(weight)
    order = torch.arange(rows).view(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)
    return reorder_rows(weight, order)


def read_matmul_weights(path: Path, *, num_heads: int, num_kv_heads: int) -> GGUFMatmulWeights:
    """Every matmul weight of the GGUF file at path: quantised where the worker has a kernel for its format."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    architecture = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else ""
    found = GGUFMatmulWeights()
    for tensor in reader.tensors:
        hf_name = hf_matmul_name(tensor.name)
        if hf_name is None:
            continue
        kind = tensor.tensor_type.name
        # GGUF lists dimensions fastest first: [in_features, out_features].
        in_features = int(tensor.shape[0])
        if kind not in _BLOCK_BYTES or len(tensor.shape) != 2:
            found.dense[hf_name] = kind
            continue
        weight = decode_blocks(kind, np.asarray(tensor.data), in_features)
        if architecture in _PERMUTED_ARCHITECTURES and ".self_attn.q_proj." in hf_name:
            weight = unpermute_rows(weight, num_heads)
        elif architecture in _PERMUTED_ARCHITECTURES and ".self_attn.k_proj." in hf_name:
            weight = unpermute_rows(weight, num_kv_heads)
        found.quantized[hf_name] = weight
    return found
