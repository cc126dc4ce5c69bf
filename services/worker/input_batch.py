"""The worker's persistent batch: per-request state kept across steps, keyed by request id."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from services.common.proto.meshserve.v1 import sampling_pb2
from services.worker.sampling_options import SamplingOptions


@dataclass
class CachedRequest:
    """One request as the worker knows it."""

    request_id: str
    # Prompt followed by every output token so far (including the last sampled one).
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    sampling: sampling_pb2.SamplingParams = field(default_factory=sampling_pb2.SamplingParams)
    # The model's EOS ids as the scheduler sent them (empty under ignore_eos): banned before min_tokens.
    eos_token_ids: tuple[int, ...] = ()
    # Resolved once here rather than read from the proto for every row of every step.
    sampling_options: SamplingOptions = field(init=False)
    # Rank 0 only: the request's position in its grammar (a GrammarMatcher), None when unconstrained.
    grammar: Any = None
    # Why this request alone cannot go on (its grammar failed): (field, message), reported at its next sample.
    failure: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        self.sampling_options = SamplingOptions.from_params(self.sampling, self.eos_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (also the index of the next sampled token)."""
        return len(self.token_ids) - self.num_prompt_tokens

    def slot(self, position: int, block_size: int) -> int:
        """The cache slot of the token at position."""
        return self.block_ids[position // block_size] * block_size + position % block_size


class InputBatch:
    """Requests the worker holds between steps."""

    def __init__(self) -> None:
        self._requests: dict[str, CachedRequest] = {}
        # How many held requests reference each KV block (prefix-shared blocks are held by several), kept as
        # blocks come and go so the count of blocks in use costs nothing per step.
        self._block_refs: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def add(self, request: CachedRequest) -> None:
        """Add a request; its id must be new."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already in the worker's batch")
        self._requests[request.request_id] = request
        self._block_refs.update(request.block_ids)

    def extend_blocks(self, request: CachedRequest, block_ids: list[int]) -> None:
        """A held request got more blocks."""
        request.block_ids.extend(block_ids)
        self._block_refs.update(block_ids)

    def remove(self, request_id: str) -> CachedRequest | None:
        """Drop a request; unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._block_refs.subtract(request.block_ids)
            for block in request.block_ids:
                if self._block_refs[block] <= 0:
                    del self._block_refs[block]
        return request

    @property
    def num_blocks_held(self) -> int:
        """Distinct KV blocks the held requests use."""
        return len(self._block_refs)

    def get(self, request_id: str) -> CachedRequest:
        """The request with this id, or a ValueError naming it."""
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"scheduled request {request_id!r} is not in the worker's batch")
        return request

    def request_ids(self) -> list[str]:
        """Ids of the held requests, in insertion order."""
        return list(self._requests)
