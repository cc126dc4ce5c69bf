"""--precision WEIGHTS-COMPUTE-ACCUM: the dtype weights are held in, matmuls run in, and sums/norms/logits use.

Parsing imports no torch, so settings can validate the flag in processes that never load a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NAMES = ("fp32", "bf16", "fp16")
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
EXAMPLES = "fp32-fp32-fp32, bf16-bf16-fp32, bf16-fp16-fp32 or auto"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of fp32 / bf16 / fp16."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass(frozen=True)
class Precision:
    """Resolved precision: weights stored in `weights`, matmuls in `compute`, norms/residual/logits in `accum`."""

    weights_name: str
    compute_name: str
    accum_name: str

    @property
    def name(self) -> str:
        """Canonical text form, e.g. bf16-fp16-fp32."""
        return f"{self.weights_name}-{self.compute_name}-{self.accum_name}"

    @property
    def weights(self) -> torch.dtype:
        return torch_dtype(self.weights_name)

    @property
    def compute(self) -> torch.dtype:
        return torch_dtype(self.compute_name)

    @property
    def accum(self) -> torch.dtype:
        return torch_dtype(self.accum_name)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache holds what attention consumes: compute-dtype K and V."""
        return self.compute


def canonical_dtype(text: str) -> str | None:
    """fp32 / bf16 / fp16 for a dtype name or alias (float32, bfloat16, ...), else None."""
    key = text.strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in NAMES else None


def parse_precision(text: str, *, platform_default: str) -> Precision:
    """Parse --precision (or `auto`, resolved to the platform's default); ValueError names the bad part."""
    spec = text.strip().lower()
    if spec == "auto":
        spec = platform_default
    parts = spec.split("-")
    if len(parts) != 3:
        raise ValueError(f"--precision {text!r} must be WEIGHTS-COMPUTE-ACCUM (e.g. {EXAMPLES})")
    names: list[str] = []
    for role, part in zip(("WEIGHTS", "COMPUTE", "ACCUM"), parts, strict=True):
        name = canonical_dtype(part)
        if name is None:
            raise ValueError(
                f"--precision {text!r}: {role} {part!r} is not one of {', '.join(NAMES)} (e.g. {EXAMPLES})"
            )
        names.append(name)
    weights, compute, accum = names
    # Accumulating in a narrower (or merely different) type than the matmuls would throw away what they kept.
    if accum not in ("fp32", compute):
        raise ValueError(
            f"--precision {text!r}: ACCUM must be fp32 or equal to COMPUTE ({compute}); got {accum} "
            f"(e.g. {weights}-{compute}-fp32)"
        )
    return Precision(weights, compute, accum)


def precision_from_dtype(dtype: str) -> str:
    """The --precision equivalent of the vLLM-style --dtype shorthand: one dtype everywhere."""
    name = canonical_dtype(dtype)
    if name is None:
        raise ValueError(f"--dtype must be one of {sorted([*NAMES, *_ALIASES])}, got {dtype!r}")
    return f"{name}-{name}-{name}"
