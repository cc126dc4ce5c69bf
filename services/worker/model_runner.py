"""ModelRunner: applies each Step to the persistent batch, runs the forward pass and samples."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from services.common.grammar_check import is_constrained
from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.common.speculation import MAX_DRAFT_TOKENS, accepted_length, can_speculate
from services.common.tracing import trace_id_of
from services.worker.attach import StepRejected
from services.worker.distributed import ONE_RANK, SINGLE, DistInit, WorkerGroups, init_groups
from services.worker.engine_config import EngineConfig
from services.worker.gguf_weights import read_matmul_weights
from services.worker.grammar import GrammarCompileError, GrammarEngine, GrammarError
from services.worker.input_batch import CachedRequest, InputBatch
from services.worker.kv_blocks import SliceGeometry, dtype_name
from services.worker.kv_cache import KVCache, bytes_per_block
from services.worker.kv_sizing import DeviceMemory, blocks_for_budget, check_fits_one_sequence, device_kv_budget
from services.worker.kv_transfer import KVTransfer
from services.worker.layers.attention import AttentionMetadata
from services.worker.layers.linear import (
    attach_half_weights,
    attach_quantized,
    pack_linears,
    quantize_matmuls,
    release_quantized_weights,
)
from services.worker.layers.quantization import HalfWeight, Int8Weight, weight_parts
from services.worker.memory_profile import profile_peak_memory
from services.worker.models.llama import HeadSplit, LlamaArch, LlamaForCausalLM, check_tp_size
from services.worker.pipeline_partition import StageLayers, partition_model
from services.worker.platforms import Platform, get_platform
from services.worker.sampler import Sampled, Sampler, SampleRequest
from services.worker.startup_error import StartupError
from services.worker.weights import (
    ModelSource,
    fill_dummy_weights,
    iter_weights,
    kv_format,
    load_hf_config,
    model_identity,
    resolve_model_path,
)

log = structlog.get_logger()
# Sent in place of tokens when rank 0's sampler raised.
SAMPLING_FAILED = -1
# A step with no requests but kvstore loads outstanding is the scheduler polling for them: wait this long
# for this rank's oldest load so that polling does not spin (a load done sooner answers sooner).
EMPTY_STEP_LOAD_WAIT_S = 0.05
# Stands for "not done on this rank" in the vector the ranks take the minimum of (num_loaded is >= 0).
_LOAD_NOT_DONE = -1


def _copy_params(params: sampling_pb2.SamplingParams) -> sampling_pb2.SamplingParams:
    copy = sampling_pb2.SamplingParams()
    copy.CopyFrom(params)
    return copy


@dataclass(frozen=True)
class RankMemory:
    """One tensor-parallel rank's device memory once the model and its KV cache are loaded."""

    rank: int
    weights_bytes: int
    kv_cache_bytes: int
    # Device memory in use (total - free) after loading; 0 on the CPU, where it would be the host's RAM.
    used_bytes: int


@dataclass
class _Scheduled:
    """One request's work in the step being executed."""

    request: CachedRequest
    # Tokens computed in this step, drafts included.
    num_scheduled: int
    # Speculative decoding: tokens guessed to follow the request's known ones, computed after them.
    draft_token_ids: list[int] = field(default_factory=list)

    @functools.cached_property
    def token_ids(self) -> list[int]:
        """The tokens this step reads: the request's known ones, then its drafts (one list, built once)."""
        if not self.draft_token_ids:
            return self.request.token_ids
        return self.request.token_ids + self.draft_token_ids

    @property
    def num_sample_rows(self) -> int:
        """Rows sampled for it: one per draft plus the one after them, when the step reaches its end."""
        done = self.request.num_computed_tokens + self.num_scheduled == len(self.token_ids)
        return 1 + len(self.draft_token_ids) if done else 0


