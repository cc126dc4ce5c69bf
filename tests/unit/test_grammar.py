"""Structured outputs: llguidance masks (services/worker/grammar.py) and the gateway's grammar checks.

Masks are checked two ways: exactly, against a brute-force oracle, on a hand-made byte-level BPE
tokenizer; and statistically, by seeded random walks (uniform over the allowed tokens) whose outputs must
parse and validate, on the tiny tokenizer and on SmolLM2's when the model has been fetched.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.common.grammar_check import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_BYTES,
    check_grammar,
    is_constrained,
)
from services.common.model_paths import embedded_model_dir
from services.common.proto.meshserve.v1 import sampling_pb2
from services.common.sampling_checks import InvalidField
from services.worker.grammar import (
    GrammarCompileError,
    GrammarEngine,
    GrammarMatcher,
    GrammarReplayError,
    GrammarTokenRejected,
)

EOS = 0
PAD = 1
# Multi-character tokens of the tiny vocabulary (byte-level spelling: Ġ is a space). Some span JSON
# structure ('",Ġ"') so that one token crosses several grammar elements.
TINY_WORDS = ['{"', '":', ":Ġ", ",Ġ", '",', '",Ġ"', "ab", "abc", "12", "202", "2024", "na", "nam", "name", "true", 'Ġ"']
# Logits wider than the tokenizer, as models pad them: the extra ids must never be allowed by a grammar.
TINY_PADDING = 37

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
ISO_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
PHONE = r"\+[1-9][0-9]{0,2} [0-9]{3}-[0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral", "mixed", "not sure"]
WALKS = 50
MAX_WALK_TOKENS = 200


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what tokenizers' ByteLevel uses), byte -> printable char."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer.json: <eos>, <pad>, the 256 byte tokens and TINY_WORDS (with prefixes)."""
    vocab: dict[str, int] = {"<eos>": EOS, "<pad>": PAD}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in TINY_WORDS:
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                merges.append((word[: i - 1], word[i - 1]))
                vocab[word[:i]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>", "<pad>"])
    d = tmp_path_factory.mktemp("tiny-tokenizer")
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps({"eos_token_id": EOS, "vocab_size": len(vocab) + TINY_PADDING}))
    return d


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path, tiny_tok: Tokenizer) -> GrammarEngine:
    return GrammarEngine(tiny_dir, tiny_tok.get_vocab_size(with_added_tokens=True) + TINY_PADDING)


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    d = embedded_model_dir()
    if not (d / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 is not fetched into {d} (run `meshserve up` once)")
    return d


@pytest.fixture(scope="module")
def smol(smol_dir: Path) -> GrammarEngine:
    config = json.loads((smol_dir / "config.json").read_text())
    return GrammarEngine(smol_dir, int(config["vocab_size"]))


@pytest.fixture(scope="module")
def smol_tok(smol_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smol_dir / "tokenizer.json"))


def _id(tok: Tokenizer, text: str) -> int:
    tid = tok.token_to_id(text)
    assert tid is not None, text
    return tid


def _g(**kind: Any) -> sampling_pb2.Grammar:
    if "choice" in kind:
        return sampling_pb2.Grammar(choice=sampling_pb2.Choices(choices=kind["choice"]))
    return sampling_pb2.Grammar(**kind)


def _allowed(engine: GrammarEngine, m: GrammarMatcher) -> torch.Tensor:
    mask = engine.fill_allowed([m])
    assert mask is not None
    return mask[0]


def _walk(engine: GrammarEngine, grammar: sampling_pb2.Grammar, rng: random.Random) -> tuple[list[int], bool]:
    """Tokens of one uniform random walk (EOS included when it ends) and whether it terminated."""
    m = engine.matcher(grammar)
    tokens: list[int] = []
    while len(tokens) < MAX_WALK_TOKENS and not m.is_terminated:
        # numpy: torch.nonzero is slow here (it syncs its thread pool) and the walks make ~10k calls.
        allowed = np.flatnonzero(_allowed(engine, m).numpy()).tolist()
        assert allowed, f"no token allowed after {tokens}"
        tok = rng.choice(allowed)
        m.accept(tok)
        tokens.append(tok)
    return tokens, m.is_terminated


