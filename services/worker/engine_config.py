"""Static configuration of one worker engine (model, precision, device, parallelism, KV budget, batch limits)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.engine_defaults import DEFAULT_MAX_NUM_SEQS
from services.common.tls import Security
from services.worker.precision import Precision, parse_precision, precision_from_dtype
from services.worker.settings import DEFAULT_KV_SAVE_QUEUE_BLOCKS

# --device values; `auto` is resolved by services.worker.platforms.resolve_device.
DEVICES = ("auto", "cpu", "cuda", "npu")
# --cpu-kernels values: native kernels where they build (auto), native or fail, or the pure-torch reference.
CPU_KERNELS = ("auto", "native", "reference")
# --quantization values (layers/quantization.py): int8 rounds the linears' weights to int8 rows; gguf serves a
# .gguf file's own Q4_0/Q4_1/Q8_0 blocks (gguf_weights.py); unset keeps the weights' dtype.
QUANTIZATIONS = ("int8", "gguf")
DEFAULT_BLOCK_SIZE = 16
# --load-format values (vLLM's): auto reads the checkpoint's weights; dummy fills every parameter with small
# random values and needs only config.json, for benchmarking a model's shape without its weights.
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class KVStoreConnection:
    """How every rank reaches the kvstore: --kv-store and the flags beside it, validated on construction."""

    # host:port of the kvstore every rank loads blocks from and saves blocks to.
    address: str
    # Blocks each rank queues for the store before it drops new saves (--kv-save-queue-blocks).
    save_queue_blocks: int = DEFAULT_KV_SAVE_QUEUE_BLOCKS
    # TLS and internal token of every rank's kvstore channel (None: insecure).
    security: Security | None = None
    # Saves handed over in a shared-memory outbox where the store can read it (--kv-store-shared-memory).
    shared_memory: bool = True

    def __post_init__(self) -> None:
        if not self.address.strip():
            raise ValueError("--kv-store must be host:port of the kvstore (leave it unset for none)")
        if self.save_queue_blocks < 1:
            raise ValueError(f"--kv-save-queue-blocks must be >= 1, got {self.save_queue_blocks}")


@dataclass(frozen=True)
class EngineConfig:
    """What the worker loads and how much it may batch; validated on construction."""

    model_path: str
    # The name the worker reports for its model (--served-model-name); None: the model directory's name.
    served_model_name: str | None = None
    # vLLM-style shorthand for one dtype everywhere; --precision says more and wins when given.
    dtype: str | None = None
    precision: str | None = None
    device: str = "cpu"
    # None: the platform's required block size, else DEFAULT_BLOCK_SIZE.
    block_size: int | None = None
    tensor_parallel_size: int = 1
    # Pipeline stages (each a TP group of tensor_parallel_size ranks), and their layer counts (None: balanced).
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    # With stages: each works on a different step at once (micro-batches), else one step runs at a time.
    pipeline_micro_batching: bool = True
    # KV budget on the CPU (bytes); on devices the budget comes from gpu_memory_utilization.
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    # None: the platform's (Platform.default_max_num_batched_tokens).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    seed: int = 0
    # CPU op table: auto (native kernels where they build), native, or reference (pure torch).
    cpu_kernels: str = "auto"
    # Weight-only quantisation of the linears and LM head (None: none).
    quantization: str | None = None
    # The kvstore every rank loads blocks from and saves blocks to (None: no kvstore).
    kv_store: KVStoreConnection | None = None
    # Where the weights come from (LOAD_FORMATS): the checkpoint, or random values of the config's shapes.
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("--model must name a Hugging Face directory or a .gguf file")
        if self.dtype is not None:
            precision_from_dtype(self.dtype)
        if self.precision is not None:
            # Checked with a stand-in default: the real one depends on the platform picked later.
            parse_precision(self.precision, platform_default="fp32-fp32-fp32")
        if self.dtype is not None and self.precision not in (None, "auto"):
            raise ValueError("give either --dtype or --precision, not both (--precision says more)")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"--cpu-kernels must be one of {list(CPU_KERNELS)}, got {self.cpu_kernels!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"--quantization must be one of {list(QUANTIZATIONS)} (or unset), got {self.quantization!r}"
            )
        if self.quantization == "gguf" and not self.model_path.endswith(".gguf"):
            raise ValueError(
                f"--quantization gguf serves a .gguf file's quantised blocks, but --model {self.model_path} is not a "
                ".gguf file; pass one, or use --quantization int8 for a Hugging Face directory"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {list(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.load_format == "dummy" and self.quantization == "gguf":
            raise ValueError(
                "--load-format dummy makes random weights, but --quantization gguf serves a file's own blocks; drop "
                "one of them"
            )
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pp_layer_partition is not None and len(self.pp_layer_partition) != self.pipeline_parallel_size:
            raise ValueError(
                f"--pp-layer-partition names {len(self.pp_layer_partition)} stages but --pipeline-parallel-size is "
                f"{self.pipeline_parallel_size}; give one layer count per stage"
            )
        if self.pipeline_parallel_size > 1 and self.kv_store is not None:
            # The store's block layout splits a block by KV heads only; a stage's layers are not one byte range.
            raise ValueError(
                "--kv-store does not work with --pipeline-parallel-size > 1 yet (a stage holds only some layers of "
                "each block); leave --kv-store unset or use --pipeline-parallel-size 1"
            )
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"--kv-cache-memory must be > 0 bytes, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")

    def resolve_precision(self, platform_default: str) -> Precision:
        """The precision to run with once the platform (and so what `auto` means) is known."""
        if self.precision not in (None, "auto"):
            return parse_precision(self.precision, platform_default=platform_default)
        if self.dtype is not None:
            return parse_precision(precision_from_dtype(self.dtype), platform_default=platform_default)
        return parse_precision("auto", platform_default=platform_default)

    def resolve_max_num_batched_tokens(self, platform_default: int) -> int:
        """--max-num-batched-tokens, or the platform's step budget when unset."""
        return self.max_num_batched_tokens or platform_default

    def resolve_block_size(self, platform_name: str, required: int | None) -> int:
        """--block-size checked against what the platform's kernels need."""
        if required is None:
            return self.block_size or DEFAULT_BLOCK_SIZE
        if self.block_size not in (None, required):
            raise ValueError(
                f"--block-size {self.block_size} is not supported on {platform_name}: its paged-attention "
                f"kernels need {required}; drop the flag or pass --block-size {required}"
            )
        return required
