"""Send a workload to a server at a given arrival rate and record every token's arrival.

The schedule (arrivals, the concurrency limit, the turn order of conversations, warm-ups) is the same for
every served backend: `drive` and `warm_up` take a `Send`, one request to one server. This module's Send is
the meshserve gateway's gRPC Generation API; openai_backend has one for OpenAI-compatible HTTP servers.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial

import grpc
from tqdm import tqdm

from services.client.bench.arrivals import inter_arrival_times, send_offsets
from services.client.bench.datasets import BenchRequest, single_turns
from services.client.bench.records import RequestRecord
from services.client.client import build_request, sampling_params
from services.common.channels import insecure_channel
from services.common.proto.meshserve.v1 import generation_pb2_grpc, sampling_pb2

# Warm-ups only have to touch every code path once; a couple of decode steps do that.
WARMUP_OUTPUT_LEN = 2

# One request: (request, tokens to generate, request id) -> its record; errors end up in the record, never raised.
Send = Callable[[BenchRequest, int, str], Awaitable[RequestRecord]]


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


@asynccontextmanager
async def grpc_sender(address: str, *, ignore_eos: bool = True, temperature: float = 0.0) -> AsyncIterator[Send]:
    """A Send over one channel to the gateway at address, open for the block."""
    async with insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        yield partial(_send, stub, ignore_eos=ignore_eos, temperature=temperature)


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
    return await run_conversations(
        address,
        single_turns(requests),
        request_rate=request_rate,
        burstiness=burstiness,
        max_concurrency=max_concurrency,
        seed=seed,
        num_warmups=num_warmups,
        progress=progress,
        ignore_eos=ignore_eos,
        temperature=temperature,
    )


def _check_limits(max_concurrency: int | None, num_warmups: int) -> None:
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if num_warmups < 0:
        raise ValueError(f"num_warmups must be >= 0, got {num_warmups}")


def connections_needed(max_concurrency: int | None, num_conversations: int, num_warmups: int = 0) -> int:
    """Requests in flight at most under warm_up and drive: the size a connection pool needs."""
    # Without a limit every conversation (and every warm-up) gets a slot at once.
    return max_concurrency or max(num_conversations, num_warmups, 1)


def _slots(max_concurrency: int | None, num_conversations: int, num_warmups: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(connections_needed(max_concurrency, num_conversations, num_warmups))


async def warm_up(
    send: Send,
    conversations: Sequence[Sequence[BenchRequest]],
    num_warmups: int,
    *,
    max_concurrency: int | None = None,
) -> None:
    """Warm-up i resends conversation i's first turn (cycling) for a couple of tokens; WarmupError if one fails."""
    _check_limits(max_concurrency, num_warmups)
    firsts = [c[0] for c in conversations if c]
    if not num_warmups or not firsts:
        return
    slots = _slots(max_concurrency, len(conversations), num_warmups)

    async def one(i: int) -> RequestRecord:
        request = firsts[i % len(firsts)]
        async with slots:
            return await send(request, min(request.output_len, WARMUP_OUTPUT_LEN), f"bench-warmup-{i}")

    results = await asyncio.gather(*(one(i) for i in range(num_warmups)))
    if failed := [r for r in results if not r.success]:
        raise WarmupError(f"{len(failed)}/{len(results)} warm-up requests failed: {failed[0].error}")


async def drive(
    send: Send,
    conversations: Sequence[Sequence[BenchRequest]],
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Run conversations through send; returns one record per turn, conversation by conversation.

    Conversation i starts at its gamma arrival time (request_rate counts conversations), then waits for one
    of max_concurrency slots and keeps it until its last turn has finished: like a chat user, it sends turn
    k+1 only once turn k's stream has ended. Each turn's clock starts when it is sent. Request ids number the
    turns in record order (bench-0, bench-1, ...).
    """
    _check_limits(max_concurrency, 0)
    offsets = send_offsets(inter_arrival_times(len(conversations), request_rate, burstiness, seed))
    # Flat index of each conversation's first turn, so request ids follow the record order.
    first_ids = list(itertools.accumulate((len(c) for c in conversations), initial=0))
    num_requests = first_ids.pop()
    slots = _slots(max_concurrency, len(conversations), 0)
    show = progress and sys.stderr.isatty()
    bar = tqdm(total=num_requests, desc="bench", unit="req", disable=not show)

    async def converse(turns: Sequence[BenchRequest], first_id: int) -> list[RequestRecord]:
        records: list[RequestRecord] = []
        async with slots:
            for k, turn in enumerate(turns):
                # Awaiting each turn before the next is the closed loop: no turn overtakes its predecessor.
                records.append(await send(turn, turn.output_len, f"bench-{first_id + k}"))
                bar.update(1)
        return records

    tasks: list[asyncio.Task[list[RequestRecord]]] = []
    start = time.perf_counter()
    for conversation, first_id, offset in zip(conversations, first_ids, offsets, strict=True):
        # Sleep to an absolute target so that scheduling delays do not accumulate into the rate.
        await _sleep_until(start + offset)
        tasks.append(asyncio.create_task(converse(conversation, first_id)))
    per_conversation = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return [record for records in per_conversation for record in records], duration


async def run_warmups(
    address: str,
    conversations: Sequence[Sequence[BenchRequest]],
    num_warmups: int,
    *,
    max_concurrency: int | None = None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
) -> None:
    """Only the warm-ups of run_conversations, for callers that read server counters between them and the run."""
    _check_limits(max_concurrency, num_warmups)
    async with grpc_sender(address, ignore_eos=ignore_eos, temperature=temperature) as send:
        await warm_up(send, conversations, num_warmups, max_concurrency=max_concurrency)


async def run_conversations(
    address: str,
    conversations: Sequence[Sequence[BenchRequest]],
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
    """Run conversations against the gateway at address: warm-ups first, then `drive`'s schedule."""
    _check_limits(max_concurrency, num_warmups)
    # Fail on bad arguments before a channel opens.
    inter_arrival_times(0, request_rate, burstiness, seed)
    async with grpc_sender(address, ignore_eos=ignore_eos, temperature=temperature) as send:
        await warm_up(send, conversations, num_warmups, max_concurrency=max_concurrency)
        return await drive(
            send,
            conversations,
            request_rate=request_rate,
            burstiness=burstiness,
            max_concurrency=max_concurrency,
            seed=seed,
            progress=progress,
        )
