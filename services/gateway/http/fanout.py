"""Run one HTTP request's GenerateRequests (one per prompt) through the pipeline at once, merged.

Each pipeline generator lives its whole life in one task (it binds structlog context variables, which
must be reset in the context that set them), and hands its responses over a small queue, so a client
that reads slowly holds the pipelines back (and the scheduler stream's bound applies) rather than
growing a buffer here. The first StatusError ends the merge; closing the merge cancels every task,
which closes its generator and so aborts its samples.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence

from services.common.proto.meshserve.v1 import generation_pb2
from services.gateway.pipeline import Call, GenerationPipeline

# Responses each prompt may have waiting for the client.
_QUEUED_PER_PROMPT = 4

_Item = tuple[int, generation_pb2.GenerateResponse | Exception | None]


class PromptFailed(Exception):
    """The pipeline of prompt `index` raised `error` (a StatusError, or a bug)."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(f"prompt {index}: {error}")
        self.index = index
        self.error = error


async def merged(
    pipeline: GenerationPipeline, requests: Sequence[generation_pb2.GenerateRequest], calls: Sequence[Call]
) -> AsyncGenerator[tuple[int, generation_pb2.GenerateResponse], None]:
    """(prompt index, response) pairs of every request in arrival order; the first error any request raises
    ends them all as PromptFailed."""
    if len(requests) == 1:
        try:
            async with contextlib.aclosing(pipeline.generate(requests[0], calls[0])) as responses:
                async for response in responses:
                    yield 0, response
        except Exception as err:
            raise PromptFailed(0, err) from err
        return
    queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=_QUEUED_PER_PROMPT * len(requests))

    async def pump(index: int) -> None:
        try:
            async with contextlib.aclosing(pipeline.generate(requests[index], calls[index])) as responses:
                async for response in responses:
                    await queue.put((index, response))
        except Exception as err:  # a StatusError, or a bug the caller reports
            await queue.put((index, err))
        else:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(requests))]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise PromptFailed(index, item) from item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
