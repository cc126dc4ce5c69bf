"""Paged KV cache write and varlen attention over it (pure-torch reference).

Cache layout "NHD-paged": [num_blocks, block_size, num_kv_heads, head_dim]; token slot
= block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where a flat varlen batch's tokens live in the paged cache and which sequence each belongs to."""

    # Per token [T]: cache slot its K/V are written to.
    slot_mapping: torch.Tensor
    # Per sequence [B + 1] (CPU, int64): offsets of each sequence's query tokens in the flat batch.
    query_start_loc: torch.Tensor
    # Per sequence [B] (CPU, int64): tokens in the cache after this step (context + query).
    seq_lens: torch.Tensor
    # Per sequence [B, max_blocks] (int64): block ids, padded with 0.
    block_tables: torch.Tensor


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, Hk, D] into the caches at slot_mapping [T]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Return the first seq_len tokens [L, Hk, D] of one sequence from a paged cache."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks])
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's cached context; returns [T, Hq, D].

    A sequence's query tokens are its last (query_start_loc[b+1] - query_start_loc[b]) cached
    tokens, so this serves prefill chunks and decodes alike. Softmax runs in float32.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        num_query = end - start
        if num_query == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len).float()
        v = gather_kv(v_cache, block_tables[b], seq_len).float()
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qs = q[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        context = seq_len - num_query
        query_pos = torch.arange(num_query).unsqueeze(1) + context
        key_pos = torch.arange(seq_len).unsqueeze(0)
        scores.masked_fill_((key_pos > query_pos).to(scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
