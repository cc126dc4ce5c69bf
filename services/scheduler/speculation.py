"""Prompt-lookup speculative decoding on the scheduler's side: --speculative-config and the n-gram proposer.

The planner asks propose() for each decoding request it may speculate; the worker verifies the drafts in the
same step (services/common/speculation.py has the rules both sides share).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.speculation import MAX_DRAFT_TOKENS

# Longest n-gram the proposer matches (prompt_lookup_max's cap): longer suffixes rarely find more, and each
# length tried is another search of the request's tokens.
MAX_PROMPT_LOOKUP = 16

_ITEM = array("i").itemsize


class SpeculativeConfig(BaseModel):
    """vLLM's --speculative-config for its "ngram" method, with vLLM's key names: '{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4}'."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram"] = Field(default="ngram", description="how drafts are proposed: ngram (prompt lookup)")
    num_speculative_tokens: int = Field(
        ge=1, le=MAX_DRAFT_TOKENS, description="most draft tokens one request carries in one step"
    )
    prompt_lookup_max: int = Field(default=4, ge=1, le=MAX_PROMPT_LOOKUP, description="longest suffix n-gram matched")
    prompt_lookup_min: int = Field(default=1, ge=1, le=MAX_PROMPT_LOOKUP, description="shortest suffix n-gram matched")
    disable_by_batch_size: int | None = Field(
        default=None,
        ge=1,
        description="no drafts while more requests than this run on the worker (in a full batch a refused "
        "draft's row costs what a token does, and async scheduling resumes without drafts); unset: always",
    )

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        return self

    def active(self, num_running: int) -> bool:
        """Whether a step over this many running requests carries drafts."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Drafts for a request whose tokens are token_ids: at most min(num_speculative_tokens, max_tokens)."""
        return propose_ngram(
            token_ids, min(self.num_speculative_tokens, max_tokens), self.prompt_lookup_min, self.prompt_lookup_max
        )


def propose_ngram(token_ids: Sequence[int], num_tokens: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to num_tokens tokens that followed the latest earlier occurrence of the sequence's suffix.

    The longest suffix of lookup_max down to lookup_min tokens that occurs earlier wins (a longer match is the
    better predictor); empty when none occurs. Searches the packed ids with bytes.rfind (C speed), keeping
    only matches aligned to a token boundary.
    """
    n_total = len(token_ids)
    if num_tokens < 1 or n_total < 2 or lookup_min < 1:
        return []
    packed = array("i", token_ids).tobytes()
    for n in range(min(lookup_max, n_total - 1), lookup_min - 1, -1):
        pattern = packed[(n_total - n) * _ITEM :]
        # A match must end before the last token, so that at least one token follows it.
        end = (n_total - 1) * _ITEM
        while True:
            at = packed.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % _ITEM == 0:
                start = at // _ITEM + n
                return list(token_ids[start : start + num_tokens])
            # Straddles token boundaries: look further back.
            end = at + len(pattern) - 1
    return []
