"""Reference ops against straightforward formulas and transformers' conventions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from services.worker.layers.activation import silu_and_mul
from services.worker.layers.attention import HND, NHD, cache_shape, gather_kv, paged_attention, reshape_and_cache
from services.worker.layers.norm import add_rms_norm, rms_norm
from services.worker.layers.rotary import RotaryTable, apply_rotary, inv_freq_for_config
from services.worker.platforms import CpuPlatform, DeviceUnavailableError, get_platform


def test_rms_norm_matches_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g)
    w = torch.rand(32, generator=g) + 0.5
    expected = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), expected)


def test_rms_norm_matches_transformers_in_bf16() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = LlamaRMSNorm(64, eps=1e-5).bfloat16()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        expected = ref(x)
    assert torch.equal(rms_norm(x, ref.weight, 1e-5), expected)


def test_add_rms_norm_returns_sum_as_residual() -> None:
    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    w = torch.rand(16, generator=g)
    normed, residual = add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(residual, x + r)
    torch.testing.assert_close(normed, rms_norm(x + r, w, 1e-6))


def test_rotary_matches_transformers_rotate_half() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    head_dim = 16
    positions = torch.tensor([0, 1, 7, 30, 63])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(positions), 4, head_dim, generator=g)
    k = torch.randn(len(positions), 2, head_dim, generator=g)
    inv_freq, scaling = inv_freq_for_config(config, head_dim)
    cos, sin = RotaryTable(inv_freq, 64, scaling).lookup(positions)
    ours_q, ours_k = apply_rotary(q, k, cos, sin)

    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions.unsqueeze(0))
    # transformers wants [batch, heads, seq, dim].
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), hf_cos, hf_sin)
    torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1))
    torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1))


def test_rotary_position_zero_is_identity_and_norm_preserved() -> None:
    table = RotaryTable(1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), 16)
    x = torch.randn(2, 1, 8)
    cos, sin = table.lookup(torch.tensor([0, 5]))
    q, _ = apply_rotary(x, x, cos, sin)
    torch.testing.assert_close(q[0], x[0])
    torch.testing.assert_close(q.norm(dim=-1), x.norm(dim=-1))


def test_silu_and_mul_is_swiglu() -> None:
    x = torch.randn(3, 10)
    gate, up = x[:, :5], x[:, 5:]
    torch.testing.assert_close(silu_and_mul(x), gate * torch.sigmoid(gate) * up)


def test_reshape_and_cache_writes_slots() -> None:
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    k = torch.arange(6.0).reshape(2, 1, 3)
    v = -k
    # slot 5 = block 2 offset 1; slot 0 = block 0 offset 0
    reshape_and_cache(k, v, k_cache, v_cache, torch.tensor([5, 0]))
    assert torch.equal(k_cache[2, 1], k[0])
    assert torch.equal(k_cache[0, 0], k[1])
    assert torch.equal(v_cache[2, 1], v[0])
    assert k_cache.abs().sum() == k.abs().sum()


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query: int) -> torch.Tensor:
    """Attention of the last num_query positions over all L keys; q [Q, H, D], k/v [L, Hk, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    length = k.shape[1]
    mask = torch.ones(length, length, dtype=torch.bool).tril()[length - num_query :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("layout", [NHD, HND])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_paged_attention_matches_dense_causal(num_heads: int, num_kv_heads: int, layout: str) -> None:
    g = torch.Generator().manual_seed(4)
    block_size, head_dim, num_blocks = 4, 8, 32
    k_cache = torch.zeros(cache_shape(num_blocks, block_size, num_kv_heads, head_dim, layout))
    v_cache = torch.zeros_like(k_cache)
    # (context already cached, new query tokens): prefill, chunk continuation, decode.
    shapes = [(0, 7), (5, 6), (9, 1), (0, 1)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, q_parts, expected = [], [], []
    for context, num_query in shapes:
        length = context + num_query
        blocks = [perm.pop() for _ in range(math.ceil(length / block_size))]
        tables.append(blocks)
        k = torch.randn(length, num_kv_heads, head_dim, generator=g)
        v = torch.randn(length, num_kv_heads, head_dim, generator=g)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(length)])
        reshape_and_cache(k, v, k_cache, v_cache, slots, layout)
        q = torch.randn(num_query, num_heads, head_dim, generator=g)
        q_parts.append(q)
        expected.append(_dense_causal(q, k, v, num_query))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    starts = [0]
    for _, n in shapes:
        starts.append(starts[-1] + n)
    out = paged_attention(
        torch.cat(q_parts),
        k_cache,
        v_cache,
        block_tables,
        torch.tensor([c + n for c, n in shapes]),
        torch.tensor(starts),
        head_dim**-0.5,
        layout,
    )
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
    # Both layouts hold the same tokens at the same slots.
    if layout == HND:
        assert torch.equal(
            gather_kv(k_cache, block_tables[0], 7, HND),
            gather_kv(k_cache.transpose(1, 2).contiguous(), block_tables[0], 7),
        )


def test_get_platform() -> None:
    cpu = get_platform("cpu")
    assert isinstance(cpu, CpuPlatform)
    assert cpu.device == torch.device("cpu")
    assert cpu.dist_backend == "gloo"
    assert isinstance(get_platform("auto"), CpuPlatform)
    info = cpu.memory_info()
    assert 0 < info.free_bytes <= info.total_bytes
    cpu.synchronize()
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="nvidia-smi"):
            get_platform("cuda")
    with pytest.raises(ValueError, match="--device must be one of"):
        get_platform("tpu")


def test_platform_ops_are_the_reference_ops() -> None:
    ops = get_platform("cpu").ops
    x = torch.randn(2, 8)
    w = torch.ones(8)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    torch.testing.assert_close(ops.silu_and_mul(x), silu_and_mul(x))