@dataclass
class _InPipeline:
    """A step this rank ran whose tokens rank 0 has not yet announced (pipelined stages only)."""

    # Its requests by id(): none of them may be in another step until it is announced. The objects are held
    # here, so a removed request's id() is not reused by a new one while the step is on the pipeline.
    requests: dict[int, CachedRequest]
    # The rows it samples, per request; the sampling rank also keeps the ids it sampled.
    sample_work: list[tuple[_Scheduled, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class ModelRunner:
    """Owns one rank's weights shard, KV cache and persistent batch; the sampling rank also samples."""

    def __init__(
        self, config: EngineConfig, dist_init: DistInit | None = None, platform: Platform | None = None
    ) -> None:
        self.config = config
        self._dist_init = dist_init
        local_rank = dist_init.local_rank if dist_init is not None else 0
        self.platform = platform or get_platform(config.device, local_rank, config.cpu_kernels)
        # Before anything is allocated on the device (HCCL/NCCL bind to the current device too).
        self.platform.set_device()
        self.device = self.platform.device
        self.device_type: str = self.platform.name
        self.precision = config.resolve_precision(self.platform.default_precision)
        self.block_size: int = config.resolve_block_size(self.platform.name, self.platform.required_block_size)
        self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(
            self.platform.default_max_num_batched_tokens
        )

        dummy = config.load_format == "dummy"
        source = resolve_model_path(config.model_path, need_weights=not dummy)
        if dummy:
            source = dataclasses.replace(source, dummy_seed=config.seed)
        hf_config = load_hf_config(source)
        arch = LlamaArch.from_hf_config(hf_config)
        check_tp_size(arch, config.tensor_parallel_size)
        max_model_len = config.max_model_len or arch.max_position_embeddings
        if max_model_len > arch.max_position_embeddings:
            raise StartupError(
                f"--max-model-len={max_model_len} exceeds the model's max_position_embeddings="
                f"{arch.max_position_embeddings}; lower --max-model-len"
            )
        self.stage = self._stage(arch)
        groups = (
            init_groups(self.platform.dist_backend, dist_init, config.tensor_parallel_size)
            if dist_init
            else WorkerGroups(ONE_RANK, SINGLE)
        )
        # Every rank of the worker (commands, agreement), this rank's tensor-parallel collectives, its stage's hop.
        self.ranks = groups.ranks
        self.tp = groups.tp
        self.pipe = groups.pipe
        # The last stage's first TP rank samples (it alone has the logits' stage), holding the sampler's state
        # and the grammar matchers; rank 0 when the worker has one stage.
        self.sampling_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self.samples = self.ranks.rank == self.sampling_rank
        # Pipelined stages: each stage works on a different step (micro-batch) at once; a step's tokens reach
        # rank 0 from the sampling rank and every other rank with a later command (services/worker/ranks.py).
        self.pipelined = config.pipeline_parallel_size > 1 and config.pipeline_micro_batching
        self._in_pipeline: dict[int, _InPipeline] = {}
        self.max_model_len: int = max_model_len
        self.vocab_size: int = arch.vocab_size
        self.model_name: str = config.served_model_name or source.name
        self.model_identity: str = model_identity(source)
        self.kv_format: str = kv_format(
            source, kv_dtype=str(self.precision.kv_dtype).removeprefix("torch."), block_size=self.block_size
        )
        self.batch = InputBatch()
        # Rank 0 only (it alone logs per request): each held request's trace id, for its lines after it joined.
        self._trace_ids: dict[str, str | None] = {}
        self.sampler = Sampler(config.seed)
        # The sampling rank alone holds grammar matchers; None when the model has no tokenizer.json. Built
        # here (~0.5 s for the token trie), not on the first constrained request: that would stall its whole step.
        self.grammar: GrammarEngine | None = self._grammar_engine(source, arch.vocab_size)
        # Without a kvstore, loads a scheduler sends anyway are answered as done with nothing loaded, in the
        # next result (one that a refused step does not get).
        self._loads_without_store: list[int] = []
        started = time.perf_counter()
        try:
            free_at_start = self.platform.memory_info().free_bytes
            self.model: LlamaForCausalLM = self._load(hf_config, source, max_model_len)
            self.num_blocks: int = self._size_kv_cache(arch, free_at_start)
            self.kv_cache = KVCache.allocate(
                num_blocks=self.num_blocks,
                num_layers=self.stage.num_layers,
                block_size=self.block_size,
                num_kv_heads=self.model.num_kv_heads,
                head_dim=arch.head_dim,
                dtype=self.precision.kv_dtype,
                device=self.device,
                layout=self.platform.ops.kv_layout,
            )
            self.kv_transfer: KVTransfer | None = self._start_kv_transfer(arch)
            # Every rank's memory after loading, gathered once (a collective: all ranks are here).
            self.rank_memory: list[RankMemory] = self._rank_memory()
        except Exception as err:
            if self.platform.is_out_of_memory(err):
                raise StartupError(
                    f"out of {self.device_type} memory while loading the model or its KV cache ({err}); lower "
                    "--gpu-memory-utilization (or --kv-cache-memory on the CPU), --max-num-batched-tokens or "
                    "--max-model-len, or raise --tensor-parallel-size or --pipeline-parallel-size (each rank then "
                    "holds less)"
                ) from err
            raise
        log.info(
            "model_loaded",
            model=self.model_name,
            model_type=arch.model_type,
            precision=self.precision.name,
            # "onednn-float32" under a bf16 precision: GEMMs on fp32 copies of the weights (no native bf16 here).
            matmul_weights=self.matmul_weights,
            device=str(self.device),
            tp_rank=self.tp.rank,
            tp_size=self.tp.size,
            pp_stage=self.stage.index,
            layers=f"{self.stage.start}-{self.stage.end - 1}",
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            kv_store=None if config.kv_store is None else config.kv_store.address,
            load_seconds=round(time.perf_counter() - started, 3),
        )

    @property
    def num_requests(self) -> int:
        """Requests in the persistent batch."""
        return len(self.batch)

    @property
    def num_blocks_held(self) -> int:
        """Distinct KV blocks the batch's requests hold."""
        return self.batch.num_blocks_held

    def _stage(self, arch: LlamaArch) -> StageLayers:
        """The decoder layers this rank's pipeline stage runs (all of them without pipeline parallelism)."""
        pp, tp = self.config.pipeline_parallel_size, self.config.tensor_parallel_size
        rank = 0 if self._dist_init is None else self._dist_init.rank
        try:
            stages = partition_model(
                arch.num_layers,
                pp,
                layer_params=arch.layer_params,
                vocab_params=arch.embedding_params,
                override=self.config.pp_layer_partition,
            )
        except ValueError as err:
            raise StartupError(str(err)) from err
        return stages[rank // tp]

    def _weights_bytes(self) -> int:
        # The oneDNN-packed and quantised copies are not parameters, and where they are the only copy (packed
        # in the compute dtype) the plain weights are empty: counted here, or a packed model reads as nearly
        # free. Each plain tensor once: a half-weight kernel reads the very tensor the embedding looks up.
        matmuls = self.model.matmul_modules()
        # oneDNN's packed weights are opaque (no storage to share), counted by size.
        packed = sum(m.packed.numel() * m.packed.element_size() for m in matmuls if m.packed is not None)
        tensors: list[torch.Tensor] = list(self.model.parameters())
        for m in matmuls:
            if m.quantized is not None:
                tensors.extend(weight_parts(m.quantized.weight).values())
        plain = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if t.numel() > 0}
        return packed + sum(plain.values())

    def _rank_memory(self) -> list[RankMemory]:
        weights = self._weights_bytes()
        # What the device's allocator and everything else on it hold; on the CPU, "free" is the host's.
        used = 0
        if self.platform.name != "cpu":
            info = self.platform.memory_info()
            used = info.total_bytes - info.free_bytes
        rows = self.ranks.gather_ints([weights, self.kv_cache.nbytes, used])
        return [RankMemory(rank, *row) for rank, row in enumerate(rows)]

    def _grammar_engine(self, source: ModelSource, vocab_size: int) -> GrammarEngine | None:
        if not self.samples or not (source.directory / "tokenizer.json").is_file():
            return None
        return GrammarEngine(source.directory, vocab_size)

    def _match_grammar(self, cached: CachedRequest, output_token_ids: Sequence[int], traceparent: str) -> None:
        """Give a constrained request its matcher, replaying the tokens it already has (after a move or a
        preemption); a grammar that fails marks this request alone."""
        if not self.samples or not is_constrained(cached.sampling):
            return
        if self.grammar is None:
            cached.failure = ("sampling.grammar", "this worker's model has no tokenizer.json for structured outputs")
        else:
            try:
                cached.grammar = self.grammar.matcher(cached.sampling.grammar, output_token_ids)
            except GrammarCompileError as err:
                cached.failure = (err.field, err.description)
            except GrammarError as err:
                cached.failure = ("", f"the request's tokens do not satisfy its grammar: {err}")
        if cached.failure is not None:
            self._grammar_failed(cached, trace_id_of(traceparent))

    @staticmethod
    def _grammar_failed(cached: CachedRequest, trace_id: str | None) -> None:
        """The request ends with this error at its next sample (the scheduler fails it alone)."""
        assert cached.failure is not None
        field, error = cached.failure
        log.info("grammar_failed", request_id=cached.request_id, trace_id=trace_id, field=field or None, error=error)

    def _start_kv_transfer(self, arch: LlamaArch) -> KVTransfer | None:
        """This rank's loader and saver of its KV heads, when --kv-store is set."""
        store = self.config.kv_store
        if store is None:
            return None
        try:
            dtype_name(self.precision.kv_dtype)
        except ValueError as err:
            raise StartupError(f"--kv-store: {err}; pick another --precision or leave --kv-store unset") from err
        split = HeadSplit.for_rank(arch, self.tp)
        geometry = SliceGeometry(
            num_kv_heads=arch.num_kv_heads,
            num_layers=self.stage.num_layers,
            block_size=self.block_size,
            head_dim=arch.head_dim,
            dtype=self.precision.kv_dtype,
            head_start=split.kv_head_start,
            head_count=split.num_kv_heads,
        )
        return KVTransfer(
            store.address,
            self.kv_format,
            geometry,
            self.kv_cache.layers,
            self.platform.ops.kv_layout,
            self.platform,
            save_queue_blocks=store.save_queue_blocks,
            rank=self.ranks.rank,
            security=store.security,
            shared_memory=store.shared_memory,
        )

    def _load(self, hf_config: Any, source: ModelSource, max_model_len: int) -> LlamaForCausalLM:
        """Build this rank's shard on the meta device, materialise it in the weights dtype, load it."""
        with torch.device("meta"):
            model = LlamaForCausalLM(hf_config, self.platform.ops, max_model_len, self.precision, self.tp, self.stage)
        model = model.to(self.precision.weights).to_empty(device=self.device)
        model.to_device(self.device)
        if source.dummy_seed is not None:
            fill_dummy_weights(model, source.dummy_seed)
        else:
            model.load_weights(iter_weights(source))
        quantization = self.config.quantization
        if quantization is not None:
            # Before packing, which may drop the plain weights the quantised copies are made from.
            max_rows = self.platform.quantized_max_rows(self.precision.compute)
            if max_rows < 1:
                raise StartupError(
                    f"--quantization {quantization} has no quantised kernels on {self.platform.name} here (they run on "
                    "the CPU with the native kernels: leave --cpu-kernels at auto or native); drop --quantization"
                )
            if quantization == "int8":
                # Packed into tiles where the op table's kernel multiplies on them, which may win more rows.
                ops, platform, compute = self.platform.ops, self.platform, self.precision.compute
                quantize_matmuls(
                    model.matmul_modules(),
                    ops.quantized_kernel,
                    lambda weight: platform.quantized_max_rows(compute, tiled=weight.tiled),
                    lambda weight: ops.int8_weight(weight, compute),
                )
            else:
                self._attach_gguf_blocks(model, hf_config, source, max_rows)
        elif self.platform.half_max_rows(self.precision.compute) > 0:
            # Small steps read the bf16/fp16 weights (packed into tiles where the kernel multiplies on them), not
            # the fp32 copies packed below, nor through the native GEMM that reads them slowly at few rows.
            ops, platform, compute = self.platform.ops, self.platform, self.precision.compute
            attach_half_weights(
                model.matmul_modules(),
                compute,
                ops.half_weight,
                ops.quantized_kernel,
                lambda weight: platform.half_max_rows(compute, tiled=weight.tiled),
            )
        pack_dtype = self.platform.matmul_pack_dtype(self.precision.compute)
        if pack_dtype is not None:
            # Packed for the decode batch, the steps that run most often.
            batch_hint = min(self.config.max_num_seqs, 64)
            pack_linears(model.matmul_modules(), self.precision.compute, pack_dtype, batch_hint)
        release_quantized_weights(model.matmul_modules(), self.precision.compute)
        # The weights are final: every step runs the layers' bound forms from here on.
        model.bind()
        return model.eval()

    def _attach_gguf_blocks(self, model: LlamaForCausalLM, hf_config: Any, source: ModelSource, max_rows: int) -> None:
        """--quantization gguf: the linears and LM head take the file's own Q4_0/Q4_1/Q8_0 blocks for small steps."""
        assert source.gguf_file is not None  # EngineConfig requires a .gguf model for it
        found = read_matmul_weights(
            source.directory / source.gguf_file,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        )
        try:
            model.load_quantized_weights(found.quantized.items())
            attached = attach_quantized(model.matmul_modules(), self.platform.ops.quantized_kernel, max_rows)
        except ValueError as err:
            raise StartupError(f"--quantization gguf: {err}; drop --quantization to serve it dequantised") from err
        log.info(
            "gguf_blocks_attached",
            quantized_matmuls=attached,
            matmuls=len(model.matmul_modules()),
            # Formats with no kernel here (K-quants, F16, ...) run on the weights transformers dequantised.
            dense=sorted(set(found.dense.values())),
        )

    @property
    def matmul_weights(self) -> str:
        """How the linears hold their matmul weights: "plain", or packed for oneDNN ("onednn-<dtype>"), after
        "int8+" (or "gguf+") when small steps run on quantised copies, "half+" when on the half weights, with
        "-tiles" ("int8-tiles+", "half-tiles+") where the op table packed those into tiles."""
        pack_dtype = self.platform.matmul_pack_dtype(self.precision.compute)
        layout = "plain" if pack_dtype is None else f"onednn-{str(pack_dtype).removeprefix('torch.')}"
        small = self.config.quantization
        if small is None and self.platform.half_max_rows(self.precision.compute) > 0:
            small = "half"
        if small is None:
            return layout
        weights = [m.quantized.weight for m in self.model.matmul_modules() if m.quantized is not None]
        tiled = any(isinstance(w, Int8Weight | HalfWeight) and w.tiled for w in weights)
        return f"{small}{'-tiles' if tiled else ''}+{layout}"

    def _size_kv_cache(self, arch: LlamaArch, free_at_start: int) -> int:
        """Profile the largest step, then turn the memory budget into a block count all ranks share."""
        per_block = bytes_per_block(
            num_layers=self.stage.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=arch.head_dim,
            dtype=self.precision.kv_dtype,
        )
        weights_bytes = self._weights_bytes()
        peak = profile_peak_memory(self, arch)
        if self.platform.name == "cpu":
            budget = self.config.kv_cache_memory_bytes
        else:
            info = self.platform.memory_info()
            memory = DeviceMemory(info.total_bytes, free_at_start, weights_bytes, peak)
            budget = device_kv_budget(memory, self.config.gpu_memory_utilization)
        num_blocks = self.ranks.min_int(blocks_for_budget(budget, per_block))
        check_fits_one_sequence(
            num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            bytes_per_block=per_block,
            device=self.device_type,
        )
        log.info(
            "kv_cache_sized",
            budget_gib=round(budget / 2**30, 3),
            weights_gib=round(weights_bytes / 2**30, 3),
            activation_peak_gib=round(peak / 2**30, 3),
            bytes_per_block=per_block,
            num_blocks=num_blocks,
        )
        return num_blocks

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        """Apply the step to the persistent batch, compute its tokens and sample finished rows."""
        started = time.perf_counter()
        kv = self.kv_transfer
        # Started first, before the step is checked: the scheduler holds these loads' requests back until
        # they are reported, which a later result does even when this step is refused.
        if kv is not None:
            kv.submit_loads(step.kv_loads)
        else:
            self._loads_without_store.extend(load.load_id for load in step.kv_loads)
        for request_id in step.removed_request_ids:
            removed = self.batch.remove(request_id)
            if removed is not None and self.ranks.is_driver:
                self._left(removed, "removed")
        work = self._apply(step)
        if self.pipelined and work:
            self._in_pipeline[step.step_id] = _InPipeline({id(item.request): item.request for item in work})
        result = worker_pb2.StepResult(step_id=step.step_id)
        if work:
            self._run(work, result, step.step_id)
        self.platform.synchronize()
        if kv is not None and step.kv_saves:
            # Copied now: the next step may write other tokens into these blocks.
            kv.save(step.kv_saves)
        if kv is not None and step.kv_saves_flush:
            kv.flush_saves()
        result.execute_seconds = time.perf_counter() - started
        if kv is not None:
            if not work and kv.num_unreported:
                kv.wait_oldest(EMPTY_STEP_LOAD_WAIT_S)
            self._report_kv(kv, result)
        else:
            result.kv_loads_done.extend(worker_pb2.KVLoadDone(load_id=i) for i in self._loads_without_store)
            self._loads_without_store.clear()
            result.kv_saves_dropped = len(step.kv_saves)
        if self.pipelined and self.samples:
            # Every step that passed its checks is answered, in order, so rank 0 pairs answers with steps.
            record = self._in_pipeline.get(step.step_id)
            answer = worker_pb2.StepResult(step_id=step.step_id, sampled=result.sampled)
            self.pipe.send_result(record.token_ids if record else [], answer.SerializeToString())
        return result

    def apply_finished(self, finished: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Pipelined stages: rank 0 announces these steps answered, with every row's sampled id; each rank but
        the sampling one (which appended them when it sampled) appends them now, so every persistent batch
        stays the same, and their requests may be scheduled again."""
        for step_id, token_ids in finished:
            record = self._in_pipeline.pop(step_id, None)
            if record is None or self.samples:
                continue
            if SAMPLING_FAILED in token_ids:
                raise RuntimeError(f"rank {self.sampling_rank} failed to sample step {step_id}")
            self._apply_sampled(record.sample_work, list(token_ids), [None] * len(token_ids), None)

    def _report_kv(self, kv: KVTransfer, result: worker_pb2.StepResult) -> None:
        """Loads done on every rank since the last result (oldest first), and saves dropped since then.

        Every rank submitted the same loads in the same order, so position i of each rank's FIFO is the same
        load; the ranks agree, in one all-reduce, on how many leading loads are done everywhere and on each
        one's num_loaded (the fewest blocks any rank wrote). Dropped saves are the most any rank dropped.
        """
        finished = kv.finished()
        dropped = kv.take_dropped()
        if self.ranks.size == 1:
            reported = finished
        else:
            owed = kv.num_unreported
            local = [n for _, n in finished] + [_LOAD_NOT_DONE] * (owed - len(finished))
            agreed = self.ranks.min_ints([*local, -dropped])
            dropped = -agreed[-1]
            count = next((i for i, n in enumerate(agreed[:owed]) if n == _LOAD_NOT_DONE), owed)
            reported = [(load_id, agreed[i]) for i, (load_id, _) in enumerate(finished[:count])]
        kv.pop_finished(len(reported))
        result.kv_loads_done.extend(worker_pb2.KVLoadDone(load_id=i, num_loaded=n) for i, n in reported)
        result.kv_saves_dropped = dropped

    def _joined(self, cached: CachedRequest, traceparent: str) -> None:
        """Rank 0: a request joined the persistent batch (new, or back after a preemption or a move)."""
        trace_id = self._trace_ids[cached.request_id] = trace_id_of(traceparent)
        log.info(
            "request_joined",
            request_id=cached.request_id,
            trace_id=trace_id,
            prompt_tokens=cached.num_prompt_tokens,
            # Prefix-cache hits (and blocks loaded from the kvstore): what this worker does not compute.
            num_computed_tokens=cached.num_computed_tokens,
            output_tokens=cached.num_output_tokens,
        )

    def _left(self, cached: CachedRequest, why: str) -> None:
        """Rank 0: a request left the persistent batch (finished, aborted or preempted; or the stream reset)."""
        log.info(
            "request_left",
            request_id=cached.request_id,
            trace_id=self._trace_ids.pop(cached.request_id, None),
            output_tokens=cached.num_output_tokens,
            why=why,
        )

    def reset(self) -> None:
        """Forget every request and kvstore load (a new scheduler stream starts from nothing)."""
        if self.ranks.is_driver:
            for request_id in self.batch.request_ids():
                removed = self.batch.remove(request_id)
                if removed is not None:
                    self._left(removed, "reset")
            self._trace_ids.clear()
        self.batch = InputBatch()
        self._in_pipeline.clear()
        self._loads_without_store.clear()
        if self.kv_transfer is not None:
            # Returns once no load writes into the cache any more: the new stream reuses those blocks.
            self.kv_transfer.reset()

    def close(self) -> None:
        """Release the kvstore threads, the model, the KV cache and the batch."""
        if self.kv_transfer is not None:
            self.kv_transfer.close()
            self.kv_transfer = None
        self.batch = InputBatch()
        self.kv_cache.layers.clear()
        del self.model

    def _apply(self, step: worker_pb2.Step) -> list[_Scheduled]:
        """Validate the whole step, then add new requests and extend block tables; a step refused because of
        one request raises StepRejected naming it (and its trace id)."""
        try:
            return self._apply_checked(step)
        except StepRejected as err:
            # Only on this rare path: the id's trace, from the step if it is new, else from when it joined.
            traceparent = next((r.traceparent for r in step.new_requests if r.request_id == err.request_id), "")
            err.trace_id = trace_id_of(traceparent) or self._trace_ids.get(err.request_id)
            raise

    def _apply_checked(self, step: worker_pb2.Step) -> list[_Scheduled]:
        seen: set[str] = set()
        new: list[_Scheduled] = []
        for req in step.new_requests:
            self._check_id(req.request_id, seen)
            if req.request_id in self.batch:
                raise StepRejected(req.request_id, f"new request {req.request_id!r} is already in the worker's batch")
            if not req.prompt_token_ids:
                raise StepRejected(req.request_id, f"request {req.request_id!r} has an empty prompt")
            tokens = list(req.prompt_token_ids) + list(req.output_token_ids)
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise StepRejected(
                    req.request_id, f"request {req.request_id!r} has token id {bad[0]} outside [0, {self.vocab_size})"
                )
            blocks = list(req.block_ids)
            self._check_work(req.request_id, req.num_computed_tokens, req.num_scheduled_tokens, len(tokens), blocks)
            cached = CachedRequest(
                request_id=req.request_id,
                token_ids=tokens,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_computed_tokens=req.num_computed_tokens,
                block_ids=blocks,
                # Copied: the caller may reuse or mutate the Step message.
                sampling=_copy_params(req.sampling),
                eos_token_ids=tuple(req.eos_token_ids),
            )
            self._match_grammar(cached, req.output_token_ids, req.traceparent)
            new.append(_Scheduled(cached, req.num_scheduled_tokens))
        running: list[tuple[_Scheduled, list[int]]] = []
        for sched in step.scheduled:
            self._check_id(sched.request_id, seen)
            try:
                cached = self.batch.get(sched.request_id)
            except ValueError as err:
                raise StepRejected(sched.request_id, str(err)) from None
            # Before any check of its progress: ranks of different stages have seen different amounts of it.
            self._check_not_in_pipeline(cached)
            if sched.num_computed_tokens != cached.num_computed_tokens:
                raise StepRejected(
                    sched.request_id,
                    f"request {sched.request_id!r}: scheduler says num_computed_tokens="
                    f"{sched.num_computed_tokens}, worker has {cached.num_computed_tokens}",
                )
            blocks = cached.block_ids + list(sched.new_block_ids)
            drafts = self._check_drafts(sched, cached)
            self._check_work(
                sched.request_id,
                cached.num_computed_tokens,
                sched.num_scheduled_tokens,
                cached.num_tokens + len(drafts),
                blocks,
            )
            running.append((_Scheduled(cached, sched.num_scheduled_tokens, drafts), list(sched.new_block_ids)))
        work = new + [item for item, _ in running]
        total = sum(item.num_scheduled for item in work)
        if total > self.max_num_batched_tokens:
            raise ValueError(f"step schedules {total} tokens > --max-num-batched-tokens")
        if len(work) > self.config.max_num_seqs:
            raise ValueError(f"step schedules {len(work)} requests > --max-num-seqs")
        for item in new:
            self.batch.add(item.request)
        if self.ranks.is_driver:
            # One line per request that joins (never per step or token); `new` follows step.new_requests.
            for item, req in zip(new, step.new_requests, strict=True):
                self._joined(item.request, req.traceparent)
        for item, new_blocks in running:
            self.batch.extend_blocks(item.request, new_blocks)
        return work

    def _check_drafts(self, sched: worker_pb2.ScheduledRequest, cached: CachedRequest) -> list[int]:
        """A scheduled request's draft tokens, once they are within the rules of services/common/speculation.py."""
        drafts = list(sched.draft_token_ids)
        if not drafts:
            return drafts
        rid = sched.request_id
        if len(drafts) > MAX_DRAFT_TOKENS:
            raise StepRejected(rid, f"request {rid!r}: {len(drafts)} draft tokens, at most {MAX_DRAFT_TOKENS}")
        if not can_speculate(cached.sampling):
            raise StepRejected(rid, f"request {rid!r}: draft tokens for a request that is not greedy or has a grammar")
        bad = [t for t in drafts if not 0 <= t < self.vocab_size]
        if bad:
            raise StepRejected(rid, f"request {rid!r}: draft token id {bad[0]} outside [0, {self.vocab_size})")
        if cached.num_computed_tokens + sched.num_scheduled_tokens != cached.num_tokens + len(drafts):
            raise StepRejected(
                rid,
                f"request {rid!r}: draft tokens must follow all of its {cached.num_tokens} known tokens in one step",
            )
        return drafts

    def _check_not_in_pipeline(self, cached: CachedRequest) -> None:
        """A pipelined worker runs each request in one step at a time: its next step needs the token the last
        stage samples for it (every rank decides this alike, from rank 0's announcements)."""
        for step_id, record in self._in_pipeline.items():
            if id(cached) in record.requests:
                rid = cached.request_id
                raise StepRejected(
                    rid, f"request {rid!r} is still in step {step_id} on the pipeline; schedule it once that answers"
                )

    @staticmethod
    def _check_id(request_id: str, seen: set[str]) -> None:
        if not request_id:
            raise ValueError("request_id must not be empty")
        if request_id in seen:
            raise StepRejected(request_id, f"request {request_id!r} appears twice in one step")
        seen.add(request_id)

    def _check_work(
        self, request_id: str, num_computed: int, num_scheduled: int, num_tokens: int, blocks: list[int]
    ) -> None:
        """The work fits the request's tokens (drafts included), --max-model-len and its blocks."""
        if num_scheduled < 1:
            raise StepRejected(request_id, f"request {request_id!r}: num_scheduled_tokens must be >= 1")
        end = num_computed + num_scheduled
        if end > num_tokens:
            raise StepRejected(
                request_id, f"request {request_id!r}: computing up to token {end} but it has only {num_tokens} tokens"
            )
        if end > self.max_model_len:
            raise StepRejected(
                request_id, f"request {request_id!r}: {end} tokens exceed --max-model-len={self.max_model_len}"
            )
        if len(blocks) * self.block_size < end:
            raise StepRejected(
                request_id,
                f"request {request_id!r}: {len(blocks)} blocks of {self.block_size} cannot hold {end} tokens",
            )
        bad = [b for b in blocks if b >= self.num_blocks]
        if bad:
            raise StepRejected(request_id, f"request {request_id!r}: block id {bad[0]} >= num_blocks={self.num_blocks}")

    def _run(self, work: list[_Scheduled], result: worker_pb2.StepResult, step_id: int) -> None:
        """Forward the flat batch, sample the rows that reached their end (rank 0), advance the batch.

        A request with drafts has a row sampled at each draft position (the history up to it as its own): the
        drafts those samples confirm are kept with the sample after the last one, and the positions past them
        are forgotten (their KV slots are written again by a later step)."""
        spans = [(item.token_ids, item.request.block_ids, item.request.num_computed_tokens, item.num_scheduled)
                 for item in work]  # fmt: skip
        num_rows = [item.num_sample_rows for item in work]
        sample_work = [(item, n) for item, n in zip(work, num_rows, strict=True) if n]
        sample_rows: list[int] = []
        for end, n in zip(itertools.accumulate(item.num_scheduled for item in work), num_rows, strict=True):
            sample_rows.extend(range(end - n, end))
        logits = self.forward(spans, sample_rows)
        for item in work:
            item.request.num_computed_tokens += item.num_scheduled
        if not sample_rows:
            return
        if self.pipelined:
            record = self._in_pipeline[step_id]
            record.sample_work = sample_work
            if self.samples:
                assert logits is not None
                record.token_ids, sampled = self._sample(logits, sample_work, len(sample_rows))
                self._apply_sampled(sample_work, record.token_ids, sampled, result)
            # The other ranks append the tokens when rank 0 announces them (apply_finished).
            return
        token_ids_here: list[int] | None = None
        extras: list[Sampled | None] = [None] * len(sample_rows)
        if self.samples:
            assert logits is not None
            token_ids_here, extras = self._sample(logits, sample_work, len(sample_rows))
        # Every rank appends the same tokens so their persistent batches stay identical.
        token_ids = self.ranks.broadcast_ints(token_ids_here, len(sample_rows), self.sampling_rank)
        if SAMPLING_FAILED in token_ids:
            raise RuntimeError(f"rank {self.sampling_rank} failed to sample this step")
        sampled_tokens = result if self.samples else worker_pb2.StepResult()
        self._apply_sampled(sample_work, token_ids, extras, sampled_tokens)
        if self.sampling_rank != 0:
            self._pass_sampled_to_driver(sampled_tokens, result)

    def _sample(
        self, logits: torch.Tensor, sample_work: list[tuple[_Scheduled, int]], num_rows: int
    ) -> tuple[list[int], list[Sampled | None]]:
        """The sampling rank: every row's token (grammar masks applied, matchers advanced) and its extras."""
        rows = [item.request for item, n in sample_work for _ in range(n)]
        requests = [
            SampleRequest(item.request.sampling_options, item.request.num_output_tokens + j, item.token_ids,
                          item.request.num_prompt_tokens)
            for item, n in sample_work
            for j in range(n)
        ]  # fmt: skip
        try:
            # A request whose grammar failed has no matcher (failure set instead): sampled unmasked, dropped.
            constrained = self.grammar is not None and any(r.grammar is not None for r in rows)
            allowed = self._allowed(rows) if constrained else None
            sampled = self.sampler.sample(logits, requests, allowed)
        except Exception:
            # The other ranks wait for tokens: tell them this step failed rather than leave them hanging.
            failed = [SAMPLING_FAILED] * num_rows
            if self.pipelined:
                self.pipe.send_result(failed)
            else:
                self.ranks.broadcast_ints(failed, num_rows, self.sampling_rank)
            raise
        token_ids = [s.token_id for s in sampled]
        if constrained:
            # Constrained requests have no drafts: one row each.
            self._advance_grammars(rows, token_ids)
        return token_ids, list(sampled)

    def _apply_sampled(
        self,
        sample_work: list[tuple[_Scheduled, int]],
        token_ids: list[int],
        extras: Sequence[Sampled | None],
        answer: worker_pb2.StepResult | None,
    ) -> None:
        """Append each request's sampled tokens (the drafts they confirm, then one more) to the batch, and to
        the answer when given (the sampling rank's: only it knows logprobs and failures)."""
        first = 0
        for item, n in sample_work:
            row_tokens, row_extras = token_ids[first : first + n], extras[first : first + n]
            first += n
            kept = accepted_length(item.draft_token_ids, row_tokens)
            request = item.request
            request.token_ids.extend(row_tokens[:kept])
            if item.draft_token_ids:
                # KV holds the known tokens and the drafts kept; the last token is computed by the next step.
                request.num_computed_tokens = request.num_tokens - 1
            if answer is not None:
                for token_id, extra in zip(row_tokens[:kept], row_extras[:kept], strict=True):
                    answer.sampled.append(self._sampled_token(request, token_id, extra))

    def _pass_sampled_to_driver(self, sampled: worker_pb2.StepResult, result: worker_pb2.StepResult) -> None:
        """The sampling rank (last stage) sends rank 0 what it reports upstream: each token with its logprobs
        and any request's failure, which only the sampling rank knows."""
        payload = sampled.SerializeToString() if self.samples else None
        (length,) = self.ranks.broadcast_ints([len(payload)] if payload is not None else None, 1, self.sampling_rank)
        payload = self.ranks.broadcast_bytes(payload, length, self.sampling_rank)
        if self.ranks.is_driver:
            result.sampled.extend(worker_pb2.StepResult.FromString(payload).sampled)

    @staticmethod
    def _sampled_token(request: CachedRequest, token_id: int, extra: Sampled | None) -> worker_pb2.SampledToken:
        token = worker_pb2.SampledToken(request_id=request.request_id, token_id=token_id)
        if request.failure is not None:
            field_name, message = request.failure
            token.failure.field, token.failure.message = field_name, message
        if extra is not None and extra.logprob is not None:
            token.logprob = extra.logprob
            if extra.top_token_ids:
                token.top_logprobs.token_ids.extend(extra.top_token_ids)
                token.top_logprobs.logprobs.extend(extra.top_logprobs)
        return token

    def _allowed(self, rows: Sequence[CachedRequest]) -> torch.Tensor | None:
        """The grammar masks of the rows being sampled (None when none is constrained)."""
        assert self.grammar is not None
        return self.grammar.fill_allowed([r.grammar for r in rows])

    def _advance_grammars(self, rows: Sequence[CachedRequest], token_ids: Sequence[int]) -> None:
        for request, token_id in zip(rows, token_ids, strict=True):
            if request.grammar is None:
                continue
            try:
                request.grammar.accept(token_id)
            except GrammarError as err:
                # Only if a mask was not applied; the request fails alone, the step goes on.
                request.failure = ("", f"the sampled token broke the grammar: {err}")
                request.grammar = None
                self._grammar_failed(request, self._trace_ids.get(request.request_id))

    def _receive_activations(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden states (compute dtype) and residual (accumulation dtype) for num_tokens."""
        shape = (num_tokens, self.model.arch.hidden_size)
        hidden = torch.empty(shape, dtype=self.precision.compute, device=self.device)
        residual = torch.empty(shape, dtype=self.precision.accum, device=self.device)
        self.pipe.recv_prev([hidden, residual])
        return hidden, residual

    def forward(
        self,
        spans: list[tuple[list[int], list[int], int, int]],
        sample_rows: list[int],
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor | None:
        """Run sequences given as (token_ids, block_ids, num_computed, num_scheduled); logits of sample_rows."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        bs = self.block_size
        for token_ids, block_ids, start, count in spans:
            end = start + count
            input_ids.extend(token_ids[start:end])
            span = range(start, end)
            positions.extend(span)
            slots.extend(block_ids[p // bs] * bs + p % bs for p in span)
            query_start.append(query_start[-1] + count)
            seq_lens.append(end)
        # Only the blocks up to each sequence's end are read; padding with block 0 is masked out.
        needed = [-(-n // bs) for n in seq_lens]
        width = max(needed)
        block_tables = torch.tensor(
            [blocks[:n] + [0] * (width - n) for (_, blocks, _, _), n in zip(spans, needed, strict=True)],
            dtype=torch.int64,
        )
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=block_tables.to(device),
        )
        backend = self.platform.matmul_backend
        with torch.inference_mode():
            carried = None if self.stage.is_first else self._receive_activations(len(input_ids))
            with backend(len(input_ids)):
                hidden, residual = self.model(
                    torch.tensor(input_ids, dtype=torch.int64, device=device),
                    torch.tensor(positions, dtype=torch.int64, device=device),
                    self.kv_cache.layers if kv_layers is None else kv_layers,
                    meta,
                    carried,
                )
            if residual is not None:
                # Only the hidden states and residual of the step's tokens travel; the next stage builds the
                # same metadata from the same step.
                self.pipe.send_next([hidden.to(self.precision.compute), residual.to(self.precision.accum)])
                return None
            if not sample_rows:
                return None
            with backend(len(sample_rows)):
                return self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)])
