"""Batching limits that the scheduler and the worker both take as flags: one default for both.

The scheduler plans within the smaller of its own flag and what each worker reports, so the two
defaults must agree or one silently wins. The step's token budget is the worker's platform's to choose:
the scheduler leaves its flag unset by default and plans within what each worker reports.
"""

from __future__ import annotations

# Most requests in one step (vLLM's --max-num-seqs).
DEFAULT_MAX_NUM_SEQS = 128
# Token budget of one step (vLLM's --max-num-batched-tokens) on a platform that sets none of its own
# (Platform.default_max_num_batched_tokens); the worker reports what it runs, and the scheduler plans within
# it unless its own flag is smaller. Also what a worker from before WorkerHello.max_num_batched_tokens ran.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
