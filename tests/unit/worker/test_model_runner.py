"""ModelRunner driven by hand-built Steps (the test plays the scheduler) against transformers' greedy."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from services.common.kv_store_limits import is_valid_kv_format
from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.worker.engine_config import EngineConfig
from services.worker.kernels import loader
from services.worker.model_runner import ModelRunner
from services.worker.platforms.cpu import CpuPlatform
from services.worker.platforms.cpu_native_ops import NativeCpuOps
from services.worker.startup_error import StartupError
from tests.support.devices import device_params
from tests.support.tiny_model import make_tiny_model, transformers_greedy

GREEDY = sampling_pb2.SamplingParams(temperature=0)
PROMPTS = [
    [11, 12, 13],
    [300, 17, 256, 44, 45, 46, 47],
    [5, 9, 100, 200, 7, 8, 1, 2, 3, 4, 250, 251, 252],
    [int(x) for x in range(40, 62)],
]


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_new: int
    params: sampling_pb2.SamplingParams = field(default_factory=lambda: GREEDY)
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    held: bool = False
    new_blocks: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_new


class Driver:
    """A minimal scheduler: chunked prefill up to `chunk` tokens per request, then 1-token decodes."""

    def __init__(self, runner: ModelRunner, chunk: int = 1000, seed: int = 0) -> None:
        self.runner = runner
        self.chunk = chunk
        self.free = list(range(runner.num_blocks))
        # Shuffled so block tables are not contiguous ranges.
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, Req] = {}
        self.removed: list[str] = []
        self.step_id = 0
        self.results: list[worker_pb2.StepResult] = []
        self.steps: list[worker_pb2.Step] = []

    def add(self, req: Req) -> Req:
        self.reqs[req.rid] = req
        return req

    def preempt(self, rid: str) -> None:
        req = self.reqs[rid]
        self.free.extend(req.blocks)
        req.blocks, req.num_computed, req.held = [], 0, False
        self.removed.append(rid)

    def _allocate(self, req: Req, upto: int) -> list[int]:
        bs = self.runner.block_size
        fresh = []
        while len(req.blocks) * bs < upto:
            block = self.free.pop(0)
            req.blocks.append(block)
            fresh.append(block)
        return fresh

    def step(self, only: list[str] | None = None) -> dict[str, worker_pb2.SampledToken]:
        self.step_id += 1
        step = worker_pb2.Step(step_id=self.step_id, removed_request_ids=self.removed)
        self.removed = []
        order: list[tuple[Req, int]] = []
        for req in self.reqs.values():
            if req.done or (only is not None and req.rid not in only):
                continue
            n = min(self.chunk, len(req.tokens) - req.num_computed)
            fresh = self._allocate(req, req.num_computed + n)
            if req.held:
                step.scheduled.append(
                    worker_pb2.ScheduledRequest(
                        request_id=req.rid,
                        new_block_ids=fresh,
                        num_computed_tokens=req.num_computed,
                        num_scheduled_tokens=n,
                    )
                )
            else:
                step.new_requests.append(
                    worker_pb2.NewRequest(
                        request_id=req.rid,
                        prompt_token_ids=req.prompt,
                        output_token_ids=req.outputs,
                        sampling=req.params,
                        block_ids=req.blocks,
                        num_computed_tokens=req.num_computed,
                        num_scheduled_tokens=n,
                    )
                )
            order.append((req, n))
        self.steps.append(step)
        result = self.runner.execute(step)
        assert result.step_id == self.step_id
        assert not result.error
        self.results.append(result)
        sampled = {s.request_id: s for s in result.sampled}
        assert len(sampled) == len(result.sampled)
        # Results come in step order: new requests first, then scheduled ones.
        step_order = [r.request_id for r in step.new_requests] + [r.request_id for r in step.scheduled]
        assert [s.request_id for s in result.sampled] == [r for r in step_order if r in sampled]
        for req, n in order:
            req.held = True
            req.num_computed += n
            reached_end = req.num_computed == len(req.tokens)
            assert (req.rid in sampled) == reached_end, req.rid
            if reached_end:
                req.outputs.append(sampled[req.rid].token_id)
                if req.done:
                    self.removed.append(req.rid)
        return sampled

    def staggered(self, prompts: list[list[int]], max_new: int) -> list[Req]:
        """Requests arriving one a step, run to the end: steps mixing a prefill chunk with decodes, then pure
        decode steps as they finish."""
        reqs = []
        for i, prompt in enumerate(prompts):
            reqs.append(self.add(Req(f"r{i}", prompt, max_new)))
            self.step()
        self.run()
        return reqs

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if all(r.done for r in self.reqs.values()):
                return
            self.step()
        raise AssertionError("requests did not finish")


def _runner(model_dir: Path, block_size: int = 5, dtype: str = "float32", **kw: object) -> ModelRunner:
    args: dict[str, object] = {
        "model_path": str(model_dir),
        "dtype": dtype,
        "block_size": block_size,
        "kv_cache_memory_bytes": 1 << 22,
        "max_num_batched_tokens": 4096,
        "max_num_seqs": 32,
        "max_model_len": 256,
        **kw,
    }
    return ModelRunner(EngineConfig(**args))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), model_type="qwen2", seed=1)


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("mqa"), num_heads=4, num_kv_heads=1, tie_word_embeddings=True, seed=2
    )


@pytest.fixture(scope="module")
def llama_runner(llama_dir: Path) -> ModelRunner:
    return _runner(llama_dir)


def test_runner_attributes(llama_dir: Path) -> None:
    runner = _runner(llama_dir, block_size=16, max_model_len=None)
    assert runner.max_model_len == 512
    assert runner.block_size == 16
    assert runner.vocab_size == 512
    assert runner.model_name == llama_dir.name
    assert runner.device_type == "cpu"
    assert is_valid_kv_format(runner.kv_format)
    assert runner.num_blocks >= 512 // 16
    assert _runner(llama_dir, block_size=8).kv_format != runner.kv_format
    runner.close()


def test_max_model_len_beyond_model_is_rejected(llama_dir: Path) -> None:
    with pytest.raises(StartupError, match=r"max_position_embeddings=.*; lower --max-model-len"):
        _runner(llama_dir, max_model_len=10_000)


def test_kv_budget_too_small_is_rejected(llama_dir: Path) -> None:
    with pytest.raises(StartupError) as info:
        _runner(llama_dir, kv_cache_memory_bytes=10_000)
    assert "one --max-model-len=256 sequence needs 52" in str(info.value)
    assert "lower --max-model-len, --max-num-seqs or --max-num-batched-tokens" in str(info.value)
    assert "raise --kv-cache-memory" in str(info.value)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("model", ["llama", "qwen2", "mqa"])
def test_greedy_matches_transformers_with_chunked_prefill(
    model: str, device: str, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(f"{model}_dir")
    runner = _runner(model_dir, block_size=5, device=device)
    driver = Driver(runner, chunk=4)
    max_new = 8
    # Staggered arrivals: later prompts prefill in chunks while earlier ones decode in the same step.
    reqs = []
    for i, prompt in enumerate(PROMPTS):
        reqs.append(driver.add(Req(f"r{i}", prompt, max_new)))
        driver.step()
    driver.run()
    # The schedule really mixed a chunked prefill with decodes of others.
    assert any(
        any(0 < s.num_computed_tokens < 13 and s.num_scheduled_tokens > 1 for s in st.scheduled)
        and any(s.num_scheduled_tokens == 1 for s in st.scheduled)
        for st in driver.steps
    )
    for req in reqs:
        assert req.outputs == transformers_greedy(model_dir, req.prompt, max_new), req.rid


def test_preempted_request_recomputes_same_continuation(llama_dir: Path) -> None:
    runner = _runner(llama_dir, block_size=4)
    driver = Driver(runner, chunk=6)
    a = driver.add(Req("a", PROMPTS[2], 10))
    b = driver.add(Req("b", PROMPTS[1], 10))
    while len(a.outputs) < 4:
        driver.step()
    old_blocks = list(a.blocks)
    driver.preempt("a")
    # b runs alone for a while, reusing nothing of a's; then a comes back with fresh blocks.
    for _ in range(2):
        driver.step(only=["b"])
    driver.free = [blk for blk in driver.free if blk not in old_blocks]
    driver.run()
    assert not set(a.blocks) & set(old_blocks)
    assert a.outputs == transformers_greedy(llama_dir, a.prompt, 10)
    assert b.outputs == transformers_greedy(llama_dir, b.prompt, 10)
    new = [r for st in driver.steps for r in st.new_requests if r.request_id == "a"]
    assert len(new) == 2 and len(new[1].output_token_ids) == 4


def test_prefix_reuse_from_blocks_of_an_earlier_request(llama_dir: Path) -> None:
    runner = _runner(llama_dir, block_size=4)
    driver = Driver(runner)
    prefix = PROMPTS[3][:12]
    first = driver.add(Req("first", [*prefix, 7, 8], 3))
    driver.run()
    shared = first.blocks[:3]
    second = Req("second", [*prefix, 99, 98, 97], 6)
    second.blocks = list(shared)
    second.num_computed = 12
    driver.add(second)
    driver.run()
    new = next(r for st in driver.steps for r in st.new_requests if r.request_id == "second")
    assert new.num_computed_tokens == 12 and new.num_scheduled_tokens == 3
    assert second.outputs == transformers_greedy(llama_dir, second.prompt, 6)


def test_prefix_reuse_uses_cached_kv(llama_dir: Path) -> None:
    """A bogus 'hit' on blocks holding other tokens changes the output: the cache really is read."""
    runner = _runner(llama_dir, block_size=4)
    driver = Driver(runner)
    other = driver.add(Req("other", PROMPTS[3][::-1][:14], 1))
    driver.run()
    liar = Req("liar", [*PROMPTS[3][:12], 99, 98, 97], 6)
    liar.blocks = other.blocks[:3]
    liar.num_computed = 12
    driver.add(liar)
    driver.run()
    assert liar.outputs != transformers_greedy(llama_dir, liar.prompt, 6)


def _sampled_run(
    model_dir: Path, params: sampling_pb2.SamplingParams, *, company: int, chunk: int, preempt_at: int | None
) -> list[int]:
    runner = _runner(model_dir, block_size=5, seed=company)
    driver = Driver(runner, chunk=chunk, seed=company)
    for i in range(company):
        driver.add(Req(f"other{i}", PROMPTS[i % len(PROMPTS)], 12, sampling_pb2.SamplingParams(temperature=1.0)))
    target = driver.add(Req("target", PROMPTS[2], 12, params))
    if preempt_at is not None:
        while len(target.outputs) < preempt_at:
            driver.step()
        driver.preempt("target")
    driver.run()
    return target.outputs


def test_seeded_sampling_is_reproducible_across_batches_and_preemption(llama_dir: Path) -> None:
    params = sampling_pb2.SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = _sampled_run(llama_dir, params, company=0, chunk=1000, preempt_at=None)
    crowded = _sampled_run(llama_dir, params, company=3, chunk=4, preempt_at=None)
    preempted = _sampled_run(llama_dir, params, company=2, chunk=3, preempt_at=5)
    assert alone == crowded == preempted
    other_seed = sampling_pb2.SamplingParams(temperature=1.0, top_p=0.95, seed=43)
    assert _sampled_run(llama_dir, other_seed, company=0, chunk=1000, preempt_at=None) != alone
    # Sampling at temperature 1 is not just greedy.
    assert alone != transformers_greedy(llama_dir, PROMPTS[2], 12)


@pytest.mark.parametrize(
    "params",
    [
        sampling_pb2.SamplingParams(temperature=0.0),
        sampling_pb2.SamplingParams(temperature=1.5, top_k=1, seed=7),
        sampling_pb2.SamplingParams(temperature=1.5, top_k=1),
    ],
)
def test_top_k_one_and_temperature_zero_equal_greedy(llama_dir: Path, params: sampling_pb2.SamplingParams) -> None:
    out = _sampled_run(llama_dir, params, company=1, chunk=4, preempt_at=None)
    assert out == transformers_greedy(llama_dir, PROMPTS[2], 12)


def test_bfloat16_produces_valid_tokens(qwen2_dir: Path) -> None:
    runner = _runner(qwen2_dir, dtype="bf16", block_size=4)
    assert runner.kv_cache.layers[0][0].dtype.is_floating_point
    assert str(runner.kv_cache.layers[0][0].dtype) == "torch.bfloat16"
    driver = Driver(runner, chunk=5)
    reqs = [driver.add(Req(f"r{i}", p, 6)) for i, p in enumerate(PROMPTS)]
    driver.run()
    for req in reqs:
        assert len(req.outputs) == 6
        assert all(0 <= t < runner.vocab_size for t in req.outputs)
    # bf16 rounding may flip a late near-tie, but the first token of a prompt should agree.
    agree = sum(r.outputs[0] == transformers_greedy(qwen2_dir, r.prompt, 1)[0] for r in reqs)
    assert agree >= len(reqs) - 1


def test_logprobs_reported_when_asked(llama_runner: ModelRunner) -> None:
    driver = Driver(llama_runner)
    params = sampling_pb2.SamplingParams(temperature=0, logprobs=True)
    driver.add(Req("lp", PROMPTS[0], 2, params))
    driver.add(Req("nolp", PROMPTS[1], 2))
    sampled = driver.step()
    assert sampled["lp"].logprob < 0.0
    assert sampled["nolp"].logprob == 0.0
    driver.run()


def _new(rid: str, prompt: list[int], blocks: list[int], n: int, computed: int = 0) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=GREEDY,
        block_ids=blocks,
        num_computed_tokens=computed,
        num_scheduled_tokens=n,
    )


def test_empty_step_and_unknown_removal(llama_runner: ModelRunner) -> None:
    result = llama_runner.execute(worker_pb2.Step(step_id=77, removed_request_ids=["never-seen"]))
    assert result.step_id == 77 and not result.sampled and not result.error
    assert result.execute_seconds >= 0.0


def test_chunked_prefill_gets_no_token_until_done(llama_runner: ModelRunner) -> None:
    first = llama_runner.execute(worker_pb2.Step(step_id=1, new_requests=[_new("c", PROMPTS[3], [0, 1, 2, 3, 4], 10)]))
    assert not first.sampled
    second = llama_runner.execute(
        worker_pb2.Step(
            step_id=2,
            scheduled=[worker_pb2.ScheduledRequest(request_id="c", num_computed_tokens=10, num_scheduled_tokens=12)],
        )
    )
    assert [s.request_id for s in second.sampled] == ["c"]
    assert second.execute_seconds > 0.0
    llama_runner.execute(worker_pb2.Step(step_id=3, removed_request_ids=["c"]))


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (worker_pb2.Step(new_requests=[_new("x", [1, 2, 3, 4, 5, 6], [0], 6)]), "cannot hold"),
        (worker_pb2.Step(new_requests=[_new("x", [1, 2, 3], [0], 4)]), "only 3 tokens"),
        (worker_pb2.Step(new_requests=[_new("x", [1, 9999], [0], 2)]), "outside"),
        (worker_pb2.Step(new_requests=[_new("x", [1, 2], [10**6], 2)]), "num_blocks"),
        (worker_pb2.Step(new_requests=[_new("x", [1, 2], [0], 0)]), "num_scheduled_tokens"),
        (worker_pb2.Step(new_requests=[_new("x", [], [0], 1)]), "empty prompt"),
        (worker_pb2.Step(new_requests=[_new("x", [1], [0], 1), _new("x", [1], [1], 1)]), "twice"),
        (
            worker_pb2.Step(scheduled=[worker_pb2.ScheduledRequest(request_id="ghost", num_scheduled_tokens=1)]),
            "not in the worker's batch",
        ),
    ],
)
def test_bad_steps_raise_without_changing_the_batch(
    llama_runner: ModelRunner, step: worker_pb2.Step, message: str
) -> None:
    before = llama_runner.batch.request_ids()
    with pytest.raises(ValueError, match=message):
        llama_runner.execute(step)
    assert llama_runner.batch.request_ids() == before


def test_num_computed_mismatch_raises(llama_runner: ModelRunner) -> None:
    llama_runner.execute(worker_pb2.Step(step_id=1, new_requests=[_new("m", [1, 2, 3], [5], 3)]))
    bad = worker_pb2.ScheduledRequest(request_id="m", num_computed_tokens=2, num_scheduled_tokens=1)
    with pytest.raises(ValueError, match="num_computed_tokens=2, worker has 3"):
        llama_runner.execute(worker_pb2.Step(step_id=2, scheduled=[bad]))
    ok = worker_pb2.ScheduledRequest(request_id="m", num_computed_tokens=3, num_scheduled_tokens=1)
    assert len(llama_runner.execute(worker_pb2.Step(step_id=3, scheduled=[ok])).sampled) == 1
    llama_runner.execute(worker_pb2.Step(step_id=4, removed_request_ids=["m"]))
    assert "m" not in llama_runner.batch


def test_batch_limits_are_enforced(llama_dir: Path) -> None:
    runner = _runner(llama_dir, max_num_batched_tokens=4, max_num_seqs=1)
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        runner.execute(worker_pb2.Step(new_requests=[_new("a", [1, 2, 3, 4, 5], [0, 1], 5)]))
    with pytest.raises(ValueError, match="--max-num-seqs"):
        runner.execute(worker_pb2.Step(new_requests=[_new("a", [1], [0], 1), _new("b", [1], [1], 1)]))


def test_unset_step_budget_is_the_platforms(llama_dir: Path) -> None:
    runner = _runner(llama_dir, max_num_batched_tokens=None)
    assert runner.max_num_batched_tokens == runner.platform.default_max_num_batched_tokens
    assert _runner(llama_dir, max_num_batched_tokens=64).max_num_batched_tokens == 64


class _RecordingCpuPlatform(CpuPlatform):
    """The CPU platform, noting the row counts the runner scopes its matmuls with."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def matmul_backend(self, num_rows: int) -> contextlib.AbstractContextManager[None]:
        self.rows.append(num_rows)
        return super().matmul_backend(num_rows)


