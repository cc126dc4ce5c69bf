"""Per-request token sampling: greedy, temperature, top-k, top-p, and batch-independent seeds.

Logprobs are those of the raw model distribution (log_softmax of the unprocessed logits), as
vLLM returns by default, whatever the temperature / top-k / top-p used to pick the token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.proto.meshserve.v1 import sampling_pb2

# Temperatures below this are treated as greedy (vLLM's threshold), avoiding overflow in logits / T.
_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SampleRequest:
    """What the sampler needs about one row: its parameters and which output token it picks."""

    params: sampling_pb2.SamplingParams
    # Index of the token being sampled among the request's outputs (0 for the first).
    output_index: int


@dataclass(frozen=True)
class Sampled:
    """A sampled token and, when asked for, its raw-model logprob."""

    token_id: int
    logprob: float | None


def token_seed(seed: int, output_index: int) -> int:
    """A 63-bit generator seed from (request seed, output index), stable across processes."""
    digest = hashlib.sha256(f"meshserve-sample:{seed}:{output_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def is_greedy(params: sampling_pb2.SamplingParams) -> bool:
    """True when the request picks the argmax (temperature 0)."""
    return params.HasField("temperature") and params.temperature < _GREEDY_EPS


def process_logits(logits: torch.Tensor, params: sampling_pb2.SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to one row of float32 logits [V] (masked entries -> -inf)."""
    temperature = params.temperature if params.HasField("temperature") else 1.0
    logits = logits / temperature
    vocab = logits.shape[-1]
    top_k = params.top_k if params.HasField("top_k") else 0
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = params.top_p if params.HasField("top_p") else 1.0
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    """Samples one token per row; seeded requests draw from a per-token generator."""

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> list[Sampled]:
        """Sample rows of float32 logits [N, V] for the N requests, in order."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        logits = logits.float().cpu()
        out: list[Sampled] = []
        # One argmax for the whole batch: most rows of a serving batch are greedy. max().indices is the
        # same first-maximum index, 3x faster than argmax() on the CPU for [32, 49152].
        argmax = logits.max(dim=-1).indices.tolist()
        for i, (row, request) in enumerate(zip(logits, requests, strict=True)):
            params = request.params
            if is_greedy(params):
                token = argmax[i]
            else:
                probs = torch.softmax(process_logits(row, params), dim=-1)
                generator = self._generator
                if params.HasField("seed"):
                    generator = torch.Generator().manual_seed(token_seed(params.seed, request.output_index))
                token = int(torch.multinomial(probs, 1, generator=generator).item())
            logprob = None
            if params.logprobs:
                logprob = float(torch.log_softmax(row, dim=-1)[token].item())
            out.append(Sampled(token_id=token, logprob=logprob))
        return out
