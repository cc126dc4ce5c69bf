"""ModelRunner: applies each Step to the persistent batch, runs the forward pass and samples."""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch

from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.worker.engine_config import EngineConfig
from services.worker.input_batch import CachedRequest, InputBatch
from services.worker.kv_cache import KVCache, num_blocks_for_budget
from services.worker.layers.attention import AttentionMetadata
from services.worker.models.llama import LlamaArch, LlamaForCausalLM
from services.worker.platforms import get_platform
from services.worker.sampler import Sampler, SampleRequest
from services.worker.weights import (
    iter_weights,
    load_hf_config,
    model_fingerprint,
    resolve_model_path,
)

log = structlog.get_logger()


def _copy_params(params: sampling_pb2.SamplingParams) -> sampling_pb2.SamplingParams:
    copy = sampling_pb2.SamplingParams()
    copy.CopyFrom(params)
    return copy


@dataclass
class _Scheduled:
    """One request's work in the step being executed."""

    request: CachedRequest
    num_scheduled: int


class ModelRunner:
    """Owns the weights, the KV cache and the persistent batch of one (TP size 1) worker."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = get_platform(config.device)
        self.device = self.platform.device
        self.device_type: str = self.platform.name
        self.dtype = config.torch_dtype

        source = resolve_model_path(config.model_path)
        hf_config = load_hf_config(source)
        arch = LlamaArch.from_hf_config(hf_config)
        max_model_len = config.max_model_len or arch.max_position_embeddings
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"--max-model-len={max_model_len} exceeds the model's max_position_embeddings="
                f"{arch.max_position_embeddings}; lower --max-model-len"
            )
        self.max_model_len: int = max_model_len
        self.block_size: int = config.block_size
        self.vocab_size: int = arch.vocab_size
        self.model_name: str = source.name
        self.fingerprint: str = model_fingerprint(source, kv_dtype=config.dtype, block_size=config.block_size)
        self.num_blocks: int = num_blocks_for_budget(
            config.kv_cache_memory_bytes,
            num_layers=arch.num_layers,
            block_size=config.block_size,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            dtype=self.dtype,
            max_model_len=max_model_len,
        )

        started = time.perf_counter()
        # Build on the meta device so parameters are allocated once, directly in the target dtype.
        with torch.device("meta"):
            model = LlamaForCausalLM(hf_config, self.platform.ops, max_model_len)
        model = model.to(self.dtype).to_empty(device=self.device)
        model.to_device(self.device)
        model.load_weights(iter_weights(source))
        self.model: LlamaForCausalLM = model.eval()
        self.kv_cache = KVCache.allocate(
            num_blocks=self.num_blocks,
            num_layers=arch.num_layers,
            block_size=config.block_size,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.batch = InputBatch()
        self.sampler = Sampler(config.seed)
        log.info(
            "model_loaded",
            model=self.model_name,
            model_type=arch.model_type,
            dtype=config.dtype,
            device=self.device_type,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            load_seconds=round(time.perf_counter() - started, 3),
        )

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        """Apply the step to the persistent batch, compute its tokens and sample finished rows."""
        started = time.perf_counter()
        for request_id in step.removed_request_ids:
            self.batch.remove(request_id)
        work = self._apply(step)
        result = worker_pb2.StepResult(step_id=step.step_id)
        if work:
            self._run(work, result)
        self.platform.synchronize()
        result.execute_seconds = time.perf_counter() - started
        return result

    def reset(self) -> None:
        """Forget every request (a new scheduler stream starts from nothing)."""
        self.batch = InputBatch()

    def close(self) -> None:
        """Release the model, the KV cache and the batch."""
        self.batch = InputBatch()
        self.kv_cache.layers.clear()
        del self.model

    def _apply(self, step: worker_pb2.Step) -> list[_Scheduled]:
        """Validate the whole step, then add new requests and extend block tables."""
        seen: set[str] = set()
        new: list[_Scheduled] = []
        for req in step.new_requests:
            self._check_id(req.request_id, seen)
            if req.request_id in self.batch:
                raise ValueError(f"new request {req.request_id!r} is already in the worker's batch")
            if not req.prompt_token_ids:
                raise ValueError(f"request {req.request_id!r} has an empty prompt")
            tokens = list(req.prompt_token_ids) + list(req.output_token_ids)
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"request {req.request_id!r} has token id {bad[0]} outside [0, {self.vocab_size})")
            blocks = list(req.block_ids)
            self._check_work(req.request_id, req.num_computed_tokens, req.num_scheduled_tokens, tokens, blocks)
            cached = CachedRequest(
                request_id=req.request_id,
                token_ids=tokens,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_computed_tokens=req.num_computed_tokens,
                block_ids=blocks,
                # Copied: the caller may reuse or mutate the Step message.
                sampling=_copy_params(req.sampling),
            )
            new.append(_Scheduled(cached, req.num_scheduled_tokens))
        running: list[tuple[_Scheduled, list[int]]] = []
        for sched in step.scheduled:
            self._check_id(sched.request_id, seen)
            cached = self.batch.get(sched.request_id)
            if sched.num_computed_tokens != cached.num_computed_tokens:
                raise ValueError(
                    f"request {sched.request_id!r}: scheduler says num_computed_tokens="
                    f"{sched.num_computed_tokens}, worker has {cached.num_computed_tokens}"
                )
            blocks = cached.block_ids + list(sched.new_block_ids)
            self._check_work(
                sched.request_id, cached.num_computed_tokens, sched.num_scheduled_tokens, cached.token_ids, blocks
            )
            running.append((_Scheduled(cached, sched.num_scheduled_tokens), list(sched.new_block_ids)))
        work = new + [item for item, _ in running]
        total = sum(item.num_scheduled for item in work)
        if total > self.config.max_num_batched_tokens:
            raise ValueError(f"step schedules {total} tokens > --max-num-batched-tokens")
        if len(work) > self.config.max_num_seqs:
            raise ValueError(f"step schedules {len(work)} requests > --max-num-seqs")
        for item in new:
            self.batch.add(item.request)
        for item, new_blocks in running:
            item.request.block_ids.extend(new_blocks)
        return work

    @staticmethod
    def _check_id(request_id: str, seen: set[str]) -> None:
        if not request_id:
            raise ValueError("request_id must not be empty")
        if request_id in seen:
            raise ValueError(f"request {request_id!r} appears twice in one step")
        seen.add(request_id)

    def _check_work(
        self, request_id: str, num_computed: int, num_scheduled: int, tokens: list[int], blocks: list[int]
    ) -> None:
        if num_scheduled < 1:
            raise ValueError(f"request {request_id!r}: num_scheduled_tokens must be >= 1")
        end = num_computed + num_scheduled
        if end > len(tokens):
            raise ValueError(
                f"request {request_id!r}: computing up to token {end} but it has only {len(tokens)} tokens"
            )
        if end > self.max_model_len:
            raise ValueError(f"request {request_id!r}: {end} tokens exceed --max-model-len={self.max_model_len}")
        if len(blocks) * self.block_size < end:
            raise ValueError(
                f"request {request_id!r}: {len(blocks)} blocks of {self.block_size} cannot hold {end} tokens"
            )
        bad = [b for b in blocks if b >= self.num_blocks]
        if bad:
            raise ValueError(f"request {request_id!r}: block id {bad[0]} >= num_blocks={self.num_blocks}")

    def _run(self, work: list[_Scheduled], result: worker_pb2.StepResult) -> None:
        """Forward the flat batch, sample the rows that reached their end, advance the batch."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        bs = self.block_size
        for item in work:
            req = item.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + item.num_scheduled
            input_ids.extend(req.token_ids[start:end])
            span = range(start, end)
            positions.extend(span)
            slots.extend(req.block_ids[p // bs] * bs + p % bs for p in span)
            query_start.append(query_start[-1] + item.num_scheduled)
            seq_lens.append(end)
        # Only the blocks up to each sequence's end are read; padding with block 0 is masked out.
        needed = [-(-n // bs) for n in seq_lens]
        width = max(needed)
        block_tables = torch.tensor(
            [item.request.block_ids[:n] + [0] * (width - n) for item, n in zip(work, needed, strict=True)],
            dtype=torch.int64,
        )

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=block_tables.to(device),
        )
        sample_rows: list[int] = []
        sample_work: list[_Scheduled] = []
        for row, item in enumerate(work):
            if item.request.num_computed_tokens + item.num_scheduled == item.request.num_tokens:
                sample_rows.append(query_start[row + 1] - 1)
                sample_work.append(item)

        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                self.kv_cache.layers,
                meta,
            )
            logits = None
            if sample_rows:
                logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)])

        for item in work:
            item.request.num_computed_tokens += item.num_scheduled
        if logits is None:
            return
        requests = [SampleRequest(item.request.sampling, item.request.num_output_tokens) for item in sample_work]
        for item, sampled in zip(sample_work, self.sampler.sample(logits, requests), strict=True):
            item.request.token_ids.append(sampled.token_id)
            token = worker_pb2.SampledToken(request_id=item.request.request_id, token_id=sampled.token_id)
            if sampled.logprob is not None:
                token.logprob = sampled.logprob
            result.sampled.append(token)
