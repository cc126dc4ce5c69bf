"""The profile run: the largest step the worker may be sent, to measure its activation peak before sizing KV."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.kv_cache import KVCache

if TYPE_CHECKING:
    from services.worker.model_runner import ModelRunner
    from services.worker.models.llama import LlamaArch


def profile_spans(max_tokens: int, max_model_len: int, max_seqs: int) -> list[int]:
    """Sequence lengths of the profile step: max_tokens split into at most max_seqs pieces of <= max_model_len."""
    lengths: list[int] = []
    remaining = max_tokens
    while remaining > 0 and len(lengths) < max_seqs:
        lengths.append(min(remaining, max_model_len))
        remaining -= lengths[-1]
    return lengths


def profile_peak_memory(runner: ModelRunner, arch: LlamaArch) -> int:
    """Run a --max-num-batched-tokens prefill (logits for --max-num-seqs rows); return its peak beyond the weights.

    The step's own KV blocks live in a scratch cache freed afterwards. On the CPU the allocator keeps no
    statistics, so the peak is 0 there; the run still proves the largest step fits and warms the kernels.
    """
    config = runner.config
    lengths = profile_spans(runner.max_num_batched_tokens, runner.max_model_len, config.max_num_seqs)
    bs = runner.block_size
    blocks_each = [-(-n // bs) for n in lengths]
    scratch = KVCache.allocate(
        num_blocks=sum(blocks_each),
        num_layers=runner.stage.num_layers,
        block_size=bs,
        num_kv_heads=runner.model.num_kv_heads,
        head_dim=arch.head_dim,
        dtype=runner.precision.kv_dtype,
        device=runner.device,
        layout=runner.platform.ops.kv_layout,
    )
    spans = []
    first = 0
    for n, count in zip(lengths, blocks_each, strict=True):
        spans.append(([0] * n, list(range(first, first + count)), 0, n))
        first += count
    # Logits for as many rows as a step may sample, the last token of each span first.
    total = sum(lengths)
    rows = min(config.max_num_seqs, total)
    sample_rows = sorted(set(range(total - rows, total)))
    runner.platform.synchronize()
    runner.platform.empty_cache()
    runner.platform.reset_peak_memory()
    baseline = runner.platform.peak_memory_bytes()
    runner.forward(spans, sample_rows, kv_layers=scratch.layers)
    runner.platform.synchronize()
    peak = max(0, runner.platform.peak_memory_bytes() - baseline)
    del scratch
    runner.platform.empty_cache()
    return peak
