"""The gateway's tokenizer: a Hugging Face model directory read with `tokenizers` and jinja2 only."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from services.gateway.chat_template import render_chat_template

# The named special tokens transformers exposes to chat templates, in its order.
SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class NoChatTemplateError(ValueError):
    """The model ships no chat template, so chat input cannot be rendered."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as a serialized AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _config_value(config: Mapping[str, Any], key: str) -> Any:
    # Multimodal configs nest the language model's settings under text_config.
    if key in config:
        return config[key]
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping):
        return text_config.get(key)
    return None


def _pick_chat_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # Older configs hold a list of named templates; transformers uses the one named "default".
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


class TextTokenizer:
    """Encodes prompts and chats and decodes ids like transformers' tokenizer for the same directory."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        special_tokens: Mapping[str, str],
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | None = None,
        eos_token_ids: Sequence[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self.special_tokens: dict[str, str] = dict(special_tokens)
        self.chat_template = chat_template
        self.vocab_size: int = vocab_size if vocab_size is not None else tokenizer.get_vocab_size(True)
        self.bos_token_id = self._token_id(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._token_id(self.special_tokens.get("eos_token"))
        eos: list[int] = []
        for i in [*eos_token_ids, self.eos_token_id]:
            if i is not None and i not in eos:
                eos.append(i)
        self.eos_token_ids: list[int] = eos
        special_ids: list[int] = []
        for token in [*self.special_tokens.values(), *extra_special_tokens]:
            tid = self._token_id(token)
            if tid is not None and tid not in special_ids:
                special_ids.append(tid)
        self.all_special_ids: list[int] = special_ids
        # The longest vocabulary entry in UTF-8 bytes: a bound on the input text one token covers, since
        # byte-level and SentencePiece vocabularies spell each token with at least as many bytes as it
        # stands for. Used to refuse text too long to fit before spending time tokenizing it.
        self.max_token_bytes: int = max(
            (len(token.encode()) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> TextTokenizer:
        """Load tokenizer.json and the configs next to it from a Hugging Face model directory."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: the gateway needs a fast tokenizer (tokenizer.json); "
                "re-save the model with a recent transformers to create one"
            )
        tok = Tokenizer.from_file(str(tokenizer_file))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        special_map = _read_json(model_dir / "special_tokens_map.json")
        config = _read_json(model_dir / "config.json")
        gen_config = _read_json(model_dir / "generation_config.json")

        special: dict[str, str] = {}
        for attr in SPECIAL_TOKEN_ATTRIBUTES:
            content = _token_content(tok_config.get(attr, special_map.get(attr)))
            if content is not None:
                special[attr] = content
        extra: list[str] = []
        for key in ("extra_special_tokens", "additional_special_tokens"):
            values = tok_config.get(key, special_map.get(key))
            if isinstance(values, Mapping):
                values = list(values.values())
            for v in values if isinstance(values, list) else []:
                content = _token_content(v)
                if content is not None and content not in extra:
                    extra.append(content)

        # transformers adds named special tokens missing from the vocabulary as new special tokens.
        missing = [t for t in [*special.values(), *extra] if tok.token_to_id(t) is None]
        if missing:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)])

        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            chat_template: str | None = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _pick_chat_template(tok_config.get("chat_template"))

        eos_ids = [
            *_as_id_list(gen_config.get("eos_token_id")),
            *_as_id_list(_config_value(config, "eos_token_id")),
        ]
        vocab = _config_value(config, "vocab_size")
        return cls(
            tok,
            special_tokens=special,
            extra_special_tokens=extra,
            chat_template=chat_template,
            eos_token_ids=eos_ids,
            vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None,
        )

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def backend(self) -> Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return self.chat_template is not None

    def encode(self, text: str) -> list[int]:
        """Tokenize plain text, adding special tokens (e.g. BOS) as transformers' `tokenizer(text)` does.

        tokenizer.json's post-processor decides them; like transformers 5, add_bos_token is ignored.
        """
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Render a conversation with the chat template and the assistant prefix appended."""
        if self.chat_template is None:
            raise NoChatTemplateError(
                "this model has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); send a plain prompt or token_ids instead"
            )
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=True, special_tokens=self.special_tokens
        )

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Render and tokenize a conversation without adding special tokens (the template has them)."""
        return list(self._tok.encode(self.render_chat(messages), add_special_tokens=False).ids)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id, or None when the id is not in the tokenizer."""
        return self._tok.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """The vocabulary strings of ids (None for ids the tokenizer does not know)."""
        return [self._tok.id_to_token(i) for i in ids]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Decode ids to text; ids outside the tokenizer's vocabulary are ignored."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))
