"""Model implementations, chosen by the Hugging Face config's model_type."""

from __future__ import annotations

from services.worker.models.llama import SUPPORTED_MODEL_TYPES, LlamaForCausalLM

__all__ = ["SUPPORTED_MODEL_TYPES", "LlamaForCausalLM"]
