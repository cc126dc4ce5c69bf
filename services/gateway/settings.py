"""Gateway settings (flags and MESHSERVE_* variables)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from services.common.settings import ServiceSettings

DEFAULT_PORT = 50051


class GatewaySettings(ServiceSettings):
    """Where the public API listens, which tokenizer it uses, where the schedulers are, and its load bounds.

    The model's limits (max_model_len, vocabulary size) are not settings here: the gateway takes them
    from its schedulers (GetModelInfo), which know what their workers actually serve.
    """

    port: int = Field(DEFAULT_PORT, description="public gRPC port", ge=0, le=65535)
    http_port: int = Field(
        -1,
        description="OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics) on --host; -1: off, 0: any free port (`meshserve up` serves it on 8000)",
        ge=-1,
        le=65535,
    )
    scheduler_address: str = Field("127.0.0.1:50052", description="scheduler host:port, or several separated by commas")
    model: str | None = Field(None, description="model directory holding the tokenizer (unset: the embedded SmolLM2)")
    served_model_name: list[str] = Field(
        default_factory=list,
        description="names clients may give as the model (the first is listed in /v1/models); unset: the name "
        "the workers report",
    )
    api_key: list[str] = Field(
        default_factory=list,
        description="API keys a caller must send as `authorization: Bearer <key>` (repeatable); unset: open",
    )
    api_key_file: str | None = Field(None, description="file of API keys, one per line (# comments)")
    generation_config: Literal["auto", "vllm"] = Field(
        "auto",
        description="sampling defaults: auto takes them from the model's generation_config.json, vllm ignores it",
    )
    # Admission. The total cap is also what bounds the gateway's buffering: see stream_buffer_tokens.
    max_concurrent_requests: int = Field(
        1024, description="requests this gateway runs at once; more get RESOURCE_EXHAUSTED", ge=1
    )
    max_concurrent_requests_per_client: int = Field(
        0,
        description="requests one client host (the call's peer address) may run at once; 0: no per-client cap",
        ge=0,
    )
    retry_after: float = Field(
        1.0, description="seconds the gateway advises (google.rpc.RetryInfo) when it refuses for load", gt=0
    )
    # Rate limits per API key (rate_limit.py): GCRA, bursts of a minute's budget.
    rate_limit_requests_per_minute: int | None = Field(
        None, description="requests one API key may start per minute (unset: unlimited)", ge=1
    )
    rate_limit_tokens_per_minute: int | None = Field(
        None,
        description="prompt + completion tokens one API key may use per minute; a request reserves prompt + "
        "max_tokens until it ends (unset: unlimited)",
        ge=1,
    )
    redis: str | None = Field(
        None, description="redis://host:port/db shared by gateway replicas for rate limits; unset: in-process"
    )
    # Slow readers. Events waiting for a call that fell behind merge into one (scheduler_stream.py), so
    # a request buffers at most stream_buffer_tokens token ids (plus one ~550-byte message) for its
    # client, and the gateway at most max_concurrent_requests x that in all: 1024 x 1024 ids in
    # messages of a few KB, about 10 MB. They only start to pile up once the client's own HTTP/2 window
    # (thousands of responses by default) is full, so a client that merely pauses is not aborted.
    stream_buffer_tokens: int = Field(
        1024, description="tokens a request may buffer for a client that reads slowly before it is aborted", ge=1
    )
    stream_write_timeout: float = Field(
        30.0, description="seconds one response may wait for the client to read before the request is aborted", gt=0
    )
    # Schedulers.
    scheduler_poll_interval: float = Field(
        1.0, description="seconds between GetModelInfo polls of each scheduler (health and limits)", gt=0
    )
    scheduler_poll_timeout: float = Field(
        1.0, description="seconds a GetModelInfo poll may take before the scheduler counts as unhealthy", gt=0
    )
    routing_load_slack: int = Field(
        16,
        description="requests a scheduler may carry beyond the least loaded one and still get the prompts "
        "whose prefix hashes to it",
        ge=0,
    )
    tokenizer_threads: int = Field(2, description="threads that tokenize and render chat templates", ge=1)

    @field_validator("scheduler_address")
    @classmethod
    def _some_address(cls, value: str) -> str:
        if not [a for a in value.split(",") if a.strip()]:
            raise ValueError("give at least one scheduler host:port")
        return value

    @property
    def scheduler_addresses(self) -> list[str]:
        """The schedulers, in the order given, without blanks or repeats."""
        return list(dict.fromkeys(a.strip() for a in self.scheduler_address.split(",") if a.strip()))
