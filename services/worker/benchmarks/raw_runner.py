"""Ceiling of the serving layers: ModelRunner driven in-process by a minimal continuous-batching loop."""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from services.client.bench.datasets import BenchRequest
from services.client.bench.records import RequestRecord
from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.worker.engine_config import EngineConfig
from services.worker.host_allocator import retain_freed_memory
from services.worker.kv_cache import bytes_per_block
from services.worker.model_runner import ModelRunner
from services.worker.models.llama import LlamaArch
from services.worker.platforms.cpu import CpuPlatform
from services.worker.weights import load_hf_config, resolve_model_path

BLOCK_SIZE = 16
_GREEDY = sampling_pb2.SamplingParams(temperature=0.0)
_WARMUP_ID = "warmup"


@dataclass
class _Live:
    """A request in flight: what the driver (playing the scheduler) knows of it."""

    index: int
    request: BenchRequest
    record: RequestRecord
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    outputs: list[int] = field(default_factory=list)
    held: bool = False

    @property
    def rid(self) -> str:
        return f"r{self.index}"


def _blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def make_runner(model_dir: Path, requests: list[BenchRequest], batch_size: int, dtype: str) -> ModelRunner:
    """A ModelRunner sized for batch_size of these requests in flight (KV blocks and step limits)."""
    max_len = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    arch = LlamaArch.from_hf_config(load_hf_config(resolve_model_path(model_dir)))
    precision = EngineConfig(model_path=str(model_dir), dtype=dtype).resolve_precision(CpuPlatform.default_precision)
    per_block = bytes_per_block(
        num_layers=arch.num_layers,
        block_size=BLOCK_SIZE,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        dtype=precision.kv_dtype,
    )
    # Every in-flight request may hold its longest sequence at once: no preemption, ever.
    num_blocks = batch_size * _blocks_for(max_len) + 1
    prompts = sorted((len(r.prompt_token_ids) for r in requests), reverse=True)
    config = EngineConfig(
        model_path=str(model_dir),
        dtype=dtype,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=num_blocks * per_block,
        max_model_len=max_len,
        # The biggest step: a whole batch of the longest prompts admitted together.
        max_num_batched_tokens=sum(prompts[:batch_size]) + batch_size,
        max_num_seqs=batch_size,
    )
    # As a worker process runs its model (ranks.prepare_rank).
    retain_freed_memory()
    return ModelRunner(config)


def _warm_up(runner: ModelRunner, prompt: list[int]) -> None:
    """One short untimed request, so one-off costs (allocator, kernels) fall outside the timing."""
    step = worker_pb2.Step(step_id=0)
    blocks = list(range(_blocks_for(len(prompt))))
    step.new_requests.append(
        worker_pb2.NewRequest(
            request_id=_WARMUP_ID,
            prompt_token_ids=prompt,
            sampling=_GREEDY,
            block_ids=blocks,
            num_scheduled_tokens=len(prompt),
        )
    )
    result = runner.execute(step)
    if result.error:
        raise RuntimeError(result.error)


def run_raw_runner(
    model_dir: Path,
    requests: list[BenchRequest],
    batch_size: int,
    dtype: str,
    progress: bool = False,
    *,
    outputs: list[list[int]] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Serve requests with batch_size in flight, no gRPC and no scheduler; returns records and duration.

    Each step prefills newcomers' whole prompts alongside one decode per running request; a finished
    request is replaced by the next waiting one in the following step. A request's `start` is the start
    of the step that admitted it; the duration runs from the first step to the last token. Model load
    and one warm-up request are not timed. When `outputs` is a list, each request's tokens are appended.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not requests:
        return [], 0.0
    runner = make_runner(model_dir, requests, batch_size, dtype)
    try:
        _warm_up(runner, requests[0].prompt_token_ids[:BLOCK_SIZE])
        return _drive(runner, requests, batch_size, progress, outputs)
    finally:
        runner.close()


def _drive(
    runner: ModelRunner,
    requests: list[BenchRequest],
    batch_size: int,
    progress: bool,
    outputs: list[list[int]] | None,
) -> tuple[list[RequestRecord], float]:
    free: deque[int] = deque(range(runner.num_blocks))
    waiting = deque(enumerate(requests))
    live: list[_Live] = []
    done: dict[int, _Live] = {}
    removed = [_WARMUP_ID]
    step_id = 0
    bench_start = time.perf_counter()
    last_token = bench_start
    while live or waiting:
        step_id += 1
        step_start = time.perf_counter()
        while waiting and len(live) < batch_size:
            index, request = waiting.popleft()
            live.append(
                _Live(index, request, RequestRecord(len(request.prompt_token_ids), request.output_len, step_start))
            )
        step = worker_pb2.Step(step_id=step_id, removed_request_ids=removed)
        removed = []
        for item in live:
            # A newcomer computes its whole prompt; a running request decodes its last sampled token.
            tokens = len(item.request.prompt_token_ids) + len(item.outputs)
            n = tokens - item.num_computed
            fresh = [free.popleft() for _ in range(_blocks_for(tokens) - len(item.blocks))]
            item.blocks.extend(fresh)
            if item.held:
                step.scheduled.append(
                    worker_pb2.ScheduledRequest(
                        request_id=item.rid,
                        new_block_ids=fresh,
                        num_computed_tokens=item.num_computed,
                        num_scheduled_tokens=n,
                    )
                )
            else:
                step.new_requests.append(
                    worker_pb2.NewRequest(
                        request_id=item.rid,
                        prompt_token_ids=item.request.prompt_token_ids,
                        sampling=_GREEDY,
                        block_ids=item.blocks,
                        num_scheduled_tokens=n,
                    )
                )
                item.held = True
            item.num_computed = tokens
        result = runner.execute(step)
        now = time.perf_counter()
        if result.error:
            raise RuntimeError(f"step {step_id} failed: {result.error}")
        sampled = {s.request_id: s.token_id for s in result.sampled}
        still: list[_Live] = []
        for item in live:
            item.outputs.append(sampled[item.rid])
            item.record.token_times.append(now)
            last_token = now
            if len(item.outputs) >= item.request.output_len:
                free.extend(item.blocks)
                removed.append(item.rid)
                done[item.index] = item
            else:
                still.append(item)
        live = still
        if progress and step_id % 16 == 0:
            print(
                f"\rraw runner: {len(done)}/{len(requests)} done ({now - bench_start:.1f}s)",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress:
        print(file=sys.stderr)
    ordered = [done[i] for i in range(len(requests))]
    if outputs is not None:
        outputs.extend(item.outputs for item in ordered)
    return [item.record for item in ordered], last_token - bench_start
