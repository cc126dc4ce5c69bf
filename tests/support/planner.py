"""One WorkerScheduler for the planner's unit tests, with the simulated worker's block size."""

from __future__ import annotations

from services.scheduler.speculation import SpeculativeConfig
from services.scheduler.waiting_queue import WaitingQueue
from services.scheduler.worker_scheduler import KVStoreUse, WorkerScheduler
from tests.support.fake_worker import BS


def make_planner(
    waiting: WaitingQueue | None = None,
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    caching: bool = True,
    kv_store: KVStoreUse | None = None,
    speculation: SpeculativeConfig | None = None,
    micro_batches: int = 1,
) -> WorkerScheduler:
    """A planner for worker "w0" with a 256-token max_model_len."""
    return WorkerScheduler(
        "w0",
        num_blocks=num_blocks,
        block_size=BS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=256,
        enable_prefix_caching=caching,
        waiting=WaitingQueue() if waiting is None else waiting,
        kv_store=kv_store,
        speculation=speculation,
        micro_batches=micro_batches,
    )
