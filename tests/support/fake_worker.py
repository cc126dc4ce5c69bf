"""A stand-in worker that keeps a persistent batch like the real one and checks every Step it gets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.proto.meshserve.v1 import worker_pb2

BS = 4


@dataclass
class _Held:
    tokens: list[int]
    blocks: list[int]
    computed: int


def default_next_token(tokens: list[int]) -> int:
    """Deterministic in the sequence so far, so a recomputed request continues identically."""
    return 1000 + (sum(tokens) * 31 + len(tokens)) % 997


@dataclass
class FakeWorker:
    """Keeps a persistent batch like the real worker and asserts every Step is consistent."""

    block_size: int = BS
    next_token: Callable[[list[int]], int] = default_next_token
    held: dict[str, _Held] = field(default_factory=dict)

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        for rid in step.removed_request_ids:
            self.held.pop(rid)
        work: list[tuple[str, int]] = []
        for n in step.new_requests:
            assert n.request_id not in self.held
            self.held[n.request_id] = _Held(
                [*n.prompt_token_ids, *n.output_token_ids], list(n.block_ids), n.num_computed_tokens
            )
            work.append((n.request_id, n.num_scheduled_tokens))
        for s in step.scheduled:
            h = self.held[s.request_id]
            assert s.num_computed_tokens == h.computed
            h.blocks += s.new_block_ids
            work.append((s.request_id, s.num_scheduled_tokens))
        result = worker_pb2.StepResult(step_id=step.step_id)
        for rid, num in work:
            h = self.held[rid]
            h.computed += num
            assert h.computed <= len(h.tokens)
            assert len(h.blocks) * self.block_size >= h.computed
            if h.computed == len(h.tokens):
                tok = self.next_token(h.tokens)
                h.tokens.append(tok)
                result.sampled.append(worker_pb2.SampledToken(request_id=rid, token_id=tok, logprob=-0.5))
        return result
