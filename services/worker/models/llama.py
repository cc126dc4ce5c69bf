"""Llama-family decoder (Llama, Qwen2, SmolLM2) over a flat varlen batch and a paged KV cache."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from services.worker.distributed import SINGLE, TPGroup
from services.worker.layers.attention import AttentionMetadata
from services.worker.layers.decode_stack import DecodeStack, FusedDecode, StackLayer
from services.worker.layers.dtypes import to_dtype
from services.worker.layers.linear import (
    ColumnParallelLinear,
    LinearFn,
    MatmulModule,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    balanced_shard,
)
from services.worker.layers.quantization import QuantizedWeight
from services.worker.layers.rotary import RotaryTable, inv_freq_for_config
from services.worker.pipeline_partition import StageLayers, whole_model
from services.worker.platforms.base import Ops
from services.worker.precision import Precision

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
KVCacheLayer = tuple[torch.Tensor, torch.Tensor]
# The bound forms of the modules (their bind methods): what a step runs. The norm, attention, MLP and decoder
# layer modules hold weights and have no forward of their own: bind() is their one definition of what they compute.
# (x, residual or None) -> (normed x in the compute dtype, the residual stream)
NormFn = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
# (x, cos, sin, this layer's KV cache, metadata) -> the attention block's output
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KVCacheLayer, AttentionMetadata], torch.Tensor]
# (hidden, residual or None, cos, sin, KV cache, metadata) -> (hidden, residual)
LayerFn = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, KVCacheLayer, AttentionMetadata],
    tuple[torch.Tensor, torch.Tensor],
]


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

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (what pipeline stages are balanced by)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        attention += (q + 2 * kv) * self.qkv_bias + self.hidden_size * self.o_bias
        mlp = 3 * self.hidden_size * self.intermediate_size
        mlp += (2 * self.intermediate_size + self.hidden_size) * self.mlp_bias
        return attention + mlp + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Parameters of the token embedding; the LM head has as many (a copy of them, when tied, on a last
        stage that is not the first)."""
        return self.vocab_size * self.hidden_size


