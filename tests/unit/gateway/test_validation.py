"""validate_and_resolve: every rule names its field, defaults are filled, sizes are checked before tokenizing."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.common.sampling_checks import (
    MAX_CHAT_MESSAGES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from services.gateway.tokenizer import TextTokenizer
from services.gateway.validation import Limits, ValidationError, check_input, validate_and_resolve
from tests.unit.gateway import build_tiny_model_dir

LIMITS = Limits(max_model_len=64, vocab_size=512, max_token_bytes=16)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.from_dir(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _req(sampling: dict[str, Any] | None = None, **kw: Any) -> generation_pb2.GenerateRequest:
    if not ({"prompt", "chat", "token_ids"} & kw.keys()) and not kw.pop("no_input", False):
        kw["prompt"] = "Hello world"
    return generation_pb2.GenerateRequest(sampling=sampling_pb2.SamplingParams(**(sampling or {})), **kw)


def _error(tok: TextTokenizer, req: generation_pb2.GenerateRequest, limits: Limits = LIMITS) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        validate_and_resolve(req, tok, limits)
    err = info.value
    assert str(err).startswith(f"{err.field}: ")
    return err


def _chat(*pairs: tuple[str, str]) -> generation_pb2.Chat:
    return generation_pb2.Chat(messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in pairs])


def test_prompt_defaults(tok: TextTokenizer) -> None:
    req = _req(request_id="r1")
    res = validate_and_resolve(req, tok, LIMITS)
    assert res.input_kind == "prompt"
    assert res.prompt_token_ids == tok.encode("Hello world")
    sp = res.sampling
    assert not sp.HasField("max_tokens"), "the scheduler resolves max_tokens, not the gateway"
    assert (sp.temperature, sp.top_p, sp.top_k) == (1.0, 1.0, 0)
    assert sp.HasField("temperature") and sp.HasField("top_p") and sp.HasField("top_k")
    assert not sp.HasField("seed")
    assert not req.sampling.HasField("max_tokens")  # the request itself is untouched


def test_explicit_values_kept_and_max_tokens_passed_on(tok: TextTokenizer) -> None:
    sampling = {"max_tokens": 5, "temperature": 0.0, "top_p": 0.5, "top_k": -1, "seed": 7, "stop": ["x"]}
    res = validate_and_resolve(_req(sampling), tok, LIMITS)
    sp = res.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (5, 0.0, 0.5, -1, 7)
    assert list(sp.stop) == ["x"]
    # Larger than fits: left for the scheduler, which knows its workers' room, to cap.
    res = validate_and_resolve(_req({"max_tokens": 10_000}), tok, LIMITS)
    assert res.sampling.max_tokens == 10_000


def test_chat_and_token_ids(tok: TextTokenizer) -> None:
    chat = _chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"))
    res = validate_and_resolve(_req(chat=chat), tok, Limits(max_model_len=256, vocab_size=512, max_token_bytes=16))
    assert res.input_kind == "chat"
    msgs = [{"role": m.role, "content": m.content} for m in chat.messages]
    assert res.prompt_token_ids == tok.encode_chat(msgs)
    res = validate_and_resolve(_req(token_ids=generation_pb2.TokenIds(ids=[0, 5, 511])), tok, LIMITS)
    assert (res.input_kind, res.prompt_token_ids) == ("token_ids", [0, 5, 511])


def test_no_input(tok: TextTokenizer) -> None:
    assert _error(tok, _req(no_input=True)).field == "input"


def test_empty_inputs(tok: TextTokenizer) -> None:
    assert _error(tok, _req(prompt="")).field == "prompt"
    assert _error(tok, _req(chat=generation_pb2.Chat())).field == "chat.messages"
    assert _error(tok, _req(token_ids=generation_pb2.TokenIds())).field == "token_ids.ids"


def test_bad_chat_role(tok: TextTokenizer) -> None:
    err = _error(tok, _req(chat=_chat(("user", "a"), ("tool", "b"))))
    assert err.field == "chat.messages[1].role"
    assert "'tool'" in err.description and "system, user, assistant" in err.description


def test_no_chat_template(tmp_path: Path) -> None:
    tok = TextTokenizer.from_dir(build_tiny_model_dir(tmp_path, with_template=False))
    err = _error(tok, _req(chat=_chat(("user", "a"))))
    assert err.field == "chat" and "chat template" in err.description


def test_template_raise_exception_is_invalid_argument(tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    tok = TextTokenizer.from_dir(build_tiny_model_dir(tmp_path, template_file=template))
    err = _error(tok, _req(chat=_chat(("assistant", "a"))))
    assert err.field == "chat" and "first must be user" in err.description


@pytest.mark.parametrize(
    ("kind", "field"), [("prompt", "prompt"), ("chat", "chat.messages"), ("token_ids", "token_ids.ids")]
)
def test_prompt_too_long(tok: TextTokenizer, kind: str, field: str) -> None:
    # 40 tokens of up to 16 bytes: the 450-byte text passes the byte check and fails on its token count.
    limits = Limits(max_model_len=40, vocab_size=512, max_token_bytes=16)
    long_text = "The quick brown fox jumps over the lazy dog. " * 10
    inputs: dict[str, dict[str, Any]] = {
        "prompt": {"prompt": long_text},
        "chat": {"chat": _chat(("user", long_text))},
        "token_ids": {"token_ids": generation_pb2.TokenIds(ids=[5] * 40)},
    }
    err = _error(tok, _req(**inputs[kind]), limits)
    assert err.field == field
    assert "40" in err.description and "--max-model-len" in err.description and "shorten" in err.description


def test_prompt_must_leave_one_token(tok: TextTokenizer) -> None:
    limits = Limits(max_model_len=4, vocab_size=512, max_token_bytes=16)
    assert _error(tok, _req(token_ids=generation_pb2.TokenIds(ids=[1, 2, 3, 4])), limits).field == "token_ids.ids"
    res = validate_and_resolve(_req(token_ids=generation_pb2.TokenIds(ids=[1, 2, 3])), tok, limits)
    assert res.prompt_token_ids == [1, 2, 3]


class _NoTokenizer:
    """Fails the test if anything tries to tokenize."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"tokenizer.{name} used for input that should be refused by its size")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": "x" * (LIMITS.max_text_bytes + 1)}, "prompt"),
        # Multi-byte characters count as bytes, not characters.
        ({"prompt": "é" * (LIMITS.max_text_bytes // 2 + 1)}, "prompt"),
        ({"chat": _chat(("user", "x" * (LIMITS.max_text_bytes // 2)), ("user", "y" * 600))}, "chat.messages"),
        ({"chat": _chat(*[("user", "hi")] * (MAX_CHAT_MESSAGES + 1))}, "chat.messages"),
        ({"token_ids": generation_pb2.TokenIds(ids=[600] * 100_000)}, "token_ids.ids"),
    ],
)
def test_oversized_input_refused_before_tokenizing(kwargs: dict[str, Any], field: str) -> None:
    err = _error(_NoTokenizer(), _req(**kwargs))  # type: ignore[arg-type]
    assert err.field == field
    if "prompt" in kwargs:
        assert f"at most {LIMITS.max_text_bytes} bytes" in err.description and "shorten" in err.description


def test_input_at_the_byte_bound_is_tokenized(tok: TextTokenizer) -> None:
    limits = Limits(max_model_len=1024, vocab_size=512, max_token_bytes=1)
    checked = check_input(_req(prompt="a" * 1024), limits)
    assert checked.text == "a" * 1024
    # 1024 one-byte tokens do not leave room for an answer: refused on the token count instead.
    assert _error(tok, _req(prompt="a" * 1024), limits).field == "prompt"


@pytest.mark.parametrize(
    ("sampling", "field", "needle"),
    [
        ({"max_tokens": 0}, "sampling.max_tokens", ">= 1"),
        ({"max_tokens": -3}, "sampling.max_tokens", "-3"),
        ({"temperature": -0.1}, "sampling.temperature", ">= 0"),
        ({"temperature": math.nan}, "sampling.temperature", "nan"),
        ({"temperature": math.inf}, "sampling.temperature", "finite"),
        ({"top_p": 1.5}, "sampling.top_p", "top_p must be in (0, 1]; got 1.5"),
        ({"top_p": 0.0}, "sampling.top_p", "(0, 1]"),
        ({"top_p": math.nan}, "sampling.top_p", "(0, 1]"),
        ({"top_k": -2}, "sampling.top_k", ">= -1"),
        ({"stop_token_ids": [3, 512]}, "sampling.stop_token_ids[1]", "512"),
        ({"stop_token_ids": [-1]}, "sampling.stop_token_ids[0]", "-1"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "sampling.stop", f"at most {MAX_STOP_STRINGS}"),
        ({"stop": ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]}, "sampling.stop[1]", f"limit is {MAX_STOP_STRING_CHARS}"),
        ({"stop": ["ok", ""]}, "sampling.stop[1]", "empty"),
        (
            {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
            "sampling.stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS}",
        ),
    ],
)
def test_sampling_rules(tok: TextTokenizer, sampling: dict[str, Any], field: str, needle: str) -> None:
    err = _error(tok, _req(sampling))
    assert err.field == field
    assert needle in err.description


def test_boundary_values_accepted(tok: TextTokenizer) -> None:
    sampling = {"top_p": 1.0, "top_k": -1, "temperature": 0.0, "max_tokens": 1, "stop_token_ids": [0, 511]}
    validate_and_resolve(_req(sampling), tok, LIMITS)
    validate_and_resolve(_req({"stop": ["a"] * (MAX_STOP_STRINGS - 1) + ["x" * MAX_STOP_STRING_CHARS]}), tok, LIMITS)
    validate_and_resolve(_req({"stop_token_ids": [3] * MAX_STOP_TOKEN_IDS}), tok, LIMITS)


@pytest.mark.parametrize(("ids", "index"), [([1, 2, 3, 512], 3), ([-5], 0), ([0, 99999], 1)])
def test_token_id_out_of_range(tok: TextTokenizer, ids: list[int], index: int) -> None:
    err = _error(tok, _req(token_ids=generation_pb2.TokenIds(ids=ids)))
    assert err.field == f"token_ids.ids[{index}]"
    assert str(ids[index]) in err.description and "512" in err.description
