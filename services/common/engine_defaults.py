"""Batching limits that the scheduler and the worker both take as flags: one default for both.

The scheduler plans within the smaller of its own flag and what each worker reports, so the two
defaults must agree or one silently wins.
"""

from __future__ import annotations

# Most requests in one step (vLLM's --max-num-seqs).
DEFAULT_MAX_NUM_SEQS = 128
# Token budget of one step (vLLM's --max-num-batched-tokens).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
