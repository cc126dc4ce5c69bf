"""A model directory of a published model's shape with no weights: for `--load-format dummy` benchmarks.

    python -m services.worker.benchmarks.shaped_model llama-3-8b /tmp/llama-3-8b-shaped

writes config.json (the architecture, as the published config.json has it), generation_config.json, and a
word-level tokenizer with one token per id (" <t17>", ...), so the gateway can tokenize and detokenize every id
a random-weight model samples. Serve it with `--load-format dummy` (the worker draws random weights of these
shapes) and send it token ids (`meshserve bench`'s random dataset does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# Llama 3's family traits: vocabulary, special ids, context, rope and norm.
_LLAMA_3: dict[str, Any] = {
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# Published architectures: the fields of their config.json that set a Llama's shapes (Meta's Llama 3 8B and 70B),
# and a tiny one for tests.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        **_LLAMA_3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "llama-3-70b": {
        **_LLAMA_3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|> ' + message['content'] + ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


# SentencePiece's word marker: a token is a space and a word, so ids decode to "<t5> <t77>" and encode back.
SPACE = "\u2581"


def token_name(token_id: int) -> str:
    """The tokenizer's word for an id."""
    return f"{SPACE}<t{token_id}>"


def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token_name(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=token_name(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always")
    # SentencePiece's decoder chain, which llguidance (structured outputs) knows how to read tokens through.
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return str(tokenizer.to_str())


def write_shaped_model(shape: str, path: Path) -> Path:
    """Write the config, generation config and word-level tokenizer of `shape` (a SHAPES key) into path."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    fields = SHAPES[shape]
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        **fields,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    bos, eos = fields["bos_token_id"], fields["eos_token_id"]
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2))
    (path / "tokenizer.json").write_text(_tokenizer_json(fields["vocab_size"]))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_name(bos),
        "eos_token": token_name(eos),
        "add_bos_token": False,
        "model_max_length": fields["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    print(write_shaped_model(args.shape, args.path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
