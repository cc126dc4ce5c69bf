"""Vectorised logits processors: each works on a [M, V] float32 sub-batch, one row per request.

Every function is row-wise (a row's result never depends on the other rows, bit for bit), which is what keeps
seeded requests independent of their batch companions. Where rows with different settings share one call, a
row whose setting is off gets the neutral value (repetition 1.0, frequency and presence 0) and is left exactly
unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

NEG_INF = float("-inf")


def _pairs(
    rows: Sequence[int], ids: Sequence[int], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, id) index tensors, and which pairs have an id inside the vocabulary."""
    row_t = torch.tensor(rows, dtype=torch.int64, device=device)
    id_t = torch.tensor(ids, dtype=torch.int64, device=device)
    # An id the model cannot produce (a stop id from another tokenizer, say) has no logit to change.
    return row_t, id_t, (id_t >= 0) & (id_t < vocab)


def add_logit_bias(logits: torch.Tensor, rows: Sequence[int], ids: Sequence[int], values: Sequence[float]) -> None:
    """logits[rows[j], ids[j]] += values[j], in place."""
    row_t, id_t, keep = _pairs(rows, ids, logits.shape[1], logits.device)
    value_t = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    logits.index_put_((row_t[keep], id_t[keep]), value_t[keep], accumulate=True)


def ban_tokens(logits: torch.Tensor, rows: Sequence[int], ids: Sequence[int]) -> None:
    """logits[rows[j], ids[j]] = -inf, in place."""
    row_t, id_t, keep = _pairs(rows, ids, logits.shape[1], logits.device)
    logits.index_put_((row_t[keep], id_t[keep]), torch.tensor(NEG_INF, dtype=logits.dtype, device=logits.device))


def history_keys(rows: Sequence[int], histories: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """Flat indices row x vocab + token of every token of each row's history (repeats kept)."""
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.int64)
    flat = torch.tensor(list(chain.from_iterable(histories)), dtype=torch.int64)
    row_t = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    keep = (flat >= 0) & (flat < vocab)
    return (row_t * vocab + flat)[keep]


def apply_penalties(
    logits: torch.Tensor,
    output_keys: torch.Tensor,
    prompt_keys: torch.Tensor | None,
    repetition: torch.Tensor | None,
    frequency: torch.Tensor | None,
    presence: torch.Tensor | None,
) -> None:
    """Repetition, then frequency, then presence penalties on logits [N, V] (contiguous), in place, as vLLM.

    output_keys / prompt_keys: history_keys of the rows' outputs (every penalised row) and prompts (rows with a
    repetition penalty). repetition / frequency / presence: [N] per-row values, neutral for other rows; None
    when no row uses it. Only the (row, token) pairs in a history are read and written: a few hundred per row
    against a vocabulary of tens of thousands, where vLLM's dense [N, V] count tensors cost a dozen full
    passes over the logits on the CPU. The result is the same, bit for bit, as the dense form.
    """
    vocab = logits.shape[1]
    flat = logits.view(-1)
    if repetition is not None:
        seen = output_keys if prompt_keys is None else torch.cat([output_keys, prompt_keys])
        penalty = repetition[seen // vocab]
        # Read before any write: a token repeated in the history is written several times with the same value,
        # so it is penalised once, as a present token, with no sort to deduplicate.
        values = flat[seen]
        # Divide positive logits and multiply negative ones (transformers' RepetitionPenaltyLogitsProcessor):
        # either way the token gets less likely for a penalty > 1.
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if frequency is None and presence is None:
        return
    present, counts = torch.unique(output_keys, return_counts=True)
    rows = present // vocab
    values = flat[present]
    if frequency is not None:
        values = values - frequency[rows] * counts.to(values.dtype)
    if presence is not None:
        values = values - presence[rows]
    flat[present] = values


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [M] x the row's top probability, in place.

    p / p_max = exp(logit - logit_max), so the test is logit < logit_max + log(min_p): one max instead of a
    softmax of the row.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill_(logits < threshold, NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k [M] (each in 1..V-1) largest logits, ties with the k-th included, in place."""
    values = torch.topk(logits, int(top_k.max()), dim=-1).values
    kth = values.gather(1, (top_k - 1)[:, None])
    return logits.masked_fill_(logits < kth, NEG_INF)


# Candidate widths tried for top-p before a full sort: the nucleus of a real distribution is usually a few
# dozen tokens, and a topk of 256 costs a small fraction of sorting a 50k vocabulary on the CPU.
TOP_P_CANDIDATES = (256, 4096)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus: the most likely tokens until the mass before one reaches top_p [M] (in (0, 1)).

    The most likely token always stays. Equals transformers' TopPLogitsWarper (drop a token when the ascending
    cumulative probability up to it is <= 1 - top_p) up to float rounding. Rows whose nucleus fits in the
    first candidate width are done with a topk; the others try the next width, then a full sort. Whatever
    width resolves a row gives the same result (the same descending prefix sums), so a row's result does not
    depend on its batch.
    """
    m, vocab = logits.shape
    widths = [*(w for w in TOP_P_CANDIDATES if w < vocab), vocab]
    first = _descending(logits, widths[0])
    # The normaliser, to turn candidate logits into probabilities without writing an [M, V] softmax. A row
    # whose candidates end in -inf (min_p or top-k ran before) has all its mass among them: no pass over V.
    log_total = torch.logsumexp(first[0], dim=-1, keepdim=True)
    spread = (first[0][:, -1] > NEG_INF).nonzero().squeeze(1)
    if len(spread) == m:
        log_total = torch.logsumexp(logits, dim=-1, keepdim=True)
    elif len(spread):
        log_total.index_copy_(0, spread, torch.logsumexp(logits.index_select(0, spread), dim=-1, keepdim=True))
    out = torch.full_like(logits, NEG_INF)
    flat_logits, flat_out = logits.view(-1), out.view(-1)
    pending = torch.arange(m)
    for level, width in enumerate(widths):
        if level == 0:
            top, order = first
        else:
            top, order = _descending(logits.index_select(0, pending), width)
        values = torch.exp(top - log_total.index_select(0, pending))
        before = values.cumsum(dim=-1) - values
        keep = before < top_p.index_select(0, pending)[:, None]
        keep[:, 0] = True
        # Resolved when the nucleus ends inside the candidates: every later token has at least as much before.
        resolved = ~keep[:, -1] if width < vocab else torch.ones(len(pending), dtype=torch.bool)
        # Flat indices of the resolved rows' candidates: only those are read and written.
        index = (pending[resolved] * vocab)[:, None] + order[resolved]
        flat_out[index] = flat_logits[index].masked_fill_(~keep[resolved], NEG_INF)
        pending = pending[~resolved]
        if len(pending) == 0:
            break
    return out


def _descending(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The width largest logits of each row and their ids, largest first (a sort when width is V)."""
    if width < logits.shape[1]:
        values, ids = torch.topk(logits, width, dim=-1)
        return values, ids
    values, ids = torch.sort(logits, dim=-1, descending=True)
    return values, ids