def test_matmuls_are_scoped_by_row_count(llama_dir: Path) -> None:
    platform = _RecordingCpuPlatform()
    config = EngineConfig(
        model_path=str(llama_dir), dtype="bf16", block_size=4, kv_cache_memory_bytes=1 << 22, max_model_len=64
    )
    runner = ModelRunner(config, platform=platform)
    platform.rows.clear()  # the memory profile's forward at startup
    driver = Driver(runner, chunk=100)
    req = driver.add(Req("one", [5, 6, 7, 8, 9], 3))
    driver.run()
    # Prefill: 5 token rows, 1 logits row; then each decode: 1 and 1.
    assert platform.rows == [5, 1, 1, 1, 1, 1]
    assert len(req.outputs) == 3


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64, two query heads per KV head: a shape the native decode-attention kernel takes on every
    # ISA (the other tiny models' head_dim 16 falls back to the reference).
    return make_tiny_model(tmp_path_factory.mktemp("wide"), hidden_size=128, num_heads=2, num_kv_heads=1, seed=3)


def test_native_cpu_kernels_match_transformers(wide_dir: Path) -> None:
    runner = _runner(wide_dir, block_size=4, cpu_kernels="native")
    assert isinstance(runner.platform.ops, NativeCpuOps)
    assert torch.ops.meshserve_cpu.decode_attention_supported(64, 2)
    reqs = Driver(runner, chunk=4).staggered(PROMPTS, 8)
    for req in reqs:
        assert req.outputs == transformers_greedy(wide_dir, req.prompt, 8), req.rid


