"""How far a --precision (and --quantization) drifts from fp32: relative logit error on fixed prompts and
greedy agreement.

    python -m services.worker.benchmarks.precision_check --precision bf16-fp16-fp32
    python -m services.worker.benchmarks.precision_check --precision bf16-bf16-fp32 --quantization int8
    python -m services.worker.benchmarks.precision_check --precision bf16-bf16-bf16 --quantization gguf

--quantization gguf tests a GGUF file (--tested-model; default: the embedded model's own Q4_1 file) against
fp32 of --model: for the embedded model that directory is the same file dequantised, so the figure is what
multiplying the blocks in the tested precision costs, not what Q4_1 cost the original weights.

For each prompt, fp32 decodes greedily; the tested precision then decodes the same prompt twice: once
teacher-forced on fp32's tokens (so logits compare position by position) and once freely (so whole
greedy outputs compare).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.worker.engine_config import QUANTIZATIONS, EngineConfig
from services.worker.model_runner import ModelRunner

# Chat prompts of different kinds; fixed so results compare across runs and machines.
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 50.",
    "Explain what a hash table is in one sentence.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Give me a short tip for sleeping better.",
    "Name the planets of the solar system in order.",
    "What does HTTP stand for?",
    "Suggest a name for a grey cat.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Give two synonyms for 'happy'.",
    "How many minutes are in a day?",
)


@dataclass
class PrecisionReport:
    """Mean relative logit error (||l - l_fp32|| / ||l_fp32|| per position) and greedy agreement."""

    precision: str
    # The tested runner's weight-only quantisation (None: none); fp32 is never quantised.
    quantization: str | None
    prompts: int
    new_tokens: int
    mean_relative_logit_error: float
    max_relative_logit_error: float
    greedy_exact_matches: int
    # Per prompt: how many leading tokens agree with fp32.
    greedy_common_prefix: list[int]


def _runner(model_dir: Path, precision: str, max_len: int, quantization: str | None = None) -> ModelRunner:
    config = EngineConfig(
        model_path=str(model_dir),
        precision=precision,
        quantization=quantization,
        device="cpu",
        kv_cache_memory_bytes=256 << 20,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        max_num_seqs=1,
    )
    return ModelRunner(config)


def decode(
    runner: ModelRunner, prompt: list[int], new_tokens: int, forced: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Greedy (or teacher-forced) continuation using the runner's KV cache; returns tokens and logits [n, vocab]."""
    tokens = list(prompt)
    blocks = list(range(-(-(len(prompt) + new_tokens) // runner.block_size)))
    rows: list[torch.Tensor] = []
    computed = 0
    for i in range(new_tokens):
        count = len(tokens) - computed
        logits = runner.forward([(tokens, blocks, computed, count)], [count - 1])
        assert logits is not None
        rows.append(logits[0])
        computed = len(tokens)
        tokens.append(forced[i] if forced is not None else int(torch.argmax(logits[0])))
    return tokens[len(prompt) :], torch.stack(rows)


def compare(
    model_dir: Path,
    precision: str,
    prompts: list[list[int]],
    new_tokens: int,
    quantization: str | None = None,
    tested_model: Path | None = None,
) -> PrecisionReport:
    """Run fp32 of model_dir and `precision` (quantised with `quantization`, of tested_model when given) on
    every prompt and compare."""
    max_len = max(len(p) for p in prompts) + new_tokens
    reference = _runner(model_dir, "fp32-fp32-fp32", max_len)
    expected = [decode(reference, p, new_tokens) for p in prompts]
    reference.close()
    tested = _runner(tested_model or model_dir, precision, max_len, quantization)
    errors: list[torch.Tensor] = []
    matches, prefixes = 0, []
    for prompt, (ref_tokens, ref_logits) in zip(prompts, expected, strict=True):
        _, logits = decode(tested, prompt, new_tokens, forced=ref_tokens)
        errors.append((logits - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1))
        free, _ = decode(tested, prompt, new_tokens)
        matches += free == ref_tokens
        prefixes.append(next((i for i, (a, b) in enumerate(zip(free, ref_tokens, strict=True)) if a != b), new_tokens))
    all_errors = torch.cat(errors)
    return PrecisionReport(
        precision=tested.precision.name,
        quantization=quantization,
        prompts=len(prompts),
        new_tokens=new_tokens,
        mean_relative_logit_error=float(all_errors.mean()),
        max_relative_logit_error=float(all_errors.max()),
        greedy_exact_matches=matches,
        greedy_common_prefix=prefixes,
    )


def chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    """The first `count` fixed questions as chat-templated token ids."""
    from services.gateway.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_dir(model_dir)
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:count]]


def main(argv: list[str] | None = None) -> int:
    """CLI: print the report as JSON (and write it with --out)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16-fp16-fp32")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help="weight-only quantisation")
    parser.add_argument("--model", type=Path, default=None, help="HF model directory (default: embedded SmolLM2)")
    parser.add_argument(
        "--tested-model",
        type=Path,
        default=None,
        help="the model run in --precision, if not --model (--quantization gguf: a .gguf file; default the "
        "embedded model's own)",
    )
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS), help=f"at most {len(QUESTIONS)}")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.model is None:
        from services.worker.model_fetch import ensure_embedded_gguf, ensure_embedded_model

        args.model = ensure_embedded_model()
        if args.quantization == "gguf" and args.tested_model is None:
            args.tested_model = ensure_embedded_gguf()
    prompts = chat_prompts(args.model, args.prompts)
    report = compare(args.model, args.precision, prompts, args.new_tokens, args.quantization, args.tested_model)
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
