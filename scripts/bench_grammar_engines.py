"""Compare structured-output grammar engines (xgrammar, llguidance) on the CPU, with SmolLM2's tokenizer.

For each grammar (a JSON schema, any JSON object, a regex, a choice of 5 strings, a small EBNF) and each
engine that is installed, it measures:

- compile: grammar text to a matcher ready for its first mask (ms, median over --compiles, no cache);
- per-token cost: computing the next-token bitmask plus accepting the token (µs/token, mean and p99) while
  walking a real valid output token by token, then EOS. "cold" is the first walk on a freshly compiled
  grammar (what a new schema costs), "warm" the later walks on new matchers from the same compiled grammar
  (what the worker's compile cache gives a repeated schema).

Both engines run single-threaded (compile threads = 1, one matcher at a time), with the same JSON format
(compact separators ", " and ": ", no free whitespace), so the numbers compare the engines, not the
settings. Prints a markdown table and writes docs/benchmarks/grammar-engines.json.

    .venv/bin/python scripts/bench_grammar_engines.py            # under a minute on 2 quiet cores
    .venv/bin/python scripts/bench_grammar_engines.py --quick    # smoke run

llguidance is a project dependency. xgrammar is not (it imports torch and transformers, and declares
triton, a CUDA-only wheel, on x86_64); to compare against it, install it without its dependencies so the
pinned CPU torch stays put:

    .venv/bin/pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.client.bench.provenance import cpu_model, git_commit  # noqa: E402
from services.common.model_paths import embedded_model_dir  # noqa: E402

OUT = ROOT / "docs" / "benchmarks" / "grammar-engines.json"

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral", "mixed", "unknown"]
ISO_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
# GBNF syntax (root rule "root"), which both engines read.
EBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # json_schema | json_object | regex | choice | ebnf
    source: str
    output: str  # a valid output, walked token by token


CASES = [
    Case(
        "json_schema",
        "json_schema",
        json.dumps(PERSON_SCHEMA),
        json.dumps({"name": "Ada Lovelace", "age": 36, "color": "green", "tags": ["math", "engines", "poetry"]}),
    ),
    Case(
        "json_object",
        "json_object",
        "",
        json.dumps({"id": 7, "ok": True, "items": [{"k": "v", "n": 1.5}, None], "note": "hello world"}),
    ),
    Case("regex_iso_date", "regex", ISO_DATE, "2024-02-29"),
    Case("choice_5", "choice", json.dumps(CHOICES), "neutral"),
    Case("ebnf_arith", "ebnf", EBNF, "12+(34-5)-678"),
]


class Walker(Protocol):
    """One engine's matcher for one walk: fill the next-token mask, then accept a token."""

    def fill(self) -> None: ...
    def allowed(self, token_id: int) -> bool: ...
    def accept(self, token_id: int) -> bool: ...


class Engine(Protocol):
    name: str
    version: str
    setup_ms: float

    def compile(self, case: Case) -> Any: ...
    def walker(self, compiled: Any) -> Walker: ...


class _Bits:
    """An int32 bitmask row, as both engines write it (bit i of word i // 32 = token i allowed)."""

    def __init__(self, vocab_size: int) -> None:
        self.array = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)

    def allowed(self, token_id: int) -> bool:
        return bool((int(self.array[0, token_id >> 5]) >> (token_id & 31)) & 1)


class LlgEngine:
    name = "llguidance"

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos: list[int]) -> None:
        import llguidance

        self.llg = llguidance
        self.version = importlib.metadata.version("llguidance")
        started = time.perf_counter()
        self.tok = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size, eos_token=eos)
        self.setup_ms = (time.perf_counter() - started) * 1e3
        self.vocab_size = vocab_size
        self.json_options: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def grammar(self, case: Case) -> str:
        M = self.llg.LLMatcher
        if case.kind == "json_schema":
            return M.grammar_from_json_schema(case.source, overrides=self.json_options)
        if case.kind == "json_object":
            return M.grammar_from_json_schema('{"type": "object"}', overrides=self.json_options)
        if case.kind == "regex":
            return M.grammar_from_regex(case.source)
        if case.kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(case.source)))
        return self.llg.grammar_from("gbnf", case.source)

    def compile(self, case: Case) -> Any:
        matcher = self.llg.LLMatcher(self.tok, self.grammar(case), log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {case.name}: {matcher.get_error()}")
        return matcher

    def walker(self, compiled: Any) -> Walker:
        return _LlgWalker(compiled.deep_copy(), self.vocab_size)


class _LlgWalker:
    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.m = matcher
        self.bits = _Bits(vocab_size)

    def fill(self) -> None:
        self.m.unsafe_compute_mask_ptr(self.bits.array.ctypes.data, self.bits.array.nbytes)

    def allowed(self, token_id: int) -> bool:
        return self.bits.allowed(token_id)

    def accept(self, token_id: int) -> bool:
        return bool(self.m.consume_token(token_id))


class XgrEngine:
    name = "xgrammar"

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos: list[int], threads: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        self.version = importlib.metadata.version("xgrammar")
        started = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
        # No cache: every compile() below measures a real compilation.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.setup_ms = (time.perf_counter() - started) * 1e3
        self.vocab_size = vocab_size

    def compile(self, case: Case) -> Any:
        c = self.compiler
        if case.kind == "json_schema":
            compiled = c.compile_json_schema(case.source, any_whitespace=False, separators=(", ", ": "))
        elif case.kind == "json_object":
            compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(", ", ": "))
        elif case.kind == "regex":
            compiled = c.compile_regex(case.source)
        elif case.kind == "choice":
            compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(case.source)))
        else:
            compiled = c.compile_grammar(case.source)
        # The matcher is part of the cost of being ready for the first mask, as for llguidance.
        return self.xgr.GrammarMatcher(compiled), compiled

    def walker(self, compiled: Any) -> Walker:
        return _XgrWalker(self.xgr.GrammarMatcher(compiled[1]), self.vocab_size)


