"""Baseline: static batches through transformers' `generate`, as a plain Python user would serve."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from services.client.bench.datasets import BenchRequest
from services.client.bench.records import RequestRecord

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype for a --dtype name."""
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}") from None


class _StepClock:
    """A generate streamer that stamps time.perf_counter() when each step's tokens are chosen."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        # generate first hands the streamer the prompt ids; every later call is one decoding step.
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(now)

    def end(self) -> None:
        pass


def _load(model_dir: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype(dtype)).eval()
    return model


def _warm_up(model: Any, prompt: list[int], pad_id: int) -> None:
    """One short untimed generate, so one-off costs (allocator, kernels) fall outside the timing."""
    input_ids = torch.tensor([prompt], dtype=torch.int64)
    with torch.inference_mode():
        model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=2, do_sample=False, pad_token_id=pad_id
        )


def run_transformers_baseline(
    model_dir: Path,
    requests: list[BenchRequest],
    batch_size: int,
    dtype: str,
    progress: bool = False,
    *,
    outputs: list[list[int]] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Serve requests in workload order as static batches of batch_size; returns records and duration.

    All requests are available at t=0, but a request's `start` is its batch's start (when work on it
    began, like a client admitted by max_concurrency); the duration runs from the first batch's start to
    the last token. Every row of a batch generates max(output_len) tokens (EOS masked by
    min_new_tokens) and only each request's own output_len are recorded. Model load and one warm-up
    generate are not timed.
    When `outputs` is a list, each request's generated token ids are appended to it.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not requests:
        return [], 0.0
    model = _load(model_dir, dtype)
    config = model.generation_config
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    _warm_up(model, requests[0].prompt_token_ids[:16], int(pad_id))
    records: list[RequestRecord] = []
    bench_start = 0.0
    last_token = 0.0
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    for index, batch in enumerate(batches):
        longest = max(len(r.prompt_token_ids) for r in batch)
        # Left padding so every row's next token sits in the last column.
        input_ids = torch.full((len(batch), longest), int(pad_id), dtype=torch.int64)
        attention_mask = torch.zeros((len(batch), longest), dtype=torch.int64)
        for row, req in enumerate(batch):
            n = len(req.prompt_token_ids)
            input_ids[row, longest - n :] = torch.tensor(req.prompt_token_ids, dtype=torch.int64)
            attention_mask[row, longest - n :] = 1
        max_new = max(r.output_len for r in batch)
        clock = _StepClock()
        started = time.perf_counter()
        if index == 0:
            bench_start = started
        with torch.inference_mode():
            generated = model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=int(pad_id),
                streamer=clock,
            )
        if len(clock.times) != max_new:
            raise RuntimeError(f"generate ran {len(clock.times)} steps, wanted {max_new}")
        last_token = max(last_token, clock.times[-1])
        for row, req in enumerate(batch):
            records.append(
                RequestRecord(
                    prompt_len=len(req.prompt_token_ids),
                    output_len=req.output_len,
                    start=started,
                    token_times=clock.times[: req.output_len],
                )
            )
            if outputs is not None:
                outputs.append([int(t) for t in generated[row, longest : longest + req.output_len].tolist()])
        if progress:
            print(
                f"\rtransformers: batch {index + 1}/{len(batches)} ({time.perf_counter() - bench_start:.1f}s)",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress:
        print(file=sys.stderr)
    return records, last_token - bench_start
