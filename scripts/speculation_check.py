"""Greedy decoding with and without prompt-lookup drafts on one in-process ModelRunner: are the tokens the
same, and how many steps and drafts does speculation take?

    python scripts/speculation_check.py --dtype bfloat16

Prompts have the shape of bench_peers' single workload (random token ids, 32-512 tokens, 64-128 outputs);
drafts come from the scheduler's own proposer, verified by the worker's own step, one request at a time.
"""

from __future__ import annotations

import argparse
import itertools
import random

from services.common.model_paths import embedded_model_dir
from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.scheduler.speculation import SpeculativeConfig
from services.worker.engine_config import EngineConfig
from services.worker.model_runner import ModelRunner

GREEDY = sampling_pb2.SamplingParams(temperature=0)


def decode(
    runner: ModelRunner, step_ids: itertools.count[int], rid: str, prompt: list[int], n: int,
    spec: SpeculativeConfig | None,
) -> tuple[list[int], int, int]:  # fmt: skip
    """(tokens, steps, draft tokens) of one greedy request decoded to n tokens."""
    tokens, computed, steps, drafted = list(prompt), 0, 0, 0
    blocks = list(range(-(-(len(prompt) + n + 8) // runner.block_size)))
    while len(tokens) - len(prompt) < n:
        step = worker_pb2.Step(step_id=next(step_ids))
        if steps == 0:
            step.new_requests.append(
                worker_pb2.NewRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, block_ids=blocks,
                    num_scheduled_tokens=len(prompt),
                )
            )  # fmt: skip
        else:
            room = n - (len(tokens) - len(prompt)) - 1
            drafts = spec.propose(tokens, room) if spec is not None and room > 0 else []
            drafted += len(drafts)
            step.scheduled.append(
                worker_pb2.ScheduledRequest(
                    request_id=rid, num_computed_tokens=computed,
                    num_scheduled_tokens=len(tokens) - computed + len(drafts), draft_token_ids=drafts,
                )
            )  # fmt: skip
        result = runner.execute(step)
        steps += 1
        tokens += [s.token_id for s in result.sampled]
        computed = len(tokens) - 1
    runner.execute(worker_pb2.Step(step_id=next(step_ids), removed_request_ids=[rid]))
    return tokens[len(prompt) : len(prompt) + n], steps, drafted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    args = parser.parse_args()
    runner = ModelRunner(
        EngineConfig(
            model_path=str(embedded_model_dir()), dtype=args.dtype, kv_cache_memory_bytes=1 << 30,
            max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=8,
        )
    )  # fmt: skip
    spec = SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens)
    rng = random.Random(args.seed)
    step_ids = itertools.count(1)
    same = plain_steps = spec_steps = drafted = gained = 0
    diverged: list[int] = []
    for i in range(args.prompts):
        prompt = [rng.randrange(runner.vocab_size) for _ in range(rng.randint(32, 512))]
        n = rng.randint(64, 128)
        plain, s1, _ = decode(runner, step_ids, f"plain-{i}", prompt, n, None)
        speculated, s2, d = decode(runner, step_ids, f"spec-{i}", prompt, n, spec)
        plain_steps, spec_steps, drafted = plain_steps + s1, spec_steps + s2, drafted + d
        # Tokens beyond the first of each verified step were drafts the worker kept.
        gained += n - s2
        if plain == speculated:
            same += 1
        else:
            diverged.append(next(j for j, (a, b) in enumerate(zip(plain, speculated, strict=True)) if a != b))
    print(
        f"{args.dtype}: {same}/{args.prompts} identical (first differing output index: {diverged or 'none'}); "
        f"steps {plain_steps} plain, {spec_steps} speculated; {drafted} draft tokens, {gained} kept"
    )
    runner.close()


if __name__ == "__main__":
    main()
