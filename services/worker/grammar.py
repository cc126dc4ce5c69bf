"""Structured outputs on the worker: llguidance matchers per request and the batch's allowed-token mask.

One GrammarEngine per worker holds the model's tokenizer as llguidance sees it (its token trie takes
~0.3 s to build) and a bounded cache of compiled grammars. Each constrained request gets a GrammarMatcher,
rebuilt from its output tokens when the request arrives (fresh, or moved here after a failure), so the
constraint's state never has to travel between workers. Before sampling, fill_allowed gives a bool mask
[N, vocab]; after sampling, accept advances each matcher.

Grammar texts come from services.common.grammar_check, the same translation the gateway validated.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import torch
from tokenizers import Tokenizer

from services.common.grammar_check import llguidance_grammar
from services.common.proto.meshserve.v1 import sampling_pb2
from services.common.sampling_checks import InvalidField

DEFAULT_CACHE_SIZE = 128


class GrammarError(ValueError):
    """A grammar could not be compiled, or the output broke it."""


class GrammarCompileError(GrammarError):
    """The grammar is invalid or over the engine's limits; `field` names the request field."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


class GrammarTokenRejected(GrammarError):
    """`token_id`, at output position `position`, is not allowed by the grammar there."""

    def __init__(self, token_id: int, position: int, reason: str) -> None:
        super().__init__(f"output token {position} (id {token_id}) {reason}")
        self.token_id = token_id
        self.position = position


class GrammarReplayError(GrammarTokenRejected):
    """A request's already generated tokens do not satisfy its grammar (they came from elsewhere)."""


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe; owned by the model runner's loop."""

    __slots__ = ("_engine", "_inner", "_num_tokens", "_terminated")

    def __init__(self, engine: GrammarEngine, inner: llguidance.LLMatcher) -> None:
        self._engine = engine
        self._inner = inner
        self._num_tokens = 0
        self._terminated = False

    @property
    def is_terminated(self) -> bool:
        """An EOS token was accepted: the grammar is complete and the output over."""
        return self._terminated

    @property
    def is_accepting(self) -> bool:
        """The output so far satisfies the grammar, so EOS is allowed now."""
        return self._terminated or self._inner.is_accepting()

    @property
    def num_tokens(self) -> int:
        """Output tokens accepted so far (replayed ones included)."""
        return self._num_tokens

    def accept(self, token_id: int) -> None:
        """Advance by one sampled token; GrammarTokenRejected when the grammar does not allow it here.

        A rejected token leaves the matcher where it was (try_consume_tokens never enters llguidance's
        sticky error state), so the caller may still abort the request cleanly or retry.
        """
        self._advance(token_id, GrammarTokenRejected)

    def _advance(self, token_id: int, error: type[GrammarTokenRejected]) -> None:
        engine = self._engine
        if token_id in engine.eos_token_ids:
            if self._terminated:
                # Under ignore_eos the request runs on after the grammar is done; EOS is all it may add.
                self._num_tokens += 1
                return
            if not self._inner.is_accepting():
                raise error(token_id, self._num_tokens, "is EOS, but the output does not satisfy the grammar yet")
            if not self._inner.consume_token(token_id):
                raise error(token_id, self._num_tokens, f"is EOS, refused: {self._inner.get_error()[:300]}")
            self._terminated = True
            self._num_tokens += 1
            return
        if self._terminated:
            raise error(token_id, self._num_tokens, "follows EOS; only EOS may follow a completed grammar")
        if not 0 <= token_id < engine.vocab_size or self._inner.try_consume_tokens([token_id]) != 1:
            raise error(token_id, self._num_tokens, f"({engine.describe(token_id)}) is not allowed by the grammar here")
        self._num_tokens += 1

    def _replay(self, token_ids: Sequence[int]) -> None:
        tokens = list(token_ids)
        if tokens and min(tokens) >= 0 and max(tokens) < self._engine.vocab_size:
            # One call for the common case; it stops at the first EOS or refused token, which the
            # per-token path below then handles (and names in its error).
            done = self._inner.try_consume_tokens(tokens)
            self._num_tokens = done
            tokens = tokens[done:]
        for tok in tokens:
            self._advance(tok, GrammarReplayError)


