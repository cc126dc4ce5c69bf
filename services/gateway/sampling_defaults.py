"""Sampling defaults for fields a request leaves unset: the model's generation_config.json, else vLLM's.

vLLM's `--generation-config auto` takes temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens from the model's generation config, so a model tuned for low-temperature sampling answers
sensibly when a client sends no parameters; `--generation-config vllm` ignores the file. Decided here
only: the gateway fills the defaults once, before a request goes anywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import structlog

from services.common.proto.meshserve.v1 import sampling_pb2

log = structlog.get_logger()

GenerationConfigMode = Literal["auto", "vllm"]


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for unset SamplingParams fields (vLLM's own when the model says nothing)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # max_new_tokens from the generation config; None: as many as fit (the scheduler decides).
    max_tokens: int | None = None
    # Where the values came from, for the startup log.
    source: str = "vllm defaults"

    def apply(self, params: sampling_pb2.SamplingParams) -> None:
        """Fill every unset field this object has a default for, in place."""
        if not params.HasField("temperature"):
            params.temperature = self.temperature
        if not params.HasField("top_p"):
            params.top_p = self.top_p
        if not params.HasField("top_k"):
            params.top_k = self.top_k
        if not params.HasField("min_p") and self.min_p:
            params.min_p = self.min_p
        if not params.HasField("repetition_penalty") and self.repetition_penalty != 1.0:
            params.repetition_penalty = self.repetition_penalty
        if not params.HasField("max_tokens") and self.max_tokens is not None:
            params.max_tokens = self.max_tokens


def _number(config: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        return None
    return float(value)


def load_sampling_defaults(model_dir: Path, mode: GenerationConfigMode = "auto") -> SamplingDefaults:
    """The defaults for a model directory; values out of range in the file are ignored with a warning."""
    defaults = SamplingDefaults()
    path = Path(model_dir) / "generation_config.json"
    if mode == "vllm" or not path.is_file():
        return defaults
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        log.warning("generation_config unreadable; using vLLM's defaults", path=str(path), error=str(err))
        return defaults
    if not isinstance(config, dict):
        return defaults
    found: dict[str, Any] = {}
    for key, low, high in (
        ("temperature", 0, 100),
        ("top_p", 1e-9, 1),
        ("min_p", 0, 1),
        ("repetition_penalty", 1e-9, 10),
    ):
        value = _number(config, key, low, high)
        if value is not None:
            found[key] = value
    top_k = _number(config, "top_k", -1, 2**31 - 1)
    if top_k is not None:
        found["top_k"] = int(top_k)
    max_new = _number(config, "max_new_tokens", 1, 2**31 - 1)
    if max_new is not None:
        found["max_tokens"] = int(max_new)
    if not found:
        return defaults
    return replace(defaults, **found, source=str(path))
