"""Send a workload to a meshserve gateway at a given arrival rate and record every token's arrival."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Sequence

import grpc
from tqdm import tqdm

from services.client.bench.arrivals import inter_arrival_times, send_offsets
from services.client.bench.datasets import BenchRequest
from services.client.bench.records import RequestRecord
from services.client.client import build_request, sampling_params
from services.common.channels import insecure_channel
from services.common.proto.meshserve.v1 import generation_pb2_grpc, sampling_pb2

# Warm-ups only have to touch every code path once; a couple of decode steps do that.
WARMUP_OUTPUT_LEN = 2


class WarmupError(RuntimeError):
    """A warm-up request failed, so the timed run would measure a broken setup."""


async def _sleep_until(deadline: float) -> None:
    """Sleep until time.perf_counter() reaches deadline."""
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _send(
    stub: generation_pb2_grpc.GenerationStub,
    request: BenchRequest,
    output_len: int,
    request_id: str,
    *,
    ignore_eos: bool,
    temperature: float,
) -> RequestRecord:
    """One streamed request; errors end up in the record, never raised."""
    sampling = sampling_params(max_tokens=output_len, temperature=temperature, ignore_eos=ignore_eos or None)
    message = build_request(token_ids=request.prompt_token_ids, sampling=sampling, request_id=request_id)
    record = RequestRecord(prompt_len=len(request.prompt_token_ids), output_len=output_len, start=time.perf_counter())
    try:
        async for response in stub.Generate(message):
            now = time.perf_counter()
            # Tokens that arrive together share the message's arrival time.
            record.token_times.extend([now] * len(response.token_ids))
            if response.finish_reason:
                record.cached_tokens = response.usage.cached_tokens
                if response.finish_reason == sampling_pb2.FINISH_REASON_ABORT:
                    record.success = False
                    record.error = "ABORT: the server aborted the request"
    except grpc.aio.AioRpcError as err:
        record.success = False
        record.error = f"{err.code().name}: {err.details()}"
    except Exception as err:  # one broken request must not end the whole benchmark
        record.success = False
        record.error = f"{type(err).__name__}: {err}"
    if record.success and not record.token_times:
        record.success = False
        record.error = "no output tokens received"
    return record


async def run_benchmark(
    address: str,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    num_warmups: int = 0,
    progress: bool = True,
    ignore_eos: bool = True,
    temperature: float = 0.0,
) -> tuple[list[RequestRecord], float]:
    """Run the workload against the gateway at address; returns records in request order and the duration in s.

    Request i is sent at its gamma arrival time; with max_concurrency, it then waits for a free slot and its
    clock (TTFT, E2EL) starts when it is actually sent, as in vLLM.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if num_warmups < 0:
        raise ValueError(f"num_warmups must be >= 0, got {num_warmups}")
    offsets = send_offsets(inter_arrival_times(len(requests), request_rate, burstiness, seed))
    limit = asyncio.Semaphore(max_concurrency or max(len(requests), num_warmups, 1))
    show = progress and sys.stderr.isatty()

    async with insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def limited(request: BenchRequest, output_len: int, request_id: str) -> RequestRecord:
            async with limit:
                return await _send(
                    stub, request, output_len, request_id, ignore_eos=ignore_eos, temperature=temperature
                )

        if num_warmups and requests:
            warmups = [requests[i % len(requests)] for i in range(num_warmups)]
            results = await asyncio.gather(
                *(limited(r, min(r.output_len, WARMUP_OUTPUT_LEN), f"bench-warmup-{i}") for i, r in enumerate(warmups))
            )
            if failed := [r for r in results if not r.success]:
                raise WarmupError(f"{len(failed)}/{len(results)} warm-up requests failed: {failed[0].error}")

        bar = tqdm(total=len(requests), desc="bench", unit="req", disable=not show)
        tasks: list[asyncio.Task[RequestRecord]] = []
        start = time.perf_counter()
        for i, (request, offset) in enumerate(zip(requests, offsets, strict=True)):
            # Sleep to an absolute target so that scheduling delays do not accumulate into the rate.
            await _sleep_until(start + offset)
            task = asyncio.create_task(limited(request, request.output_len, f"bench-{i}"))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
    return records, duration