class _XgrWalker:
    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import torch

        self.m = matcher
        self.bits = _Bits(vocab_size)
        # xgrammar fills through DLPack; a tensor view of the same buffer keeps allowed() shared.
        self.tensor = torch.from_numpy(self.bits.array)

    def fill(self) -> None:
        self.m.fill_next_token_bitmask(self.tensor)

    def allowed(self, token_id: int) -> bool:
        return self.bits.allowed(token_id)

    def accept(self, token_id: int) -> bool:
        return bool(self.m.accept_token(token_id))


@dataclass
class Result:
    engine: str
    case: str
    tokens: int
    compile_ms: float
    cold_mean_us: float
    cold_p99_us: float
    warm_mean_us: float
    warm_p99_us: float


def p99(xs: list[float]) -> float:
    return float(np.percentile(np.asarray(xs), 99))


def walk(engine: Engine, compiled: Any, tokens: list[int]) -> list[float]:
    """Per-step µs of mask + accept over `tokens` (ending with EOS); raises if the engine disallows one."""
    w = engine.walker(compiled)
    steps: list[float] = []
    for i, tok in enumerate(tokens):
        started = time.perf_counter_ns()
        w.fill()
        ok = w.allowed(tok) and w.accept(tok)
        steps.append((time.perf_counter_ns() - started) / 1e3)
        if not ok:
            raise RuntimeError(f"{engine.name}: token {i} ({tok}) of a valid output was rejected")
    return steps


def bench(engine: Engine, case: Case, tokens: list[int], compiles: int, walks: int) -> Result:
    compile_ms: list[float] = []
    cold: list[float] = []
    compiled: Any = None
    for _ in range(compiles):
        started = time.perf_counter()
        compiled = engine.compile(case)
        compile_ms.append((time.perf_counter() - started) * 1e3)
        cold.extend(walk(engine, compiled, tokens))
    warm: list[float] = []
    for _ in range(walks):
        warm.extend(walk(engine, compiled, tokens))
    return Result(
        engine=engine.name,
        case=case.name,
        tokens=len(tokens),
        compile_ms=statistics.median(compile_ms),
        cold_mean_us=statistics.fmean(cold),
        cold_p99_us=p99(cold),
        warm_mean_us=statistics.fmean(warm),
        warm_p99_us=p99(warm),
    )


def bench_worker_path(model_dir: Path, vocab_size: int, tokens: list[int], walks: int) -> list[dict[str, Any]]:
    """services/worker/grammar.py's per-step cost for a batch: fill_allowed (bitmask + bool unpack) + accepts.

    N requests walk the JSON-schema output in lockstep, as a decode batch would; µs per step.
    """
    from services.common.proto.meshserve.v1 import sampling_pb2
    from services.worker.grammar import GrammarEngine

    engine = GrammarEngine(model_dir, vocab_size)
    grammar = sampling_pb2.Grammar(json_schema=json.dumps(PERSON_SCHEMA))
    out = []
    for n in (1, 8, 32):
        steps: list[float] = []
        for _ in range(walks):
            matchers = [engine.matcher(grammar) for _ in range(n)]
            for tok in tokens:
                started = time.perf_counter_ns()
                mask = engine.fill_allowed(matchers)
                for m in matchers:
                    m.accept(tok)
                steps.append((time.perf_counter_ns() - started) / 1e3)
                assert mask is not None and bool(mask[:, tok].all())
        out.append({"batch": n, "step_mean_us": statistics.fmean(steps), "step_p99_us": p99(steps)})
    return out