def _walk_texts(engine: GrammarEngine, tok: Tokenizer, grammar: sampling_pb2.Grammar, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(WALKS):
        tokens, terminated = _walk(engine, grammar, rng)
        assert terminated, f"walk did not reach EOS in {MAX_WALK_TOKENS} tokens: {tok.decode(tokens)!r}"
        assert tokens[-1] in engine.eos_token_ids and not engine.eos_token_ids & set(tokens[:-1])
        texts.append(tok.decode(tokens[:-1], skip_special_tokens=False))
    return texts


# --- exact masks against an oracle (tiny tokenizer) ---


def _token_bytes(tok: Tokenizer) -> dict[int, bytes]:
    inverse = {c: b for b, c in _bytes_to_unicode().items()}
    out: dict[int, bytes] = {}
    for text, tid in tok.get_vocab(with_added_tokens=True).items():
        if tid not in (EOS, PAD):
            out[tid] = bytes(inverse[c] for c in text)
    return out


def test_choice_masks_match_a_brute_force_oracle(tiny: GrammarEngine, tiny_tok: Tokenizer) -> None:
    choices = ["ab", "abc", "b12", "2024", 'x": "y']
    targets = [c.encode() for c in choices]
    spelled = _token_bytes(tiny_tok)
    rng = random.Random(7)
    for _ in range(30):
        m = tiny.matcher(_g(choice=choices))
        prefix = b""
        while not m.is_terminated:
            expected = {t for t, b in spelled.items() if any(c.startswith(prefix + b) for c in targets)}
            if prefix in targets:
                expected.add(EOS)
            mask = _allowed(tiny, m)
            assert mask.shape == (tiny.vocab_size,)
            allowed = set(mask.nonzero().flatten().tolist())
            # Every allowed token leads to a choice, and (unless the grammar forces the next byte) every
            # token that does is allowed. When bytes are forced, llguidance allows only the tokenizer's
            # own split of them (no non-canonical tokenizations), a subset.
            assert allowed and allowed <= expected, prefix
            rests = {c[len(prefix) : len(prefix) + 1] for c in targets if c.startswith(prefix)}
            if len(rests) > 1:
                assert allowed == expected, prefix
            tok = rng.choice(sorted(allowed))
            m.accept(tok)
            prefix += spelled.get(tok, b"")
        assert prefix in targets


def test_fill_allowed_rows_padding_and_eos(tiny: GrammarEngine, tiny_tok: Tokenizer) -> None:
    assert tiny.fill_allowed([]) is None
    assert tiny.fill_allowed([None, None]) is None
    done = tiny.matcher(_g(regex="[ab]b?"), tiny_tok.encode("ab").ids)
    fresh = tiny.matcher(_g(regex="[ab]b?"))
    mask = tiny.fill_allowed([None, done, fresh, None])
    assert mask is not None and mask.dtype == torch.bool and mask.shape == (4, tiny.vocab_size)
    # Unconstrained rows allow everything, padding ids included; constrained rows never allow padding.
    assert bool(mask[0].all()) and bool(mask[3].all())
    assert not bool(mask[1:3, -TINY_PADDING:].any())
    # A complete grammar allows exactly EOS, so the model can stop; an incomplete one never allows it.
    assert mask[1].nonzero().flatten().tolist() == [EOS]
    assert not bool(mask[2, EOS]) and not bool(mask[:, PAD][1:3].any())
    assert set(mask[2].nonzero().flatten().tolist()) == {_id(tiny_tok, t) for t in ("a", "b", "ab")}
    # The same rows with no unconstrained ones, and one alone, give the same masks.
    assert torch.equal(tiny.fill_allowed([done, fresh]), mask[1:3])  # type: ignore[arg-type]
    assert torch.equal(tiny.fill_allowed([fresh]), mask[2:3])  # type: ignore[arg-type]


def test_tiny_json_schema_walks_validate(tiny: GrammarEngine, tiny_tok: Tokenizer) -> None:
    for text in _walk_texts(tiny, tiny_tok, _g(json_schema=json.dumps(SCHEMA)), seed=1):
        jsonschema.validate(json.loads(text), SCHEMA)


# --- random walks on SmolLM2's tokenizer ---


def test_smollm2_json_schema_walks_validate(smol: GrammarEngine, smol_tok: Tokenizer) -> None:
    texts = _walk_texts(smol, smol_tok, _g(json_schema=json.dumps(SCHEMA)), seed=2)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > WALKS // 2  # the walks explore, not one forced path


def test_smollm2_json_object_walks_parse(smol: GrammarEngine, smol_tok: Tokenizer) -> None:
    # Any object is unbounded, so walks may run out of tokens; every one that ends must be an object.
    rng = random.Random(3)
    ended = 0
    for _ in range(10):
        tokens, terminated = _walk(smol, _g(json_object=True), rng)
        if terminated:
            ended += 1
            assert isinstance(json.loads(smol_tok.decode(tokens[:-1])), dict)
    m = smol.matcher(_g(json_object=True), smol_tok.encode('{"a": [1, {"b": null}]}').ids)
    assert m.is_accepting


@pytest.mark.parametrize("pattern", [ISO_DATE, PHONE])
def test_smollm2_regex_walks_match(smol: GrammarEngine, smol_tok: Tokenizer, pattern: str) -> None:
    for text in _walk_texts(smol, smol_tok, _g(regex=pattern), seed=4):
        assert re.fullmatch(pattern, text), text


def test_smollm2_choice_walks_pick_a_choice(smol: GrammarEngine, smol_tok: Tokenizer) -> None:
    texts = _walk_texts(smol, smol_tok, _g(choice=CHOICES), seed=5)
    assert set(texts) <= set(CHOICES)
    assert len(set(texts)) >= 3


def test_smollm2_ebnf(smol: GrammarEngine, smol_tok: Tokenizer) -> None:
    ebnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
    for text in _walk_texts(smol, smol_tok, _g(ebnf=ebnf), seed=6)[:10]:
        assert re.fullmatch(r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9]))*\)", text), text


