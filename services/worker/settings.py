"""Worker settings (flags and MESHSERVE_* variables)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from services.common.byte_sizes import parse_size
from services.common.engine_defaults import DEFAULT_MAX_NUM_SEQS
from services.common.settings import ServiceSettings

DEFAULT_PORT = 50053
# Blocks a rank's kvstore save queue holds before it drops new saves (each a CPU copy of its KV heads).
DEFAULT_KV_SAVE_QUEUE_BLOCKS = 256


def parse_layer_partition(value: str) -> tuple[int, ...]:
    """--pp-layer-partition "16,14" as (16, 14); ValueError naming the flag otherwise."""
    try:
        counts = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(
            f"--pp-layer-partition must be comma-separated layer counts like 16,14, got {value!r}"
        ) from None
    if min(counts) < 1:
        raise ValueError(f"--pp-layer-partition {value}: every stage needs at least one layer")
    return counts


class WorkerSettings(ServiceSettings):
    """Model, device and KV-cache settings of one worker (one tensor-parallel group)."""

    port: int = Field(DEFAULT_PORT, description="health-check gRPC port", ge=0, le=65535)
    scheduler_address: str = Field("127.0.0.1:50052", description="scheduler host:port to attach to")
    model: str | None = Field(
        None, description="Hugging Face model directory or .gguf file (unset: the embedded SmolLM2)"
    )
    device: Literal["auto", "cpu", "cuda", "npu"] = Field(
        "auto", description="device type (auto: npu, then cuda, then cpu)"
    )
    precision: str = Field(
        "auto",
        description="WEIGHTS-COMPUTE-ACCUM dtypes, e.g. bf16-fp16-fp32 (auto: fp32 on cpu, bf16-bf16-fp32 on cuda, "
        "bf16-fp16-fp32 on npu)",
    )
    dtype: Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] | None = Field(
        None, description="one dtype for weights, compute and accumulation (shorthand for --precision D-D-D)"
    )
    block_size: int | None = Field(
        None, description="tokens per KV block (unset: 128 on npu, 16 elsewhere)", ge=1, le=1024
    )
    tensor_parallel_size: int = Field(
        1, description="ranks each pipeline stage's layers are split over (one device each)", ge=1
    )
    pipeline_parallel_size: int = Field(
        1,
        description="pipeline stages the layers are split into, contiguous and balanced by parameters (each a TP "
        "group of --tensor-parallel-size ranks)",
        ge=1,
    )
    pipeline_micro_batching: bool = Field(
        True,
        description="with pipeline stages, keep one micro-batch per stage in flight so every stage works at once "
        "(off: one step at a time, P - 1 stages idle)",
    )
    pp_layer_partition: str | None = Field(
        None, description="decoder layers of each pipeline stage, comma-separated, e.g. 16,14 (unset: balanced)"
    )
    dist_init_addr: str | None = Field(
        None, description="host:port of rank 0's rendezvous for tensor parallelism across hosts (unset: local)"
    )
    nnodes: int = Field(1, description="hosts the worker's ranks span (tensor x pipeline parallel)", ge=1)
    node_rank: int = Field(0, description="this host's index among --nnodes (0 attaches to the scheduler)", ge=0)
    cpu_kernels: Literal["auto", "native", "reference"] = Field(
        "auto",
        description="CPU ops: native C++ kernels built on first use (auto falls back to reference if they "
        "cannot be built; native fails instead), or reference (pure torch)",
    )
    quantization: Literal["int8", "gguf"] | None = Field(
        None,
        description="weight-only quantisation: int8 rounds each linear's and the LM head's weight rows to int8 "
        "(half of bf16's bytes for the bandwidth-bound decode); gguf serves a .gguf --model's own Q4_0, Q4_1 "
        "and Q8_0 blocks (a quarter to a half); CPU with native kernels",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="where the weights come from: auto reads the model's files; dummy fills every parameter with "
        "small random values and needs only its config.json (to benchmark a model's shape without its weights)",
    )
    cpu_binding: Literal["auto", "off"] = Field(
        "auto", description="pin each rank to its device's NUMA-local CPUs (npu-smi topo, else sysfs)"
    )
    kv_cache_memory: str = Field("2GiB", description="KV cache size on the CPU (e.g. 2GiB)")
    gpu_memory_utilization: float = Field(
        0.9, description="fraction of device memory for weights, activations and KV cache (cuda, npu)", gt=0, le=1
    )
    max_model_len: int | None = Field(None, description="longest sequence (unset: the model's)", ge=2)
    max_num_batched_tokens: int | None = Field(
        None, description="largest step the worker must run (unset: its platform's step budget)", ge=1
    )
    max_num_seqs: int = Field(DEFAULT_MAX_NUM_SEQS, description="largest batch the worker must run", ge=1)
    seed: int = Field(0, description="seed of unseeded sampling")
    kv_store: str | None = Field(
        None,
        description="host:port of the kvstore: load prefix KV blocks computed elsewhere and save the blocks "
        "computed here (unset: off)",
    )
    kv_save_queue_blocks: int = Field(
        DEFAULT_KV_SAVE_QUEUE_BLOCKS,
        description="KV blocks each rank queues for the kvstore before it drops new saves (CPU copies)",
        ge=1,
    )
    kv_store_shared_memory: bool = Field(
        True,
        description="hand saved KV blocks to a kvstore on this host through shared memory (/dev/shm) instead of "
        "sending their bytes; a store that cannot read it (another host or user) is sent the bytes",
    )
    worker_id: str | None = Field(None, description="id shown to the scheduler (unset: host:pid)")
    device_telemetry: Literal["auto", "npu", "cuda", "off"] = Field(
        "auto",
        description="device gauges (temperature, power, HBM, utilisation) from npu-smi (npu) or NVML (cuda) on a "
        "background thread; auto: the worker's device type (the CPU reports none)",
    )
    device_telemetry_interval: float = Field(5.0, description="seconds between device telemetry reads", gt=0)
    served_model_name: str | None = Field(
        None,
        description="the model's name as this worker reports it: the model_name label of every metric, and "
        "the name the gateway serves when it has no --served-model-name (unset: the model directory's name)",
    )
    reconnect_interval: float = Field(1.0, description="seconds between attach attempts", gt=0)
    hung_step_timeout: float = Field(
        10.0,
        description="seconds a step may still run after the scheduler stream ended before the worker calls its "
        "model hung and exits non-zero for its supervisor to restart it",
        gt=0,
    )

    @field_validator("kv_cache_memory")
    @classmethod
    def _valid_size(cls, value: str) -> str:
        parse_size(value)
        return value

    @field_validator("precision")
    @classmethod
    def _valid_precision(cls, value: str) -> str:
        from services.worker.precision import parse_precision

        parse_precision(value, platform_default="fp32-fp32-fp32")
        return value

    @field_validator("pp_layer_partition")
    @classmethod
    def _valid_partition(cls, value: str | None) -> str | None:
        if value is not None:
            parse_layer_partition(value)
        return value

    @model_validator(mode="after")
    def _valid_topology(self) -> WorkerSettings:
        if self.world_size % self.nnodes:
            raise ValueError(
                f"--tensor-parallel-size {self.tensor_parallel_size} x --pipeline-parallel-size "
                f"{self.pipeline_parallel_size} = {self.world_size} ranks must be a multiple of --nnodes {self.nnodes}"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be < --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address every node can reach)")
        return self

    @property
    def world_size(self) -> int:
        """Ranks of the worker: every pipeline stage's tensor-parallel group."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        """Ranks (devices) this host runs."""
        return self.world_size // self.nnodes

    @property
    def layer_partition(self) -> tuple[int, ...] | None:
        """--pp-layer-partition as layer counts."""
        return None if self.pp_layer_partition is None else parse_layer_partition(self.pp_layer_partition)

    @property
    def kv_cache_memory_bytes(self) -> int:
        """--kv-cache-memory in bytes."""
        return parse_size(self.kv_cache_memory)