def model_eos(model_dir: Path) -> list[int]:
    """EOS ids as the gateway reads them: generation_config.json, then config.json."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            for i in value if isinstance(value, list) else [value]:
                if isinstance(i, int) and i not in ids:
                    ids.append(i)
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the embedded SmolLM2 directory")
    parser.add_argument("--compiles", type=int, default=10, help="compilations (and cold walks) per case")
    parser.add_argument("--walks", type=int, default=50, help="warm walks per case")
    parser.add_argument("--threads", type=int, default=1, help="xgrammar compile threads")
    parser.add_argument("--quick", action="store_true", help="3 compiles, 5 walks; does not write the JSON")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.compiles, args.walks = 3, 5

    model_dir: Path = args.model_dir or embedded_model_dir()
    tokenizer_json = model_dir / "tokenizer.json"
    if not tokenizer_json.exists():
        print(f"{tokenizer_json} does not exist; run `meshserve up` once to fetch the model", file=sys.stderr)
        return 2
    config = json.loads((model_dir / "config.json").read_text())
    hf_tok = Tokenizer.from_file(str(tokenizer_json))
    # The mask covers the model's logits, which may be wider than the tokenizer (padding).
    vocab_size = max(int(config.get("vocab_size", 0)), hf_tok.get_vocab_size(with_added_tokens=True))
    eos = model_eos(model_dir)

    makers: list[tuple[str, Callable[[], Engine]]] = [
        ("llguidance", lambda: LlgEngine(tokenizer_json, vocab_size, eos)),
        ("xgrammar", lambda: XgrEngine(tokenizer_json, vocab_size, eos, args.threads)),
    ]
    engines: list[Engine] = []
    for name, make in makers:
        if importlib.util.find_spec(name) is None:
            print(f"{name} is not installed; skipped", file=sys.stderr)
            continue
        engines.append(make())

    results: list[Result] = []
    for case in CASES:
        tokens = [*hf_tok.encode(case.output, add_special_tokens=False).ids, eos[0]]
        for engine in engines:
            results.append(bench(engine, case, tokens, args.compiles, args.walks))

    cpu = cpu_model() or platform.machine()
    print(f"\nSmolLM2 tokenizer, vocab {vocab_size}; {cpu}; single-threaded\n")
    print("| case | engine | tokens | compile ms | cold µs/tok mean | cold p99 | warm µs/tok mean | warm p99 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.case} | {r.engine} | {r.tokens} | {r.compile_ms:.2f} | {r.cold_mean_us:.1f} | "
            f"{r.cold_p99_us:.1f} | {r.warm_mean_us:.1f} | {r.warm_p99_us:.1f} |"
        )
    ratios: dict[str, dict[str, float]] = {}
    by_key = {(r.case, r.engine): r for r in results}
    if len(engines) == 2:
        print("\nxgrammar / llguidance (> 1: llguidance is cheaper)\n")
        print("| case | compile | cold mean | warm mean | warm p99 |")
        print("|---|---:|---:|---:|---:|")
        for case in CASES:
            x, g = by_key[(case.name, "xgrammar")], by_key[(case.name, "llguidance")]
            ratios[case.name] = {
                "compile": x.compile_ms / g.compile_ms,
                "cold_mean": x.cold_mean_us / g.cold_mean_us,
                "warm_mean": x.warm_mean_us / g.warm_mean_us,
                "warm_p99": x.warm_p99_us / g.warm_p99_us,
            }
            r = ratios[case.name]
            print(
                f"| {case.name} | {r['compile']:.2f} | {r['cold_mean']:.2f} | {r['warm_mean']:.2f} | "
                f"{r['warm_p99']:.2f} |"
            )
    for e in engines:
        print(f"\n{e.name} {e.version}: tokenizer setup {e.setup_ms:.0f} ms")

    worker: list[dict[str, Any]] = []
    if importlib.util.find_spec("llguidance") is not None:
        schema_tokens = [*hf_tok.encode(CASES[0].output, add_special_tokens=False).ids, eos[0]]
        worker = bench_worker_path(model_dir, vocab_size, schema_tokens, max(1, args.walks // 5))
        print("\nworker path (services/worker/grammar.py): fill_allowed [N, V] bool + N accepts, json_schema\n")
        print("| batch | µs/step mean | p99 |")
        print("|---:|---:|---:|")
        for row in worker:
            print(f"| {row['batch']} | {row['step_mean_us']:.0f} | {row['step_p99_us']:.0f} |")

    if not args.quick:
        doc = {
            "generated": datetime.now(UTC).isoformat(timespec="seconds"),
            "commit": git_commit(ROOT),
            "machine": {"cpu": cpu, "arch": platform.machine(), "python": platform.python_version()},
            "tokenizer": str(tokenizer_json.relative_to(model_dir.parent)),
            "vocab_size": vocab_size,
            "eos_token_ids": eos,
            "settings": {
                "compiles": args.compiles,
                "walks": args.walks,
                "threads": args.threads,
                "json_format": "separators ', ' and ': ', no free whitespace (both engines)",
            },
            "engines": {e.name: {"version": e.version, "tokenizer_setup_ms": e.setup_ms} for e in engines},
            "cases": [asdict(c) for c in CASES],
            "results": [asdict(r) for r in results],
            "ratio_xgrammar_over_llguidance": ratios,
            "worker_path_llguidance": worker,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
