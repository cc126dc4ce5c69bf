"""Scheduler settings (flags and MESHSERVE_* variables)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.engine_defaults import DEFAULT_MAX_NUM_SEQS
from services.common.settings import ServiceSettings
from services.scheduler.speculation import SpeculativeConfig
from services.scheduler.waiting_queue import (
    DEFAULT_SCHEDULING_AGING_TOKENS_PER_S,
    DEFAULT_SCHEDULING_POLICY,
    SchedulingPolicy,
)

DEFAULT_PORT = 50052


class SchedulerSettings(ServiceSettings):
    """Continuous-batching limits and the queue bound."""

    port: int = Field(DEFAULT_PORT, description="gRPC port", ge=0, le=65535)
    max_num_seqs: int = Field(DEFAULT_MAX_NUM_SEQS, description="most requests in one step", ge=1)
    max_num_batched_tokens: int | None = Field(
        None, description="token budget of one step; unset: each worker's own (its platform's, or its flag)", ge=1
    )
    max_model_len: int | None = Field(
        None, description="longest prompt + output; unset: the smallest a worker reports", ge=2
    )
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    long_prefill_token_threshold: int = Field(
        0,
        description="most prompt tokens one request computes per step (vLLM's flag), so a long prefill is "
        "chunked and short turns and decodes between its chunks are not held up; 0: off (up to the step budget)",
        ge=0,
    )
    scheduling_policy: SchedulingPolicy = Field(
        DEFAULT_SCHEDULING_POLICY,
        description="which queued request a worker admits next: shortest-prefill-first, the least prompt work "
        "(less its cached prefix) first, aged by queue time (lowers a burst's mean time to first token; see "
        "--scheduling-aging-tokens-per-second); fcfs, arrival order (vLLM's default)",
    )
    scheduling_aging_tokens_per_second: float = Field(
        DEFAULT_SCHEDULING_AGING_TOKENS_PER_S,
        description="shortest-prefill-first: a second in the queue counts as this many prompt tokens less, so a "
        "request is overtaken only by requests that arrived less than (its tokens - theirs) / rate seconds "
        "after it",
        gt=0,
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description="speculative decoding of greedy requests by prompt lookup, as vLLM's flag: '{\"method\": "
        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1, '
        '"disable_by_batch_size": 4}\' (drafts are verified by the worker in the same step; output unchanged); '
        "unset: off",
    )
    async_scheduling: bool = Field(
        True, description="send each worker its next step before the current one answers (hides the round trip)"
    )
    max_waiting_requests: int = Field(
        4096, description="queued requests (all workers) before submissions get RESOURCE_EXHAUSTED", ge=1
    )
    routing: Literal["kv", "round-robin", "least-loaded"] = Field(
        "kv", description="which worker a request goes to: kv (cached prefix + load), round-robin, least-loaded"
    )
    worker_heartbeat_interval: float = Field(
        1.0, description="seconds between a worker's heartbeats (told to each worker when it attaches)", gt=0
    )
    worker_heartbeat_timeout: float = Field(
        10.0, description="a worker silent this long is lost; its requests move to other workers", gt=0
    )
    step_timeout: float = Field(
        120.0, description="a worker whose step is unanswered this long is stuck, and treated as lost", gt=0
    )
    worker_wait_timeout: float = Field(
        30.0, description="how long requests of a lost last worker wait for a worker to (re)attach", ge=0
    )
    kv_store: str | None = Field(
        None, description="host:port of the kvstore: prompts stored there load instead of recomputing (unset: off)"
    )
    kv_store_lookup_timeout: float = Field(
        0.5, description="seconds a kvstore lookup may take before the request goes on as a miss", gt=0
    )
    preemption_mode: Literal["recompute", "swap"] = Field(
        "recompute",
        description="a preempted request resumes by recomputing, or (swap, needs --kv-store) from its saved blocks",
    )
    kv_store_write_policy: Literal["write-through", "write-through-selective"] = Field(
        "write-through",
        description="which computed blocks go to the kvstore: write-through, every full block once computed (a "
        "requeued or swapped-out request, or another worker, finds all of them); write-through-selective, a "
        "block the first time a later request reuses it (SGLang's HiCache policy: prompts never seen twice "
        "cost the store nothing, but a lost worker's requests find only reused prefixes)",
    )
    retry_after: float = Field(1.0, description="seconds a refused caller is told to wait (google.rpc.RetryInfo)", ge=0)

    @model_validator(mode="after")
    def _swap_needs_write_through(self) -> SchedulerSettings:
        if self.preemption_mode == "swap" and self.kv_store_write_policy != "write-through":
            raise ValueError(
                "--preemption-mode swap resumes a preempted request from the blocks it saved as they were "
                "computed: use --kv-store-write-policy write-through with it, or --preemption-mode recompute"
            )
        return self