def test_bf16_linears_are_packed_for_onednn_unless_kernels_are_reference(wide_dir: Path) -> None:
    # In bf16 where oneDNN runs bf16 natively (avx512_bf16/AMX), else in fp32 (AVX2-only hosts).
    pack_dtype = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    outputs = {}
    for kernels in ("auto", "reference"):
        runner = _runner(wide_dir, dtype="bf16", block_size=4, cpu_kernels=kernels)
        modules = runner.model.matmul_modules()
        if kernels == "auto":
            # Small steps read the bf16 weights through the native half kernel where the platform says it
            # pays: packed in fp32 (up to 16 rows), or packed in bf16 on an AVX512-BF16 CPU (its vdpbf16ps path,
            # and on AMX its tile path).
            half = "half+" if runner.platform.half_max_rows(torch.bfloat16) > 0 else ""
            assert bool(half) == (pack_dtype == torch.float32 or loader.isa()[0] in loader.BF16_DOT_BUILDS)
            ops = runner.platform.ops
            if half and isinstance(ops, NativeCpuOps) and ops.half_tiles:
                half = "half-tiles+"  # every one of this model's shapes falls into whole tiles
            assert runner.matmul_weights == f"{half}onednn-{str(pack_dtype).removeprefix('torch.')}"
            assert all(m.packed is not None and m.packed.dtype == pack_dtype for m in modules)
            assert all((m.quantized is not None) == bool(half) for m in modules)
            # Column/row linears drop the plain copy: the half kernel, where it runs, holds the bf16 weight, and
            # elsewhere the bf16 packed copy is the only one. The tied-or-not LM head keeps it for lookups.
            assert all(m.weight.numel() == 0 for m in modules[:-1])
            assert modules[-1].weight.numel() > 0
            # The reported weight bytes hold the packed copies too, so at least every matmul weight once.
            packed_bytes = sum(m.packed.numel() * pack_dtype.itemsize for m in modules if m.packed is not None)
            assert runner.rank_memory[0].weights_bytes >= packed_bytes > 0
        else:
            assert runner.matmul_weights == "plain"
            assert all(m.packed is None for m in modules)
        driver = Driver(runner, chunk=5)
        reqs = [driver.add(Req(f"r{i}", p, 6)) for i, p in enumerate(PROMPTS)]
        driver.run()
        outputs[kernels] = [r.outputs for r in reqs]
    # Same bf16 rounding of every op but the matmuls' accumulation order: first tokens agree.
    agree = sum(a[0] == b[0] for a, b in zip(outputs["auto"], outputs["reference"], strict=True))
    assert agree >= len(PROMPTS) - 1


