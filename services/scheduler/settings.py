"""Scheduler settings (flags and MESHSERVE_* variables)."""

from __future__ import annotations

from pydantic import Field

from services.common.settings import ServiceSettings

DEFAULT_PORT = 50052


class SchedulerSettings(ServiceSettings):
    """Continuous-batching limits and the queue bound."""

    port: int = Field(DEFAULT_PORT, description="gRPC port", ge=0, le=65535)
    max_num_seqs: int = Field(128, description="most requests in one step", ge=1)
    max_num_batched_tokens: int = Field(2048, description="token budget of one step", ge=1)
    max_model_len: int | None = Field(
        None, description="longest prompt + output; unset: the smallest a worker reports", ge=2
    )
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    async_scheduling: bool = Field(
        True, description="send each worker its next step before the current one answers (hides the round trip)"
    )
    max_waiting_requests: int = Field(
        4096, description="queued requests before Submit answers RESOURCE_EXHAUSTED", ge=1
    )
