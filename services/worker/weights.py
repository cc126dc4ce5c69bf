"""Find a model's config and weights (HF safetensors directory or GGUF file); its identity and KV format key."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.kv_store_limits import KV_FORMAT_PREFIX


@dataclass(frozen=True)
class ModelSource:
    """A resolved --model: a HF directory, or a GGUF file (gguf_file set) inside `directory`."""

    directory: Path
    gguf_file: str | None = None
    # --load-format dummy: random weights drawn from this seed stand in for the files (None: the files).
    dummy_seed: int | None = None

    @property
    def name(self) -> str:
        """Human-readable model name: the GGUF file stem or the directory name."""
        if self.gguf_file is not None:
            return Path(self.gguf_file).stem
        return self.directory.name

    def weight_files(self) -> list[Path]:
        """The files that hold the weights, in load order (none for dummy weights)."""
        if self.dummy_seed is not None:
            return []
        if self.gguf_file is not None:
            return [self.directory / self.gguf_file]
        return sorted(self.directory.glob("*.safetensors"))


def resolve_model_path(model_path: str | Path, *, need_weights: bool = True) -> ModelSource:
    """Turn --model into a ModelSource, with errors that say what was expected; a directory without weights
    passes when need_weights is False (--load-format dummy reads only its config.json)."""
    path = Path(model_path).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"--model {path} is a file but not a .gguf; pass a Hugging Face directory")
        return ModelSource(directory=path.parent.resolve(), gguf_file=path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {path} has no config.json; is it a Hugging Face model directory?")
        if need_weights and not any(path.glob("*.safetensors")):
            raise ValueError(
                f"--model {path} has no *.safetensors weights (--load-format dummy runs on random weights)"
            )
        return ModelSource(directory=path.resolve())
    raise ValueError(f"--model {path} does not exist")


def load_hf_config(source: ModelSource) -> Any:
    """Return the transformers config of the model."""
    from transformers import AutoConfig

    if source.gguf_file is not None:
        return AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file)
    return AutoConfig.from_pretrained(source.directory)


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor) pairs; GGUF is dequantised by transformers to float32."""
    if source.gguf_file is not None:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            source.directory, gguf_file=source.gguf_file, dtype=torch.float32
        )
        yield from hf_model.state_dict().items()
        return
    from safetensors import safe_open

    for file in source.weight_files():
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, handle.get_tensor(key)


# vLLM's range for --load-format dummy: small enough that activations stay finite through any depth in bf16.
DUMMY_WEIGHT_RANGE = 1e-3


def fill_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """--load-format dummy: every parameter uniform in +-DUMMY_WEIGHT_RANGE, the same on every run
    (each rank draws its own shard)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)


def _identity_fields(source: ModelSource) -> dict[str, Any]:
    config_path = source.directory / "config.json"
    config_text = config_path.read_text() if source.gguf_file is None and config_path.is_file() else ""
    fields: dict[str, Any] = {
        "config": config_text,
        "weights": [[f.name, f.stat().st_size] for f in source.weight_files()],
    }
    if source.dummy_seed is not None:
        # Random weights are another model than the checkpoint's: no worker or kvstore block mixes the two.
        fields["dummy_seed"] = source.dummy_seed
    return fields


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_identity(source: ModelSource) -> str:
    """sha256 over config.json's content and the weight files' names and sizes: which weights a worker serves.

    Independent of device, precision, TP size and block size, so a CPU worker and an NPU worker of the
    same model may serve one scheduler's requests.
    """
    return _digest(_identity_fields(source))


def kv_format(source: ModelSource, *, kv_dtype: str, block_size: int) -> str:
    """The KV format key: which KV blocks are interchangeable between workers and through the kvstore.

    sha256 over the model identity, the KV dtype and the block size, and nothing else: the tensor-parallel
    size, the rank and the device's cache layout do not change a block's content, because blocks travel in
    the store's canonical head-major layout with all KV heads (each rank reads and writes its own heads).
    """
    fields = {**_identity_fields(source), "kv_dtype": kv_dtype, "block_size": block_size}
    return KV_FORMAT_PREFIX + _digest(fields)
