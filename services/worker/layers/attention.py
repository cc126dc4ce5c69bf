"""Paged KV cache write and varlen attention over it (pure-torch reference).

Cache layout "NHD-paged": [num_blocks, block_size, num_kv_heads, head_dim]; token slot
= block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    tokens, so this serves prefill chunks and decodes alike. Decodes (one query token) are batched
    into one padded attention; prefill chunks run one SDPA each. Softmax accumulates in float32.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    for b, seq_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        if end - start == 1:
            decode_rows.append(start)
            decode_seqs.append(b)
        elif end > start:
            out[start:end] = _prefill_attention(q[start:end], k_cache, v_cache, block_tables[b], seq_len, scale)
    if len(decode_rows) == len(lens):
        # A pure decode step (the common case): no scatter back into out.
        return _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if decode_rows:
        rows = torch.tensor(decode_rows, device=q.device)
        seqs = torch.tensor(decode_seqs, device=block_tables.device)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, block_tables[seqs], seq_lens[seqs], scale)
    return out


def _prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """One sequence's query chunk [Q, Hq, D] against its first seq_len cached tokens."""
    num_query = q.shape[0]
    k = gather_kv(k_cache, block_table, seq_len).transpose(0, 1).unsqueeze(0)
    v = gather_kv(v_cache, block_table, seq_len).transpose(0, 1).unsqueeze(0)
    qs = q.transpose(0, 1).unsqueeze(0)
    context = seq_len - num_query
    if context == 0:
        attn = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at position context + i and sees keys 0..context + i.
        query_pos = torch.arange(num_query, device=q.device).unsqueeze(1) + context
        key_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        mask = key_pos <= query_pos
        attn = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return attn.squeeze(0).transpose(0, 1)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence [B, Hq, D], all sequences in one SDPA, padded to the longest."""
    batch, head_dim = q.shape[0], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_blocks].reshape(-1)
    padded = num_blocks * block_size
    # [B, L, Hk, D] viewed as [B, Hk, L, D]; keys past a sequence's end are masked out.
    k = k_cache.index_select(0, table).view(batch, padded, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, table).view(batch, padded, num_kv_heads, head_dim).transpose(1, 2)
    valid = torch.arange(padded, device=q.device).unsqueeze(0) < seq_lens.to(q.device).unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out.squeeze(2)