def test_fp32_linears_stay_unpacked(llama_runner: ModelRunner) -> None:
    assert llama_runner.platform.matmul_pack_dtype(torch.float32) is None
    assert all(m.packed is None for m in llama_runner.model.matmul_modules())


def _decode(model_dir: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return str(Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids))


def test_grammar_constrains_output_and_replays_after_preemption(llama_dir: Path) -> None:
    runner = _runner(llama_dir)
    assert runner.grammar is not None
    eos = sorted(runner.grammar.eos_token_ids)
    choice = sampling_pb2.Grammar(choice=sampling_pb2.Choices(choices=["the cat", "a dog"]))
    regex = sampling_pb2.Grammar(regex="[0-9]{3}")
    driver = Driver(runner)
    picked = driver.add(Req("choice", PROMPTS[0], 12, sampling_pb2.SamplingParams(temperature=0, grammar=choice)))
    digits = driver.add(
        Req("regex", PROMPTS[1], 12, sampling_pb2.SamplingParams(temperature=0.9, seed=3, grammar=regex))
    )
    free = driver.add(Req("free", PROMPTS[2], 6))
    for _ in range(2):
        driver.step()
    driver.preempt("regex")  # rebuilt from its output tokens by the next NewRequest
    for _ in range(40):
        if all(r.done or (r.outputs and r.outputs[-1] in eos) for r in (picked, digits)) and free.done:
            break
        for r in (picked, digits):
            if r.outputs and r.outputs[-1] in eos:
                r.max_new = len(r.outputs)  # the scheduler would stop it at EOS
        driver.step()
    for req, check in ((picked, lambda t: t in ("the cat", "a dog")), (digits, lambda t: len(t) == 3 and t.isdigit())):
        assert req.outputs[-1] in eos, req.outputs
        assert check(_decode(llama_dir, req.outputs[:-1])), _decode(llama_dir, req.outputs)
    assert len(free.outputs) == 6


