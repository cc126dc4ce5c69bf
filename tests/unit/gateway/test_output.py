"""OutputProcessor: the scheduler's stop kind decides trimming; stop strings; usage."""

from __future__ import annotations

import pytest

from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2
from services.gateway.output import OutputProcessor
from services.gateway.tokenizer import TextTokenizer
from tests.unit.gateway import build_tiny_model_dir

STOP, LENGTH = sampling_pb2.FINISH_REASON_STOP, sampling_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.from_dir(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _event(ids: list[int], finish: int = 0, kind: int = 0, stop_id: int | None = None) -> scheduler_pb2.TokenEvent:
    event = scheduler_pb2.TokenEvent(token_ids=ids, finish_reason=finish, stop_kind=kind)  # type: ignore[arg-type]
    if stop_id is not None:
        event.stop_token_id = stop_id
    return event


def _run(tok: TextTokenizer, events: list[scheduler_pb2.TokenEvent]) -> tuple[str, str, int]:
    processor = OutputProcessor(tok, tok.encode("Hello"), sampling_pb2.SamplingParams())
    text = ""
    for event in events:
        out = processor.process(event)
        text += out.response.text
        if out.final:
            return text, out.response.stop_reason, out.response.finish_reason
    raise AssertionError("no final output")


@pytest.mark.parametrize(
    ("kind", "stop_id", "trimmed", "stop_reason"),
    [
        (scheduler_pb2.STOP_KIND_EOS, None, True, ""),
        (scheduler_pb2.STOP_KIND_STOP_TOKEN, "last", True, "last"),
        (scheduler_pb2.STOP_KIND_LENGTH, None, False, ""),
    ],
)
def test_stop_kind_decides_trimming(
    tok: TextTokenizer, kind: int, stop_id: str | None, trimmed: bool, stop_reason: str
) -> None:
    ids = tok.encode(" world fox")
    last = ids[-1]
    finish = LENGTH if kind == scheduler_pb2.STOP_KIND_LENGTH else STOP
    events = [_event(ids[:-1]), _event([last], finish, kind, last if stop_id else None)]
    text, reason, got_finish = _run(tok, events)
    full = tok.decode(ids)
    assert text == (tok.decode(ids[:-1]) if trimmed else full)
    assert reason == (str(last) if stop_reason else "")
    assert got_finish == finish


def test_eos_id_is_not_trimmed_unless_the_scheduler_says_so(tok: TextTokenizer) -> None:
    # The gateway no longer decides EOS: a final LENGTH event ending in an eos id keeps its text.
    ids = tok.encode(" fox")
    events = [_event(ids, LENGTH, scheduler_pb2.STOP_KIND_LENGTH)]
    assert _run(tok, events)[0] == tok.decode(ids)


def test_stop_string_ends_the_request_here(tok: TextTokenizer) -> None:
    ids = tok.encode(" The quick brown fox jumps")
    processor = OutputProcessor(tok, tok.encode("Hello"), sampling_pb2.SamplingParams(stop=["brown"]))
    texts = []
    for i in ids:
        out = processor.process(_event([i]))
        texts.append(out.response.text)
        if out.final:
            break
    assert out.final and out.stopped_by_string
    assert out.response.finish_reason == STOP and out.response.stop_reason == "brown"
    assert "".join(texts) == " The quick "


def test_usage_counts_cached_tokens(tok: TextTokenizer) -> None:
    processor = OutputProcessor(tok, [1, 2, 3, 4], sampling_pb2.SamplingParams())
    first = scheduler_pb2.TokenEvent(token_ids=[5], num_cached_tokens=2)
    assert not processor.process(first).final
    out = processor.process(_event([6], LENGTH, scheduler_pb2.STOP_KIND_LENGTH))
    usage = out.response.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (4, 2, 2)
