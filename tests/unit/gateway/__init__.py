"""Gateway unit tests; `build_tiny_model_dir` makes a small Hugging Face style tokenizer directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Streaming text generation turns token ids into text one delta at a time.",
    "日本語のテキストも少し入れておきます。中文也有一点。",
    "Emoji are split over several byte tokens: 🙂 🚀 👩‍💻 🎉",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé àccents — and “quotes” — matter too.",
] * 4

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_model_dir(
    path: Path,
    *,
    vocab_size: int = 400,
    model_vocab_size: int = 512,
    tokenizer_config: dict[str, Any] | None = None,
    template_file: str | None = None,
    with_template: bool = True,
) -> Path:
    """Train a byte-level BPE on CORPUS; write tokenizer.json, tokenizer_config.json and configs to path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
    }
    if with_template and template_file is None:
        config["chat_template"] = CHATML_TEMPLATE
    config.update(tokenizer_config or {})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (path / "chat_template.jinja").write_text(template_file)
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": model_vocab_size,
                "max_position_embeddings": 256,
                "eos_token_id": 0,
                "bos_token_id": 1,
            }
        )
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path
