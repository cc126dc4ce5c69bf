"""Time Sampler.sample on one decode batch, each case as a ratio against the all-greedy batch of the same run.

Batch 32, vocabulary 49152, random float32 logits and random 200-token histories (100 prompt + 100 output).
Cases: all greedy (the baseline), all seeded with temperature, all with penalties + min_p + top_p, and two
extras (greedy with penalties, a mixed batch). The ratio is what matters: absolute times depend on the machine
and on how many threads torch gets.

    python scripts/bench_sampler.py                 # default: 30 timed calls per case
    python scripts/bench_sampler.py --rounds 100 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.proto.meshserve.v1 import sampling_pb2
from services.worker.sampler import Sampler, SampleRequest

P = sampling_pb2.SamplingParams
BATCH = 32
VOCAB = 49152
PROMPT = 100
OUTPUT = 100


def _requests(make: Callable[[int], sampling_pb2.SamplingParams], seed: int) -> list[SampleRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(BATCH):
        history = torch.randint(0, VOCAB, (PROMPT + OUTPUT,), generator=g).tolist()
        out.append(SampleRequest.of(make(i), prompt_token_ids=history[:PROMPT], output_token_ids=history[PROMPT:]))
    return out


def _penalised(i: int) -> sampling_pb2.SamplingParams:
    return P(
        temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2, min_p=0.05, top_p=0.9
    )


def _mixed(i: int) -> sampling_pb2.SamplingParams:
    kinds = [P(temperature=0), P(temperature=0.7, seed=i), P(temperature=1.0, top_k=50), _penalised(i)]
    return kinds[i % len(kinds)]


CASES: dict[str, Callable[[int], sampling_pb2.SamplingParams]] = {
    "all greedy": lambda i: P(temperature=0),
    "all seeded, temperature 0.8": lambda i: P(temperature=0.8, seed=i),
    "all penalties + min_p + top_p": _penalised,
    "greedy + penalties": lambda i: P(temperature=0, repetition_penalty=1.1, frequency_penalty=0.3),
    "mixed (greedy/seeded/top_k/penalised)": _mixed,
}


def _measure(
    sampler: Sampler, logits: torch.Tensor, cases: dict[str, list[SampleRequest]], rounds: int
) -> dict[str, float]:
    """Median seconds per case; the cases take turns, so that load from elsewhere hits them alike."""
    for requests in cases.values():
        for _ in range(3):
            sampler.sample(logits, requests)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, requests in cases.items():
            started = time.perf_counter()
            sampler.sample(logits, requests)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed calls per case")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    cases = {name: _requests(make, 1) for name, make in CASES.items()}
    results = _measure(Sampler(seed=0), logits, cases, args.rounds)
    base = results["all greedy"]
    print(f"Sampler.sample, batch {BATCH}, vocab {VOCAB}, {torch.get_num_threads()} threads, median of {args.rounds}")
    print(f"| {'case':<40} | {'ms':>8} | {'x greedy':>8} |")
    print(f"|{'-' * 42}|{'-' * 10}|{'-' * 10}|")
    for name, seconds in results.items():
        print(f"| {name:<40} | {seconds * 1e3:8.3f} | {seconds / base:8.2f} |")


if __name__ == "__main__":
    main()
