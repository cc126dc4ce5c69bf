"""Paged KV cache write and varlen attention over it (pure-torch reference).

Two cache layouts; a token's slot is block_id * block_size + offset in both:
- "NHD": [num_blocks, block_size, num_kv_heads, head_dim] (vLLM's, and what Ascend's kernels take);
- "HND": [num_blocks, num_kv_heads, block_size, head_dim] (the CPU and CUDA default): gathering a
  batch's blocks head-major yields [B, Hk, L, D] in one copy, ready for the attention matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NHD = "NHD"
HND = "HND"
LAYOUTS = (NHD, HND)


# One query token per sequence: (q [B, Hq, D], k_cache, v_cache, block_tables [B, nb], seq_lens [B], scale,
# layout) -> [B, Hq, D]. decode_attention below is the reference; platforms may pass a native kernel.
DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, str], torch.Tensor
]
# Every sequence whose query has more than one token: (q [T, Hq, D], k_cache, v_cache, block_tables [B, nb],
# seq_lens [B], query_start_loc [B + 1], scale, layout) -> [T, Hq, D] holding those sequences' rows (a
# single-token sequence's rows are left for the decode attention). prefill_attention below is the reference.
PrefillAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, str], torch.Tensor
]


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


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, layout: str) -> tuple[int, ...]:
    """Shape of one layer's K (or V) cache in the layout."""
    if layout == NHD:
        return (num_blocks, block_size, num_kv_heads, head_dim)
    if layout == HND:
        return (num_blocks, num_kv_heads, block_size, head_dim)
    raise ValueError(f"unknown KV cache layout {layout!r}; expected one of {LAYOUTS}")


def head_major(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The cache as [num_blocks, Hk, block_size, D] (a view; not contiguous for NHD)."""
    return cache if layout == HND else cache.permute(0, 2, 1, 3)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: str = NHD,
) -> None:
    """Write k, v [T, Hk, D] into the caches at slot_mapping [T]."""
    if layout == NHD:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    # Advanced indices around a slice: the indexed view is [T, Hk, D], matching k and v.
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, layout: str = NHD) -> torch.Tensor:
    """Return the first seq_len tokens [L, Hk, D] of one sequence from a paged cache."""
    return _gather_head_major(cache, block_table, seq_len, layout).transpose(0, 1)


def _gather_head_major(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, layout: str) -> torch.Tensor:
    """The first seq_len tokens of one sequence as [Hk, L, D]."""
    hnd = head_major(cache, layout)
    num_kv_heads, block_size, head_dim = hnd.shape[1], hnd.shape[2], hnd.shape[3]
    num_blocks = -(-seq_len // block_size)
    blocks = hnd.index_select(0, block_table[:num_blocks])
    return blocks.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    layout: str = NHD,
    decode: DecodeAttention | None = None,
    prefill: PrefillAttention | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's cached context; returns [T, Hq, D].

    A sequence's query tokens are its last (query_start_loc[b+1] - query_start_loc[b]) cached
    tokens, at least one (the runner refuses steps that schedule none), so this serves prefill chunks and
    decodes alike. Decodes (one query token) are batched
    into one call of `decode` (default: a padded pure-torch attention); the multi-token sequences into
    one call of `prefill` (default: one SDPA each). Softmax accumulates in float32.
    """
    decode = decode or decode_attention
    prefill = prefill or prefill_attention
    if q.shape[0] == seq_lens.shape[0]:
        # As many query tokens as sequences, each at least one: a pure decode step, told without reading the
        # offsets (every layer of every decode step asks).
        return decode(q, k_cache, v_cache, block_tables, seq_lens, scale, layout)
    starts = query_start_loc.tolist()
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    for b in range(len(starts) - 1):
        if starts[b + 1] - starts[b] == 1:
            decode_rows.append(starts[b])
            decode_seqs.append(b)
    if len(decode_rows) == len(starts) - 1:
        # A pure decode step (the common case): no scatter back into out.
        return decode(q, k_cache, v_cache, block_tables, seq_lens, scale, layout)
    out = prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout)
    if decode_rows:
        rows = torch.tensor(decode_rows, device=q.device)
        seqs = torch.tensor(decode_seqs, device=block_tables.device)
        out[rows] = decode(q[rows], k_cache, v_cache, block_tables[seqs], seq_lens[seqs], scale, layout)
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    layout: str,
) -> torch.Tensor:
    """The rows of every sequence with more than one query token (see PrefillAttention): one SDPA each."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        if end - start > 1:
            k = _gather_head_major(k_cache, block_tables[b], seq_len, layout)
            v = _gather_head_major(v_cache, block_tables[b], seq_len, layout)
            out[start:end] = _prefill_attention(q[start:end], k, v, scale)
    return out


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's query chunk [Q, Hq, D] against its first L cached tokens k, v [Hk, L, D]."""
    num_query, seq_len = q.shape[0], k.shape[1]
    qs = q.transpose(0, 1).unsqueeze(0)
    ks, vs = k.unsqueeze(0), v.unsqueeze(0)
    context = seq_len - num_query
    if context == 0:
        attn = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at position context + i and sees keys 0..context + i.
        query_pos = torch.arange(num_query, device=q.device).unsqueeze(1) + context
        key_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        mask = key_pos <= query_pos
        attn = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return attn.squeeze(0).transpose(0, 1)


def _gather_batch(cache: torch.Tensor, tables: torch.Tensor, layout: str) -> torch.Tensor:
    """Every sequence's blocks (tables [B, nb]) as [B, Hk, nb * block_size, D]."""
    batch, num_blocks = tables.shape
    hnd = head_major(cache, layout)
    num_kv_heads, block_size, head_dim = hnd.shape[1], hnd.shape[2], hnd.shape[3]
    if layout == HND:
        # Rows of the [blocks * Hk, block_size, D] view in (sequence, head, block) order: one copy, final layout.
        heads = torch.arange(num_kv_heads, device=tables.device).view(1, num_kv_heads, 1)
        rows = (tables.unsqueeze(1) * num_kv_heads + heads).reshape(-1)
        flat = cache.view(-1, block_size, head_dim).index_select(0, rows)
        return flat.view(batch, num_kv_heads, num_blocks * block_size, head_dim)
    gathered = cache.index_select(0, tables.reshape(-1))
    return gathered.view(batch, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    layout: str,
) -> torch.Tensor:
    """One query token per sequence [B, Hq, D], all sequences in two batched matmuls, padded to the longest.

    Not SDPA: with one query row and a padding mask, torch's CPU SDPA kernel runs ~14x slower in bf16 than
    these matmuls (5 ms vs 0.36 ms per layer at batch 32, SmolLM2 shapes). Softmax is in float32.
    """
    batch, num_heads, head_dim = q.shape
    block_size = head_major(k_cache, layout).shape[2]
    max_len = int(seq_lens.max())
    tables = block_tables[:, : -(-max_len // block_size)]
    k = _gather_batch(k_cache, tables, layout)
    v = _gather_batch(v_cache, tables, layout)
    num_kv_heads, padded = k.shape[1], k.shape[2]
    # Query heads of one KV group side by side: [B, Hk, group, D] against the group's keys.
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * scale
    valid = torch.arange(padded, device=q.device).unsqueeze(0) < seq_lens.to(q.device).unsqueeze(1)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(batch, num_heads, head_dim)