class GrammarEngine:
    """Compiles grammars against one model's tokenizer and builds the batch's token masks."""

    def __init__(
        self,
        tokenizer_dir: Path,
        vocab_size: int,
        *,
        eos_token_ids: Sequence[int] | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
        num_threads: int | None = None,
    ) -> None:
        """`vocab_size` is the model's logits width, which may exceed the tokenizer's (padding).

        `eos_token_ids` defaults to the model directory's, read as the gateway reads them
        (generation_config.json, config.json, then tokenizer_config.json's eos_token). `num_threads`
        sizes llguidance's mask thread pool (None: its default, 80% of the CPUs up to 32).
        """
        tokenizer_file = Path(tokenizer_dir) / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found: structured outputs need the model's tokenizer.json")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1; got {vocab_size}")
        if sys.byteorder != "little":
            # fill_allowed reads llguidance's u32 bitmask as bytes; x86_64 and aarch64 are little-endian.
            raise RuntimeError("structured outputs need a little-endian host")
        hf_tokenizer = Tokenizer.from_file(str(tokenizer_file))
        if eos_token_ids is None:
            eos_token_ids = model_eos_token_ids(tokenizer_dir, hf_tokenizer)
        eos = list(dict.fromkeys(eos_token_ids))
        tok_vocab = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size = vocab_size
        # llguidance's vocabulary must cover every tokenizer id; when the logits are wider, the extra
        # (padding) ids are never allowed. When they are narrower, the mask is cut to the logits below.
        self._llg_vocab = max(vocab_size, tok_vocab)
        self._tokenizer = llguidance.LLTokenizer(str(tokenizer_file), n_vocab=self._llg_vocab, eos_token=eos or None)
        # Without ids from the caller or the configs, llguidance's guess from the tokenizer.
        self.eos_token_ids: frozenset[int] = frozenset(eos or self._tokenizer.eos_tokens)
        self._words = (self._llg_vocab + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads)
        self._cache: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = max(1, cache_size)

    def matcher(self, grammar: sampling_pb2.Grammar, output_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher for `grammar` positioned after `output_token_ids`.

        GrammarCompileError when the grammar does not compile, GrammarReplayError when the tokens break it.
        """
        m = GrammarMatcher(self, self._compiled(grammar).deep_copy())
        m._replay(output_token_ids)
        return m

    def fill_allowed(self, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor | None:
        """Bool [len(matchers), vocab_size] on the CPU, True = allowed; None rows all True; None if all are None.

        Masks are computed into one int32 bitmask by llguidance's thread pool (GIL released), then unpacked
        to bools in one vectorised pass. Once a grammar is satisfied its row allows the EOS ids (alone when
        nothing may follow), so the model can stop.
        """
        live = [(i, m) for i, m in enumerate(matchers) if m is not None]
        if not live:
            return None
        k = len(live)
        index = [i for i, _ in live]
        # Only constrained rows are computed and unpacked (the unpack is most of the cost).
        rows = [(m._inner, j) for j, (_, m) in enumerate(live)]
        bitmask = np.empty((k, self._words), dtype=np.int32)
        if k == 1:
            # One row: on this thread, without a hand-off to the pool (a wake-up costs more than the mask).
            rows[0][0].unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        else:
            self._executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, self._words * 4, k)
        # Token t is bit t % 32 of word t // 32; in little-endian memory that is bit t % 8 of byte t // 8.
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
        if k == len(matchers):
            return allowed
        out = torch.ones((len(matchers), self.vocab_size), dtype=torch.bool)
        out[index] = allowed
        return out

    def describe(self, token_id: int) -> str:
        """A short quoted rendering of a token, for errors."""
        if not 0 <= token_id < self._llg_vocab:
            return f"outside the vocabulary [0, {self.vocab_size})"
        return self._tokenizer.dbg_tokens([token_id])

    @property
    def cached_grammars(self) -> int:
        """Compiled grammars held (at most cache_size)."""
        return len(self._cache)

    def _compiled(self, grammar: sampling_pb2.Grammar) -> llguidance.LLMatcher:
        # Serialized bytes identify the grammar exactly (deterministic: same message, same key).
        key = grammar.SerializeToString(deterministic=True)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        try:
            text = llguidance_grammar(grammar)
        except InvalidField as err:
            raise GrammarCompileError(err.field, err.description) from err
        compiled = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if compiled.is_error():
            kind = grammar.WhichOneof("kind")
            field = "sampling.grammar.choice.choices" if kind == "choice" else f"sampling.grammar.{kind}"
            raise GrammarCompileError(field, f"the grammar engine refused it: {compiled.get_error()[:600]}")
        # A fresh matcher is the compiled form: each request deep-copies it (microseconds), sharing the
        # lexer's lazily built states, so a repeated grammar also gets cheaper masks.
        self._cache[key] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled


def model_eos_token_ids(model_dir: Path, tokenizer: Tokenizer | None = None) -> list[int]:
    """EOS ids of a Hugging Face model directory, in the gateway's order (see services/gateway/tokenizer.py)."""
    model_dir = Path(model_dir)
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        ids.extend(i for i in (value if isinstance(value, list) else [value]) if isinstance(i, int))
    token = _read_json(model_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    tokenizer_file = model_dir / "tokenizer.json"
    if isinstance(token, str) and (tokenizer is not None or tokenizer_file.is_file()):
        tid = (tokenizer or Tokenizer.from_file(str(tokenizer_file))).token_to_id(token)
        if tid is not None:
            ids.append(tid)
    return list(dict.fromkeys(ids))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
