"""A model of the mixed benchmark's steps: mean and p99 TTFT under each queue order and step budget.

    python scripts/queue_order_model.py [--prefill-ms-per-token 0.6] [--step-ms 12] [--decode-ms-per-row 2]

The workload is bench_peers.py's mixed one (64 requests, prompts 32-512, outputs 16-256, 32 in flight,
each finished request replaced at once). A step first gives every running request its next chunk or token,
then admits queued requests in the policy's order within the token budget, as the scheduler's planner does;
it lasts step_ms + prefill_ms_per_token x its tokens (decode rows included at that rate) + decode_ms_per_row x
its decode rows, and a prompt's first token comes at the end of the step that computes its last chunk.
The defaults are the Zen 4 EPYC's (a 2,048-token step ~1.3 s). It models the order, not the engine: its
figures say how much a policy or budget moves the TTFT, and the served runs in docs/benchmarks.md measure it.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

from services.scheduler.waiting_queue import DEFAULT_SCHEDULING_AGING_TOKENS_PER_S


@dataclass
class _Request:
    prompt: int
    output: int
    arrival: float = 0.0
    computed: int = 0
    generated: int = 0


@dataclass(frozen=True)
class Costs:
    step_ms: float
    prefill_ms_per_token: float
    decode_ms_per_row: float


def run(
    budget: int, policy: str, seed: int, costs: Costs, aging: float, num: int = 64, concurrency: int = 32
) -> tuple[float, float]:
    """(mean TTFT, p99 TTFT) in ms of one seeded round; aging in prompt tokens a second."""
    ms_per_token = 1000.0 / aging
    rng = random.Random(seed)
    pending = [_Request(rng.randint(32, 512), rng.randint(16, 256)) for _ in range(num)]
    waiting, running, ttfts = pending[:concurrency], [], []
    nxt, done, now = concurrency, 0, 0.0
    while done < num:
        left = budget
        planned: list[tuple[_Request, int]] = []
        for r in running:
            if left <= 0:
                break
            n = min(r.prompt - r.computed if r.computed < r.prompt else 1, left)
            planned.append((r, n))
            left -= n
        # The scheduler's key (waiting_queue.py): arrival + work / aging rate, in ms here.
        order = waiting if policy == "fcfs" else sorted(waiting, key=lambda r: r.arrival + r.prompt * ms_per_token)
        for r in list(order):
            if left <= 0:
                break
            n = min(r.prompt, left)
            planned.append((r, n))
            left -= n
            waiting.remove(r)
            running.append(r)
        rows = sum(1 for r, _ in planned if r.computed >= r.prompt)
        now += costs.step_ms + costs.prefill_ms_per_token * sum(n for _, n in planned) + costs.decode_ms_per_row * rows
        for r, n in planned:
            if r.computed < r.prompt:
                r.computed += n
                if r.computed >= r.prompt:
                    ttfts.append(now - r.arrival)
                    r.generated = 1
            else:
                r.generated += 1
            if r.computed >= r.prompt and r.generated >= r.output:
                running.remove(r)
                done += 1
                if nxt < num:
                    pending[nxt].arrival = now
                    waiting.append(pending[nxt])
                    nxt += 1
    ttfts.sort()
    return statistics.mean(ttfts), ttfts[max(0, int(0.99 * len(ttfts)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.6)
    parser.add_argument("--step-ms", type=float, default=12.0)
    parser.add_argument("--decode-ms-per-row", type=float, default=2.0)
    parser.add_argument("--seeds", type=int, default=6, help="rounds averaged")
    parser.add_argument("--aging-tokens-per-second", type=float, default=DEFAULT_SCHEDULING_AGING_TOKENS_PER_S)
    args = parser.parse_args()
    costs = Costs(args.step_ms, args.prefill_ms_per_token, args.decode_ms_per_row)
    print("| policy | budget | mean TTFT ms | p99 TTFT ms |\n| --- | ---: | ---: | ---: |")
    for policy in ("fcfs", "shortest-prefill-first"):
        for budget in (2048, 1024, 512):
            rounds = [run(budget, policy, seed, costs, args.aging_tokens_per_second) for seed in range(args.seeds)]
            mean = statistics.mean(r[0] for r in rounds)
            p99 = statistics.mean(r[1] for r in rounds)
            print(f"| {policy} | {budget} | {mean:,.0f} | {p99:,.0f} |")


if __name__ == "__main__":
    main()
