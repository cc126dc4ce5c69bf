"""A tiny random llama model written as a GGUF file the way llama.cpp's converter writes one.

Names in GGUF's scheme, the q and k projections' rows permuted as convert_hf_to_gguf.py permutes a llama
model's, each matmul weight quantised by gguf-py's own quantiser to the format asked for, norms in F32.
The file loads through transformers like a downloaded one, so tests can compare the worker's reading of
the quantised blocks (services/worker/gguf_weights.py) with transformers' dequantisation of the same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Each matmul weight's format by its GGUF name part; the embedding's is its own argument.
DEFAULT_FORMATS = {
    "attn_q": "Q4_1",
    "attn_k": "Q4_1",
    "attn_v": "Q4_0",
    "attn_output": "Q8_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_1",
    "ffn_down": "Q4_0",
}


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows interleaved in pairs (HF rotary -> GGML rotary)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def make_tiny_gguf(
    path: Path,
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    context_length: int = 512,
    formats: dict[str, str] | None = None,
    embedding_format: str = "Q8_0",
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Path:
    """Write the model to path (a .gguf file) and return it; deterministic per seed."""
    import gguf
    import gguf.quants

    formats = {**DEFAULT_FORMATS, **(formats or {})}
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden_size)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(hidden_size // num_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)

    def add(name: str, weights: np.ndarray, kind: str) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        data = weights.astype(np.float32)
        if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = gguf.quants.quantize(data, qtype)
        elif qtype == gguf.GGMLQuantizationType.F16:
            data = data.astype(np.float16)
        writer.add_tensor(name, data, raw_dtype=qtype)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, (rows, cols)).astype(np.float32)

    head_dim = hidden_size // num_heads
    add("token_embd.weight", matrix(vocab_size, hidden_size), embedding_format)
    for layer in range(num_layers):
        blk = f"blk.{layer}"
        add(f"{blk}.attn_norm.weight", 1 + 0.1 * rng.normal(size=hidden_size), "F32")
        add(f"{blk}.attn_q.weight", _permute(matrix(hidden_size, hidden_size), num_heads), formats["attn_q"])
        add(
            f"{blk}.attn_k.weight",
            _permute(matrix(num_kv_heads * head_dim, hidden_size), num_kv_heads),
            formats["attn_k"],
        )
        add(f"{blk}.attn_v.weight", matrix(num_kv_heads * head_dim, hidden_size), formats["attn_v"])
        add(f"{blk}.attn_output.weight", matrix(hidden_size, hidden_size), formats["attn_output"])
        add(f"{blk}.ffn_norm.weight", 1 + 0.1 * rng.normal(size=hidden_size), "F32")
        add(f"{blk}.ffn_gate.weight", matrix(intermediate_size, hidden_size), formats["ffn_gate"])
        add(f"{blk}.ffn_up.weight", matrix(intermediate_size, hidden_size), formats["ffn_up"])
        add(f"{blk}.ffn_down.weight", matrix(hidden_size, intermediate_size), formats["ffn_down"])
    add("output_norm.weight", 1 + 0.1 * rng.normal(size=hidden_size), "F32")
    if not tie_word_embeddings:
        add("output.weight", matrix(vocab_size, hidden_size), embedding_format)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
