"""IncrementalDetokenizer: deltas concatenate to the full decode and never split a character."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.tokenizer import TextTokenizer
from tests.unit.gateway import build_tiny_model_dir

MULTIBYTE_TEXTS = [
    "🙂",
    "日本語のテキスト",
    "mixed 🚀 text 中文 with 👩‍💻 emoji",
    "Ünïcödé “quotes” — 🎉🎉🎉",
    "\U0001d518\U0001d52b\U0001d526 \u222e \u214b",  # characters the tiny BPE never saw: pure byte tokens
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.from_dir(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _stream(tok: TextTokenizer, prompt: list[int], out: list[int], rng: random.Random, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas: list[str] = []
    i = 0
    while i < len(out):
        n = rng.randint(1, 3)  # steps may carry several ids (speculative / batched delivery)
        deltas.append(detok.add(out[i : i + n]))
        i += n
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def _check(tok: TextTokenizer, prompt: list[int], out: list[int], rng: random.Random, skip: bool = True) -> None:
    deltas = _stream(tok, prompt, out, rng, skip)
    full = tok.decode(out, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas), deltas


def test_multibyte_text_streams_whole_characters(tok: TextTokenizer) -> None:
    rng = random.Random(0)
    prompt = tok.encode("Say something:")
    for text in MULTIBYTE_TEXTS:
        out = tok.encode(text)
        assert len(out) > len(text) // 2  # really split over byte tokens
        _check(tok, prompt, out, rng)
        # One id at a time as well, and every delta is whole characters of the target text.
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.add([i]) for i in out]
        assert "".join(deltas) == text
        assert "" in deltas  # some steps had to hold back an incomplete character


def test_random_token_sequences(tok: TextTokenizer) -> None:
    rng = random.Random(1234)
    vocab = tok.backend.get_vocab_size(True)
    for _ in range(300):
        prompt = tok.encode(rng.choice(["", "Hi", "日本", "Q: 🙂?"]))
        out = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        _check(tok, prompt, out, rng, skip=rng.random() < 0.7)


def test_random_valid_text_sequences(tok: TextTokenizer) -> None:
    rng = random.Random(99)
    alphabet = list("abc xyz.,\n") + list("日本語中文🙂🚀é“”—\U0001d518")
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        out = tok.encode(text)
        _check(tok, tok.encode("prompt "), out, rng)
        assert tok.decode(out) == text


def test_special_tokens_skipped_or_kept(tok: TextTokenizer) -> None:
    out = [*tok.encode("Hello"), 2, *tok.encode(" world")]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert "".join(detok.add([i]) for i in out) == "Hello world"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(detok.add([i]) for i in out) == "Hello<|im_end|> world"


def test_empty_add_and_flush(tok: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert detok.add([]) == ""
    assert detok.flush() == ""
    lone_byte = tok.encode("🙂")[:1]
    assert detok.add(lone_byte) == ""  # held: the emoji is incomplete
    assert detok.flush() == "\ufffd"  # the request ended mid-character: emit what decode gives
    assert detok.output_token_ids == lone_byte


@pytest.mark.slow
def test_smollm2_streams(smollm2_dir: Path) -> None:
    tok = TextTokenizer.from_dir(smollm2_dir)
    rng = random.Random(7)
    prompt = tok.encode_chat([{"role": "user", "content": "Write something"}])
    for text in MULTIBYTE_TEXTS:
        _check(tok, prompt, tok.encode(text), rng)
    for _ in range(100):
        _check(tok, prompt, [rng.randrange(tok.vocab_size) for _ in range(20)], rng)


def test_prompt_window_gives_sentencepiece_leading_space() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = TextTokenizer(backend, special_tokens={"unk_token": "<unk>"})
    assert tok.decode([2]) == "world"  # decoded alone, SentencePiece drops the leading space
    detok = IncrementalDetokenizer(tok, [1])
    assert [detok.add([2]), detok.add([3])] == [" world", "!"]
    # With no prompt the first token starts the text, exactly like a full decode.
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add([1]) + detok.add([2]) == "Hello world"