# --- replay, rejection, caching ---


def test_replay_equals_incremental_acceptance(smol: GrammarEngine) -> None:
    grammar = _g(json_schema=json.dumps(SCHEMA))
    tokens, terminated = _walk(smol, grammar, random.Random(8))
    assert terminated
    incremental = smol.matcher(grammar)
    for k, tok in enumerate(tokens):
        if k % 3 == 0:
            replayed = smol.matcher(grammar, tokens[:k])
            assert replayed.num_tokens == k
            assert torch.equal(_allowed(smol, replayed), _allowed(smol, incremental)), k
            assert replayed.is_accepting == incremental.is_accepting
        incremental.accept(tok)
    whole = smol.matcher(grammar, tokens)
    assert whole.is_terminated and whole.num_tokens == len(tokens)
    # After EOS (ignore_eos requests run on), more EOS replays and accepts; anything else does not.
    eos = tokens[-1]
    assert smol.matcher(grammar, [*tokens, eos, eos]).num_tokens == len(tokens) + 2
    with pytest.raises(GrammarReplayError):
        smol.matcher(grammar, [*tokens, tokens[0]])


def test_illegal_tokens_raise_and_leave_the_matcher_usable(tiny: GrammarEngine, tiny_tok: Tokenizer) -> None:
    m = tiny.matcher(_g(regex="[0-9]{2}"))
    before = _allowed(tiny, m)
    for bad in (_id(tiny_tok, "a"), EOS, PAD, tiny.vocab_size - 1, tiny.vocab_size, -1):
        with pytest.raises(GrammarTokenRejected) as info:
            m.accept(bad)
        assert info.value.token_id == bad and info.value.position == 0
    assert torch.equal(_allowed(tiny, m), before)
    m.accept(_id(tiny_tok, "12"))
    assert m.is_accepting and not m.is_terminated
    with pytest.raises(GrammarTokenRejected):
        m.accept(_id(tiny_tok, "1"))
    m.accept(EOS)
    assert m.is_terminated
    with pytest.raises(GrammarTokenRejected, match="follows EOS"):
        m.accept(_id(tiny_tok, "1"))
    with pytest.raises(GrammarReplayError) as replay:
        tiny.matcher(_g(regex="[0-9]{2}"), [_id(tiny_tok, "1"), _id(tiny_tok, "a")])
    assert replay.value.position == 1


