"""How many KV blocks a rank gets: a budget from --kv-cache-memory (CPU) or --gpu-memory-utilization (devices)."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.startup_error import StartupError

GIB = float(1 << 30)


def gib(n: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class DeviceMemory:
    """What the profile run measured on a device."""

    total_bytes: int
    # Free before this rank loaded anything: memory others hold is total - this.
    free_at_start_bytes: int
    weights_bytes: int
    # Peak allocator bytes of the profile forward beyond the weights (activations, logits, workspaces).
    activation_peak_bytes: int


def device_kv_budget(memory: DeviceMemory, utilization: float) -> int:
    """KV bytes within total * utilization after weights and the activation peak; StartupError names the fix."""
    requested = int(memory.total_bytes * utilization)
    if memory.free_at_start_bytes < requested:
        fits = memory.free_at_start_bytes / memory.total_bytes
        raise StartupError(
            f"out of device memory: --gpu-memory-utilization {utilization} asks for {gib(requested)} of "
            f"{gib(memory.total_bytes)}, but only {gib(memory.free_at_start_bytes)} was free at startup (other "
            f"processes hold the rest); lower --gpu-memory-utilization to {max(fits - 0.01, 0.01):.2f} or less, "
            "or free the device"
        )
    budget = requested - memory.weights_bytes - memory.activation_peak_bytes
    if budget <= 0:
        raise StartupError(
            f"out of device memory: weights ({gib(memory.weights_bytes)}) and the activation peak at "
            f"--max-num-batched-tokens ({gib(memory.activation_peak_bytes)}) leave no KV cache room within "
            f"--gpu-memory-utilization {utilization} ({gib(requested)}); lower --max-num-batched-tokens or "
            "--max-num-seqs, raise --tensor-parallel-size or --pipeline-parallel-size, or raise "
            "--gpu-memory-utilization if the device is not shared"
        )
    return budget


def blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks in the budget."""
    return max(0, budget_bytes // bytes_per_block)


def check_fits_one_sequence(
    num_blocks: int, *, block_size: int, max_model_len: int, bytes_per_block: int, device: str
) -> None:
    """StartupError naming the flags to change when the cache cannot hold one --max-model-len sequence."""
    needed = -(-max_model_len // block_size)
    if num_blocks >= needed:
        return
    budget_flag = "raise --kv-cache-memory" if device == "cpu" else "raise --gpu-memory-utilization"
    raise StartupError(
        f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({bytes_per_block} bytes each) but one "
        f"--max-model-len={max_model_len} sequence needs {needed}: lower --max-model-len, --max-num-seqs or "
        f"--max-num-batched-tokens (they size the activation reserve), or {budget_flag}"
    )