@dataclass(frozen=True)
class HeadSplit:
    """This rank's attention heads: its query heads and the KV heads they read (split or replicated)."""

    num_heads: int
    num_kv_heads: int
    # First query / KV head of this rank in the full model.
    head_start: int
    kv_head_start: int

    @classmethod
    def for_rank(cls, arch: LlamaArch, tp: TPGroup) -> HeadSplit:
        """Give each rank whole KV-head groups (as evenly as they go), or replicate KV heads when fewer than ranks."""
        n = tp.size
        check_tp_size(arch, n)
        group = arch.num_heads // arch.num_kv_heads
        if arch.num_kv_heads >= n:
            # Uneven where n does not divide the KV heads (SmolLM2's 3 over 2 ranks): a query head must
            # live with its KV head, so groups are never cut.
            kv = balanced_shard(arch.num_kv_heads, n, tp.rank)
            return cls(kv.size * group, kv.size, kv.start * group, kv.start)
        num_heads = arch.num_heads // n
        head_start = tp.rank * num_heads
        # n is a multiple of the KV heads, so all of this rank's query heads share one KV head.
        return cls(num_heads, 1, head_start, head_start // group)


def check_tp_size(arch: LlamaArch, size: int) -> None:
    """Raise ValueError naming the flag when the model cannot be split over `size` ranks."""
    if size <= arch.num_kv_heads:
        return
    if size % arch.num_kv_heads or arch.num_heads % size:
        raise ValueError(
            f"--tensor-parallel-size {size} exceeds the model's num_key_value_heads={arch.num_kv_heads}, so KV "
            f"heads are replicated, which needs the size to be a multiple of them and to divide "
            f"num_attention_heads={arch.num_heads}; pick such a size or at most {arch.num_kv_heads}"
        )


class RMSNorm(nn.Module):
    """RMSNorm over the residual stream in the accumulation dtype; its output feeds matmuls in compute dtype."""

    def __init__(self, size: int, eps: float, ops: Ops, precision: Precision) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.ops = ops
        self.accum = precision.accum
        self.compute = precision.compute

    def accum_weight(self) -> torch.Tensor:
        """The weight as the norm multiplies by it: in the accumulation dtype."""
        return to_dtype(self.weight, self.accum)

    def bind(self) -> NormFn:
        """The norm with its weight (in the accumulation dtype) and ops fetched once; bind after loading."""
        accum, compute, eps = self.accum, self.compute, self.eps
        weight = self.accum_weight()
        rms_norm, add_rms_norm = self.ops.rms_norm, self.ops.add_rms_norm

        def norm(x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            x = to_dtype(x, accum)
            if residual is None:
                return to_dtype(rms_norm(x, weight, eps), compute), x
            normed, residual = add_rms_norm(x, residual, weight, eps)
            return to_dtype(normed, compute), residual

        return norm


class LlamaAttention(nn.Module):
    """Fused-QKV attention over this rank's heads, writing K/V to the paged cache and reading context back."""

    def __init__(self, arch: LlamaArch, ops: Ops, precision: Precision, tp: TPGroup) -> None:
        super().__init__()
        split = HeadSplit.for_rank(arch, tp)
        d = arch.head_dim
        self.num_heads = split.num_heads
        self.num_kv_heads = split.num_kv_heads
        self.head_dim = d
        self.q_size = split.num_heads * d
        self.kv_size = split.num_kv_heads * d
        self.scale = d**-0.5
        q_shard = Shard(split.head_start * d, self.q_size)
        kv_shard = Shard(split.kv_head_start * d, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(
            arch.hidden_size, [q_shard, kv_shard, kv_shard], arch.qkv_bias, precision.compute
        )
        self.o_proj = RowParallelLinear(q_shard, arch.hidden_size, arch.o_bias, precision.compute, tp)
        self.ops = ops

    def bind(self) -> AttentionFn:
        """The attention block with its linears, shapes and ops fetched once; bind after the weights are final."""
        qkv_proj, o_proj = self.qkv_proj.bind(), self.o_proj.bind()
        sizes = [self.q_size, self.kv_size, self.kv_size]
        num_heads, num_kv_heads, head_dim, q_size, scale = (
            self.num_heads, self.num_kv_heads, self.head_dim, self.q_size, self.scale
        )  # fmt: skip
        ops = self.ops
        apply_rotary, reshape_and_cache, paged_attention = ops.apply_rotary, ops.reshape_and_cache, ops.paged_attention

        def attention(
            x: torch.Tensor,
            cos: torch.Tensor,
            sin: torch.Tensor,
            kv_cache: tuple[torch.Tensor, torch.Tensor],
            meta: AttentionMetadata,
        ) -> torch.Tensor:
            num_tokens = x.shape[0]
            q, k, v = qkv_proj(x).split(sizes, dim=-1)
            q = q.reshape(num_tokens, num_heads, head_dim)
            k = k.reshape(num_tokens, num_kv_heads, head_dim)
            v = v.reshape(num_tokens, num_kv_heads, head_dim)
            q, k = apply_rotary(q, k, cos, sin)
            k_cache, v_cache = kv_cache
            reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
            return o_proj(out.reshape(num_tokens, q_size))

        return attention


class LlamaMLP(nn.Module):
    """SwiGLU MLP: fused gate/up column-parallel, down row-parallel."""

    def __init__(self, arch: LlamaArch, ops: Ops, precision: Precision, tp: TPGroup) -> None:
        super().__init__()
        shard = balanced_shard(arch.intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = ColumnParallelLinear(arch.hidden_size, [shard, shard], arch.mlp_bias, precision.compute)
        self.down_proj = RowParallelLinear(shard, arch.hidden_size, arch.mlp_bias, precision.compute, tp)
        self.ops = ops

    def bind(self) -> LinearFn:
        """The MLP with its linears and op fetched once; bind after the weights are final."""
        gate_up_proj, down_proj, silu_and_mul = self.gate_up_proj.bind(), self.down_proj.bind(), self.ops.silu_and_mul
        return lambda x: down_proj(silu_and_mul(gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; the residual is carried to the next layer's fused norm."""

    def __init__(self, arch: LlamaArch, ops: Ops, precision: Precision, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, ops, precision, tp)
        self.mlp = LlamaMLP(arch, ops, precision, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops, precision)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops, precision)

    def bind(self) -> LayerFn:
        """The layer as one closure over its parts' bound forms: what a step runs (see LlamaForCausalLM.bind)."""
        input_norm, attention = self.input_layernorm.bind(), self.self_attn.bind()
        post_norm, mlp = self.post_attention_layernorm.bind(), self.mlp.bind()

        def layer(
            hidden: torch.Tensor,
            residual: torch.Tensor | None,
            cos: torch.Tensor,
            sin: torch.Tensor,
            kv_cache: tuple[torch.Tensor, torch.Tensor],
            meta: AttentionMetadata,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            x, residual = input_norm(hidden, residual)
            hidden = attention(x, cos, sin, kv_cache, meta)
            x, residual = post_norm(hidden, residual)
            return mlp(x), residual

        return layer

    def stack_layer(self) -> StackLayer | None:
        """This layer as a fused decode stack runs it; None when a linear has no small-step kernel or needs an
        all-reduce."""
        attn, mlp = self.self_attn, self.mlp
        linears = [m.stack_linear() for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        qkv, o, gate_up, down = linears
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        return StackLayer(
            self.input_layernorm.accum_weight(), qkv, o, self.post_attention_layernorm.accum_weight(), gate_up, down
        )


class LlamaModel(nn.Module):
    """Embedding (first stage), this stage's decoder layers and final norm (last stage)."""

    def __init__(self, arch: LlamaArch, ops: Ops, precision: Precision, tp: TPGroup, stage: StageLayers) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp) if stage.is_first else None
        # Keyed by the layer's index in the whole model, so checkpoint names (model.layers.N.) map unchanged.
        self.layers = nn.ModuleDict(
            {str(i): LlamaDecoderLayer(arch, ops, precision, tp) for i in range(stage.start, stage.end)}
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops, precision) if stage.is_last else None


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head (this rank's shard of its pipeline stage); forward returns hidden states,
    compute_logits full-vocab logits (last stage)."""

    # HF checkpoint name fragment -> (our fused module fragment, part index).
    _STACKED = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(
        self,
        hf_config: Any,
        ops: Ops,
        max_positions: int,
        precision: Precision,
        tp: TPGroup = SINGLE,
        stage: StageLayers | None = None,
    ) -> None:
        super().__init__()
        self.arch = LlamaArch.from_hf_config(hf_config)
        self.precision = precision
        self.ops = ops
        self.stage = stage or whole_model(self.arch.num_layers)
        # This rank's share of KV heads: what its KV cache holds.
        self.num_kv_heads = HeadSplit.for_rank(self.arch, tp).num_kv_heads
        self.model = LlamaModel(self.arch, ops, precision, tp, self.stage)
        self.lm_head: VocabParallelEmbedding | None = None
        # Tied weights share the embedding, unless the head lives on a later stage than it: then a copy.
        if self.stage.is_last and not (self.arch.tie_word_embeddings and self.stage.is_first):
            self.lm_head = VocabParallelEmbedding(self.arch.vocab_size, self.arch.hidden_size, tp)
        inv_freq, scaling = inv_freq_for_config(hf_config, self.arch.head_dim)
        self.rotary = RotaryTable(inv_freq, max_positions, scaling)
        # Each layer's and the final norm's bound forms, and the platform's fused form of a decode step's layers
        # where it has one (bind), once the weights are final.
        self._bound: tuple[list[LayerFn], NormFn | None, FusedDecode | None] | None = None

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
        carried: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run this stage's layers over the flat batch input_ids/positions [T].

        The first stage embeds input_ids; a later one continues from `carried`, the previous stage's
        (hidden, residual). The last stage returns final-normed hidden states [T, hidden] and None; any other
        returns its (hidden, residual) for the next stage."""
        if self._bound is None:
            self.bind()
        assert self._bound is not None
        layers, final_norm, fused = self._bound
        cos, sin = self.rotary.lookup(positions)
        residual: torch.Tensor | None = None
        if self.model.embed_tokens is not None:
            hidden = self.model.embed_tokens(input_ids)
        else:
            assert carried is not None, "a stage after the first continues from the previous stage's activations"
            hidden, residual = carried
        stepped = None if fused is None else fused(hidden, residual, cos, sin, kv_caches, meta)
        if stepped is not None:
            hidden, residual = stepped
        else:
            for layer, kv_cache in zip(layers, kv_caches, strict=True):
                hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        if final_norm is None:
            assert residual is not None
            return hidden, residual
        hidden, _ = final_norm(hidden, residual)
        return hidden, None

    def bind(self) -> None:
        """Bind every layer's weights, shapes and ops into closures, which forward runs. A decode step at one
        row spent ~4 ms of ~20 in module calls, attribute lookups and per-call checks on the Zen 3 EPYC
        (docs/benchmarks.md); bound, a step calls little but its kernels. Call it once the weights are final
        (loaded, quantised, packed: the model runner does, at the end of loading); load_weights unbinds, and
        forward binds on first use if nobody did."""
        decoder_layers = [cast(LlamaDecoderLayer, layer) for layer in self.model.layers.values()]
        layers = [layer.bind() for layer in decoder_layers]
        final_norm = None if self.model.norm is None else self.model.norm.bind()
        self._bound = (layers, final_norm, self._fused_decode(decoder_layers))

    def _fused_decode(self, layers: list[LlamaDecoderLayer]) -> FusedDecode | None:
        """The platform's one-call form of a decode step over these layers, where every layer has a stack form."""
        stacked = [layer.stack_layer() for layer in layers]
        if not stacked or any(layer is None for layer in stacked):
            return None
        attn = layers[0].self_attn
        stack = DecodeStack(
            layers=tuple(layer for layer in stacked if layer is not None),
            eps=self.arch.rms_norm_eps,
            scale=attn.scale,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            accum=self.precision.accum,
            compute=self.precision.compute,
        )
        return self.ops.fused_decode(stack)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for hidden rows [N, hidden], on every rank of the last stage."""
        return self.head().logits(hidden, self.precision.compute)

    def head(self) -> VocabParallelEmbedding:
        """The LM head (last stage): the embedding itself when the checkpoint ties them and one stage holds both."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        assert head is not None and self.stage.is_last, "only the last pipeline stage has the LM head"
        return head

    def matmul_modules(self) -> list[MatmulModule]:
        """Every module whose weight feeds a matmul: the linears and (last stage) the LM head."""
        linears: list[MatmulModule] = [
            m for m in self.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
        ]
        return [*linears, self.head()] if self.stage.is_last else linears

    def _stage_targets(self, hf_name: str) -> list[str]:
        """The names this stage loads a checkpoint tensor under: none when another stage holds it, two for a
        tied embedding whose head copy lives here too."""
        if hf_name.startswith("model.layers."):
            index = int(hf_name.split(".", 3)[2])
            return [hf_name] if self.stage.start <= index < self.stage.end else []
        if hf_name.startswith("model.embed_tokens."):
            names = [hf_name] if self.stage.is_first else []
            if self.arch.tie_word_embeddings and self.lm_head is not None:
                names.append(hf_name.replace("model.embed_tokens.", "lm_head."))
            return names
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return [hf_name] if self.stage.is_last else []
        return [hf_name]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy this rank's slice of HF-named tensors into our (fused, sharded) parameters; raise on gaps."""
        self._bound = None
        modules = dict(self.named_modules())
        loaded: set[tuple[str, str, int]] = set()
        for checkpoint_name, tensor in weights:
            if "rotary_emb.inv_freq" in checkpoint_name:
                continue
            if checkpoint_name == "lm_head.weight" and self.arch.tie_word_embeddings:
                # Tied checkpoints sometimes still ship a copy of the embedding; the embedding's is loaded.
                continue
            for hf_name in self._stage_targets(checkpoint_name):
                loaded.add(self._load_one(modules, hf_name, tensor))
        absent = sorted(f"{m}.{k}#{p}" for m, k, p in self._expected_loads() if (m, k, p) not in loaded)
        if absent:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(absent[:8])}")

    def _target(self, modules: dict[str, nn.Module], hf_name: str) -> tuple[str, nn.Module, str, int]:
        """(module name, module, parameter kind, fused part) that a checkpoint tensor loads into."""
        name, part = hf_name, 0
        for fragment, (fused, index) in self._STACKED.items():
            if fragment in hf_name:
                name, part = hf_name.replace(fragment, fused), index
                break
        module_name, _, kind = name.rpartition(".")
        module = modules.get(module_name)
        if module is None or not hasattr(module, kind):
            raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter")
        return module_name, module, kind, part

    def load_quantized_weights(self, weights: Iterable[tuple[str, QuantizedWeight]]) -> None:
        """Hand this rank's slice of HF-named quantised matmul weights (a GGUF file's own blocks) to the
        linears and LM head, which keep them until layers.linear.attach_quantized; after load_weights."""
        modules = dict(self.named_modules())
        # A stage's embedding that is not also its LM head only looks rows up: it keeps no quantised copy.
        matmuls = {id(m) for m in self.matmul_modules()}
        for checkpoint_name, weight in weights:
            if checkpoint_name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            for hf_name in self._stage_targets(checkpoint_name):
                _, module, _, part = self._target(modules, hf_name)
                if not isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
                    raise ValueError(f"checkpoint tensor {hf_name!r} is quantised but feeds no matmul")
                if id(module) not in matmuls:
                    continue
                try:
                    module.load_quantized(weight, part)
                except ValueError as err:
                    raise ValueError(f"{hf_name}: {err}") from err

    def _load_one(self, modules: dict[str, nn.Module], hf_name: str, tensor: torch.Tensor) -> tuple[str, str, int]:
        """Copy one tensor into its parameter (or part of a fused one); returns what it filled."""
        module_name, module, kind, part = self._target(modules, hf_name)
        try:
            loader = getattr(module, "load", None)
            if loader is not None:
                loader(kind, tensor, part)
            else:
                param = getattr(module, kind)
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
        except ValueError as err:
            raise ValueError(f"{hf_name}: {err}") from err
        return module_name, kind, part

    def _expected_loads(self) -> list[tuple[str, str, int]]:
        expected = []
        for name, _ in self.named_parameters():
            module_name, _, kind = name.rpartition(".")
            module = self.get_submodule(module_name)
            parts = len(module.parts) if isinstance(module, ColumnParallelLinear) else 1
            expected += [(module_name, kind, p) for p in range(parts)]
        return expected
