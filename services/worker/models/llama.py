"""Llama-family decoder (Llama, Qwen2, SmolLM2) over a flat varlen batch and a paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.attention import AttentionMetadata
from services.worker.layers.rotary import RotaryTable, inv_freq_for_config
from services.worker.platforms.base import Ops

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LlamaArch:
    """The shape parameters the forward pass needs, read once from a HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config: Any) -> LlamaArch:
        """Read and check a LlamaConfig / Qwen2Config (or a compatible one)."""
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = model_type == "qwen2"
        return cls(
            model_type=model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(config.rms_norm_eps),
            # Qwen2 always has q/k/v bias and never an o_proj bias.
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
        )


class RMSNorm(nn.Module):
    """RMSNorm weight; the op comes from the platform."""

    def __init__(self, size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    """Fused-QKV attention writing K/V to the paged cache and reading the sequence's context back."""

    def __init__(self, arch: LlamaArch, ops: Ops) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.ops = ops

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.ops.apply_rotary(q, k, cos, sin)
        k_cache, v_cache = kv_cache
        self.ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU MLP with fused gate/up projection."""

    def __init__(self, arch: LlamaArch, ops: Ops) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; the residual is carried to the next layer's fused norm."""

    def __init__(self, arch: LlamaArch, ops: Ops) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, ops)
        self.mlp = LlamaMLP(arch, ops)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(self, arch: LlamaArch, ops: Ops) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(arch, ops) for _ in range(arch.num_layers)])
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; forward returns hidden states, compute_logits maps chosen rows to logits."""

    # HF checkpoint name fragment -> (our fused parameter fragment, shard index).
    _STACKED = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, hf_config: Any, ops: Ops, max_positions: int) -> None:
        super().__init__()
        self.arch = LlamaArch.from_hf_config(hf_config)
        self.model = LlamaModel(self.arch, ops)
        self.lm_head: nn.Linear | None = None
        if not self.arch.tie_word_embeddings:
            self.lm_head = nn.Linear(self.arch.hidden_size, self.arch.vocab_size, bias=False)
        inv_freq, scaling = inv_freq_for_config(hf_config, self.arch.head_dim)
        self.rotary = RotaryTable(inv_freq, max_positions, scaling)

    def to_device(self, device: torch.device) -> LlamaForCausalLM:
        """Move rotary tables along with parameters (they are not buffers, so loading never touches them)."""
        self.rotary.to(device)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the flat batch input_ids/positions [T]; returns final-normed hidden states [T, hidden]."""
        cos, sin = self.rotary.lookup(positions)
        hidden = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for hidden rows [N, hidden]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (fused) parameters; raise if any parameter stays unloaded."""
        params = dict(self.named_parameters())
        shard_sizes = self._shard_sizes()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                # Tied checkpoints sometimes still ship a copy of the embedding.
                continue
            name, shard = hf_name, -1
            for fragment, (fused, index) in self._STACKED.items():
                if fragment in hf_name:
                    name, shard = hf_name.replace(fragment, fused), index
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter")
            with torch.no_grad():
                if shard < 0:
                    if tuple(param.shape) != tuple(tensor.shape):
                        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
                    param.copy_(tensor)
                else:
                    sizes = shard_sizes[name.rsplit(".", 2)[-2]]
                    offset = sum(sizes[:shard])
                    target = param.narrow(0, offset, sizes[shard])
                    if tuple(target.shape) != tuple(tensor.shape):
                        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
                    target.copy_(tensor)
            loaded.add(f"{name}#{shard}")
        missing = []
        for name in params:
            module = name.rsplit(".", 2)[-2]
            if module in shard_sizes:
                missing += [f"{name}#{i}" for i in range(len(shard_sizes[module]))]
            else:
                missing.append(f"{name}#-1")
        absent = sorted(m for m in missing if m not in loaded)
        if absent:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(absent[:8])}")

    def _shard_sizes(self) -> dict[str, list[int]]:
        a = self.arch
        kv = a.num_kv_heads * a.head_dim
        return {
            "qkv_proj": [a.num_heads * a.head_dim, kv, kv],
            "gate_up_proj": [a.intermediate_size, a.intermediate_size],
        }