def test_compile_errors_and_bounded_cache(tiny_dir: Path, tiny_tok: Tokenizer) -> None:
    engine = GrammarEngine(tiny_dir, tiny_tok.get_vocab_size(with_added_tokens=True), cache_size=2)
    with pytest.raises(GrammarCompileError) as info:
        engine.matcher(_g(regex="(ab"))
    assert info.value.field == "sampling.grammar.regex"
    with pytest.raises(GrammarCompileError) as info:
        engine.matcher(_g(json_schema="{"))
    assert info.value.field == "sampling.grammar.json_schema"
    assert engine.cached_grammars == 0
    for pattern in ("a", "b", "a", "c"):
        engine.matcher(_g(regex=pattern))
    assert engine.cached_grammars == 2
    # EOS ids come from the model directory's configs.
    assert engine.eos_token_ids == {EOS}


# --- the gateway's check ---


def _refused(grammar: sampling_pb2.Grammar) -> InvalidField:
    with pytest.raises(InvalidField) as info:
        check_grammar(grammar)
    return info.value


def test_check_grammar_accepts_valid_grammars() -> None:
    check_grammar(sampling_pb2.Grammar())
    check_grammar(_g(json_object=True))
    check_grammar(_g(json_schema=json.dumps(SCHEMA)))
    check_grammar(_g(regex=ISO_DATE))
    check_grammar(_g(choice=CHOICES))
    check_grammar(_g(choice=["x" * MAX_CHOICE_CHARS] * MAX_CHOICES))
    check_grammar(_g(ebnf='root ::= "a" b\nb ::= [0-9]+'))
    check_grammar(_g(regex="a" * MAX_GRAMMAR_BYTES))
    assert is_constrained(sampling_pb2.SamplingParams(grammar=_g(regex="a")))
    assert not is_constrained(sampling_pb2.SamplingParams())


@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf"])
def test_check_grammar_caps_size_before_parsing(kind: str) -> None:
    # Over the cap by one byte (a 2-byte character), and not even valid: the size is what is reported.
    err = _refused(_g(**{kind: "(" * (MAX_GRAMMAR_BYTES - 1) + "é"}))
    assert err.field == f"sampling.grammar.{kind}" and str(MAX_GRAMMAR_BYTES) in err.description


def test_check_grammar_caps_choices() -> None:
    assert _refused(_g(choice=[])).field == "sampling.grammar.choice.choices"
    assert _refused(_g(choice=["x"] * (MAX_CHOICES + 1))).field == "sampling.grammar.choice.choices"
    assert _refused(_g(choice=["a", ""])).field == "sampling.grammar.choice.choices[1]"
    assert _refused(_g(choice=["a", "x" * (MAX_CHOICE_CHARS + 1)])).field == "sampling.grammar.choice.choices[1]"


@pytest.mark.parametrize(
    ("grammar", "field", "words"),
    [
        (_g(json_schema='{"type": "object",'), "sampling.grammar.json_schema", "not valid JSON"),
        (_g(json_schema="[1, 2]"), "sampling.grammar.json_schema", "JSON object"),
        (_g(json_schema='{"type": "strng"}'), "sampling.grammar.json_schema", "strng"),
        (_g(json_schema='{"not": {"type": "string"}}'), "sampling.grammar.json_schema", "Unimplemented"),
        (_g(json_schema='{"type": "string", "pattern": "(a"}'), "sampling.grammar.json_schema", "unclosed group"),
        (_g(regex="(abc"), "sampling.grammar.regex", "unclosed group"),
        (_g(regex="(?=a)b"), "sampling.grammar.regex", "look-around"),
        (_g(regex=""), "sampling.grammar.regex", "empty"),
        (_g(ebnf='root ::= "a" | b'), "sampling.grammar.ebnf", "'b' not found"),
        (_g(ebnf='start ::= "a"'), "sampling.grammar.ebnf", "root"),
        (_g(json_object=False), "sampling.grammar.json_object", "unset grammar"),
    ],
)
def test_check_grammar_refuses_bad_grammars(grammar: sampling_pb2.Grammar, field: str, words: str) -> None:
    err = _refused(grammar)
    assert err.field == field
    assert words in err.description


def test_grammar_check_does_not_import_torch() -> None:
    code = (
        "import sys, json; from services.common.grammar_check import check_grammar; "
        "from services.common.proto.meshserve.v1 import sampling_pb2 as s; "
        "check_grammar(s.Grammar(json_schema=json.dumps({'type': 'object'}))); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
