"""Tiny random Llama/Qwen2 checkpoints with a real tokenizer, and a transformers greedy oracle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Large language models predict the next token from the tokens before it.",
    "A paged key value cache stores attention keys and values in fixed size blocks.",
    "Continuous batching lets new requests join while others are still decoding.",
    "The scheduler decides which requests run; the worker computes and samples tokens.",
    "Once upon a time there was a small model that liked to count: one, two, three, four, five.",
    "Please write a short poem about the sea, the sky, and the mountains in spring.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2024 appear in text too.",
]


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tokenizer


def make_tiny_model(
    path: Path,
    *,
    model_type: str = "llama",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random fp32 model (safetensors) plus tokenizer files to path; deterministic per seed."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if vocab_size < 300:
        raise ValueError("vocab_size must be >= 300 to fit the byte-level tokenizer")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    bos_id = tokenizer.token_to_id("<s>")
    eos_id = tokenizer.token_to_id("</s>")
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        # Large init so logits are far apart and greedy decoding is not a run of near-ties.
        "initializer_range": 0.2,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    if model_type == "llama":
        config: Any = LlamaConfig(**common)
    elif model_type == "qwen2":
        config = Qwen2Config(**common)
    else:
        raise ValueError(f"model_type must be 'llama' or 'qwen2', got {model_type!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Random (not default-zero) biases and norm weights so those code paths are exercised.
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
    model.save_pretrained(path, safe_serialization=True)

    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "add_bos_token": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return path


_ORACLE_CACHE: dict[str, Any] = {}


def transformers_greedy(model_dir: Path | str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation from transformers' generate (fp32, EOS never stops it); new tokens only."""
    from transformers import AutoModelForCausalLM

    key = str(Path(model_dir).resolve())
    model = _ORACLE_CACHE.get(key)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
        # Without an EOS id generate runs exactly max_new_tokens, like our runner driven by a test.
        model.generation_config.eos_token_id = None
        _ORACLE_CACHE[key] = model
    input_ids = torch.tensor([prompt_ids], dtype=torch.int64)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    new_tokens = [int(t) for t in out[0, len(prompt_ids) :].tolist()]
    if len(new_tokens) != max_new_tokens:
        raise AssertionError(f"transformers generated {len(new_tokens)} tokens, wanted {max_new_tokens}")
    return new_tokens
