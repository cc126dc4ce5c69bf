"""A stand-in worker that keeps a persistent batch like the real one and checks every Step it gets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.proto.meshserve.v1 import worker_pb2
from services.common.speculation import accepted_length

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
    """Keeps a persistent batch like the real worker and asserts every Step is consistent.

    With `store` (block hash -> present) it also plays the kvstore: saves add hashes, loads answer with the
    leading blocks present, `load_delay` steps after they were sent; no step may touch a block under load.
    """

    block_size: int = BS
    next_token: Callable[[list[int]], int] = default_next_token
    held: dict[str, _Held] = field(default_factory=dict)
    store: set[bytes] | None = None
    load_delay: int = 0
    loads: list[tuple[int, worker_pb2.KVLoad]] = field(default_factory=list)
    loading_blocks: set[int] = field(default_factory=set)
    num_saved: int = 0
    # Steps of a request with drafts (speculative decoding) this worker verified.
    num_verified: int = 0

    def _take_loads(self, step: worker_pb2.Step, result: worker_pb2.StepResult) -> None:
        for load in step.kv_loads:
            assert self.store is not None, "kv_loads sent to a worker without a store"
            self.loads.append((self.load_delay, load))
            self.loading_blocks.update(b.block_id for b in load.blocks)
        ready = []
        while self.loads and self.loads[0][0] <= 0:
            ready.append(self.loads.pop(0)[1])
        self.loads = [(n - 1, load) for n, load in self.loads]
        for load in ready:
            num = 0
            for block in load.blocks:
                if block.block_hash not in (self.store or set()):
                    break
                num += 1
            self.loading_blocks.difference_update(b.block_id for b in load.blocks)
            result.kv_loads_done.append(worker_pb2.KVLoadDone(load_id=load.load_id, num_loaded=num))

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        result = worker_pb2.StepResult(step_id=step.step_id)
        self._take_loads(step, result)
        for rid in step.removed_request_ids:
            self.held.pop(rid)
        work: list[tuple[str, int]] = []
        drafts: dict[str, list[int]] = {}
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
            if s.draft_token_ids:
                drafts[s.request_id] = list(s.draft_token_ids)
                assert s.num_computed_tokens + s.num_scheduled_tokens == len(h.tokens) + len(s.draft_token_ids)
            work.append((s.request_id, s.num_scheduled_tokens))
        for rid, _ in work:
            touched = self.loading_blocks.intersection(self.held[rid].blocks)
            assert not touched, f"step {step.step_id} uses blocks {touched} that are still loading"
        for rid, num in work:
            h = self.held[rid]
            guess = drafts.get(rid, [])
            h.computed += num
            assert h.computed <= len(h.tokens) + len(guess)
            assert len(h.blocks) * self.block_size >= h.computed
            if h.computed == len(h.tokens) + len(guess):
                # Verification as the real worker does it: a sample at every draft position.
                sampled = [self.next_token(h.tokens + guess[:j]) for j in range(len(guess) + 1)]
                kept = sampled[: accepted_length(guess, sampled)]
                h.tokens += kept
                if guess:
                    h.computed = len(h.tokens) - 1
                    self.num_verified += 1
                for tok in kept:
                    result.sampled.append(worker_pb2.SampledToken(request_id=rid, token_id=tok, logprob=-0.5))
        for save in step.kv_saves:
            assert self.store is not None, "kv_saves sent to a worker without a store"
            self.store.add(save.block_hash)
            self.num_saved += 1
        return result
