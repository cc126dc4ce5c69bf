"""Gateway settings (flags and MESHSERVE_* variables)."""

from __future__ import annotations

from pydantic import Field

from services.common.settings import ServiceSettings

DEFAULT_PORT = 50051


class GatewaySettings(ServiceSettings):
    """Where the public API listens, which tokenizer it uses and where the scheduler is."""

    port: int = Field(DEFAULT_PORT, description="public gRPC port", ge=0, le=65535)
    scheduler_address: str = Field("127.0.0.1:50052", description="scheduler host:port")
    model: str | None = Field(None, description="model directory holding the tokenizer (unset: the embedded SmolLM2)")
    max_model_len: int | None = Field(
        None, description="longest prompt + output (unset: the model's max_position_embeddings)", ge=2
    )