def test_a_grammar_that_fails_fails_its_request_alone(llama_dir: Path) -> None:
    runner = _runner(llama_dir)
    bad = sampling_pb2.SamplingParams(temperature=0, grammar=sampling_pb2.Grammar(regex="(unclosed"))
    driver = Driver(runner)
    driver.add(Req("bad", PROMPTS[0], 4, bad))
    good = driver.add(Req("good", PROMPTS[1], 4))
    sampled = driver.step()
    assert sampled["bad"].HasField("failure") and sampled["bad"].failure.field == "sampling.grammar.regex"
    assert not sampled["good"].HasField("failure")
    driver.preempt("bad")
    del driver.reqs["bad"]
    driver.run()
    assert good.outputs == transformers_greedy(llama_dir, PROMPTS[1], 4)


def test_dummy_weights_serve_a_shape_without_files(tmp_path: Path) -> None:
    """--load-format dummy: a directory with only a config (and tokenizer) serves; the same seed is the same
    model, so greedy continuations repeat."""
    from services.worker.benchmarks.shaped_model import write_shaped_model

    model_dir = write_shaped_model("tiny", tmp_path / "tiny")
    assert not list(model_dir.glob("*.safetensors"))
    with pytest.raises(ValueError, match="--load-format dummy"):
        _runner(model_dir)
    outputs = []
    for _ in range(2):
        runner = _runner(model_dir, load_format="dummy", dtype="bfloat16")
        driver = Driver(runner)
        req = driver.add(Req("r", PROMPTS[3], 6))
        driver.run()
        outputs.append(req.outputs)
        runner.close()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6
