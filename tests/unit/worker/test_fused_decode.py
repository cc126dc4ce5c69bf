"""A decode step's layers in one native call (kernels/decode_layers.cpp) compute bit for bit what the per-layer path
computes, for every weight format and precision that takes it, and steps it does not take run layer by layer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services.worker.engine_config import EngineConfig
from services.worker.layers.attention import AttentionMetadata
from services.worker.model_runner import ModelRunner
from tests.support.tiny_gguf import make_tiny_gguf
from tests.support.tiny_model import make_tiny_model
from tests.unit.worker.test_model_runner import PROMPTS, Driver, Req

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64 and two query heads a KV head: a shape the native decode attention takes on every ISA.
    return make_tiny_model(tmp_path_factory.mktemp("llama"), hidden_size=128, num_heads=2, num_kv_heads=1, seed=4)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Qwen2: biases on q, k and v, added after the kernel.
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen2"), model_type="qwen2", hidden_size=128, num_heads=2, num_kv_heads=1, seed=5
    )


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Q4_1 linears (int4_linear), a Q8_0 tied head, head_dim 64.
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf", hidden_size=128, num_heads=2,
                          num_kv_heads=1, intermediate_size=256)  # fmt: skip


def _runner(model: Path, **kw: object) -> ModelRunner:
    args: dict[str, object] = {
        "model_path": str(model),
        "block_size": 4,
        "kv_cache_memory_bytes": 1 << 22,
        "max_num_batched_tokens": 4096,
        "max_num_seqs": 32,
        "max_model_len": 256,
        "cpu_kernels": "native",
        **kw,
    }
    return ModelRunner(EngineConfig(**args))  # type: ignore[arg-type]


class Checked:
    """Wraps a model's fused form: every step it takes is run layer by layer too, and the two must be equal."""

    def __init__(self, runner: ModelRunner) -> None:
        model = runner.model
        model.bind()
        assert model._bound is not None
        self.layers, final_norm, fused = model._bound
        assert fused is not None, "this model should have a fused decode form"
        self.fused = fused
        model._bound = (self.layers, final_norm, self)
        self.accum = runner.precision.accum
        self.taken = 0
        self.declined = 0

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = self.fused(hidden, residual, cos, sin, kv_caches, meta)
        if out is None:
            self.declined += 1
            return None
        self.taken += 1
        self._check(out, hidden, residual, cos, sin, kv_caches, meta)
        if residual is None:
            # As a later pipeline stage continues: a residual stream carried in (its K/V writes are undone by the
            # step's own, rewritten below).
            carried = (hidden * 0.5 + 1).to(self.accum)
            self._check(
                self.fused(hidden, carried, cos, sin, kv_caches, meta), hidden, carried, cos, sin, kv_caches, meta
            )
            self._check(self.fused(hidden, None, cos, sin, kv_caches, meta), hidden, None, cos, sin, kv_caches, meta)
        return out

    def _check(
        self,
        out: tuple[torch.Tensor, torch.Tensor] | None,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> None:
        assert out is not None
        expected_hidden, expected_residual = hidden, residual
        # The per-layer path writes the same K/V into the same slots: the caches end as they were after the
        # fused call.
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            expected_hidden, expected_residual = layer(expected_hidden, expected_residual, cos, sin, kv_cache, meta)
        assert expected_residual is not None
        assert out[0].dtype == expected_hidden.dtype and out[1].dtype == expected_residual.dtype
        assert torch.equal(out[0], expected_hidden), (out[0] - expected_hidden).abs().max()
        assert torch.equal(out[1], expected_residual), (out[1] - expected_residual).abs().max()


def _staggered(runner: ModelRunner) -> list[list[int]]:
    """Greedy outputs of PROMPTS arriving one a step: steps that mix a prefill chunk with decodes, and pure decode
    steps of 1-4 rows."""
    return [r.outputs for r in Driver(runner, chunk=5).staggered(PROMPTS, 6)]


@pytest.mark.parametrize(
    ("model", "kw"),
    [
        ("llama_dir", {"dtype": "bf16"}),  # bf16 weights through half_linear (where the CPU has no bf16 GEMM)
        ("llama_dir", {"dtype": "fp32", "quantization": "int8"}),
        ("llama_dir", {"dtype": "bf16", "quantization": "int8"}),
        ("llama_dir", {"precision": "bf16-bf16-fp32", "quantization": "int8"}),  # norms and residual in fp32
        ("qwen2_dir", {"dtype": "bf16", "quantization": "int8"}),
        ("gguf_file", {"dtype": "bf16", "quantization": "gguf"}),
    ],
)
def test_fused_decode_steps_equal_the_per_layer_path(
    model: str, kw: dict[str, object], request: pytest.FixtureRequest
) -> None:
    runner = _runner(request.getfixturevalue(model), **kw)
    if runner.model._bound is None:
        runner.model.bind()
    assert runner.model._bound is not None
    if runner.model._bound[2] is None:
        assert runner.platform.half_max_rows(torch.bfloat16) == 0
        pytest.skip("this CPU's bf16 GEMM is native: the bf16 weights take no small-step kernel here")
    checked = Checked(runner)
    outputs = _staggered(runner)
    assert checked.taken > 0 and checked.declined > 0
    # And the same tokens as a runner that never takes the fused form.
    plain = _runner(request.getfixturevalue(model), **kw)
    plain.model.bind()
    assert plain.model._bound is not None
    plain.model._bound = (*plain.model._bound[:2], None)
    assert _staggered(plain) == outputs


def test_steps_past_the_small_step_rows_run_layer_by_layer(llama_dir: Path) -> None:
    runner = _runner(llama_dir, dtype="fp32", quantization="int8")
    checked = Checked(runner)
    # Two decodes a step more than the int8 kernel's small-step bound: the fused form declines them.
    max_rows = runner.platform.quantized_max_rows(torch.float32)
    driver = Driver(runner, chunk=1000)
    for i in range(max_rows + 2):
        driver.add(Req(f"r{i}", PROMPTS[i % len(PROMPTS)], 3))
    driver.run()
    assert checked.taken == 0 and checked.declined > 0


def test_no_fused_form_without_small_step_kernels_or_on_reference_ops(llama_dir: Path) -> None:
    # fp32 weights run on MKL at every step size: no linear has a small-step kernel.
    runner = _runner(llama_dir, dtype="fp32")
    runner.model.bind()
    assert runner.model._bound is not None and runner.model._bound[2] is None
    # The reference ops have no small-step kernels and no fused form, whatever the stack.
    reference = _runner(llama_dir, dtype="bf16", cpu_kernels="reference")
    reference.model.bind()
    assert reference.model._bound is not None and reference.model._bound[2] is None
    from services.worker.layers.decode_stack import DecodeStack

    stack = DecodeStack((), 1e-5, 0.125, 2, 1, 64, torch.float32, torch.float32)
    assert reference.platform.ops.fused_decode(stack) is None


def test_the_kernel_refuses_operands_that_do_not_add_up() -> None:
    from services.worker.kernels import loader

    loader.load()
    hidden = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="2 weight operands for linears that take 4"):
        torch.ops.meshserve_cpu.decode_layers(
            hidden, None, torch.zeros(1, 64), torch.zeros(1, 64), [torch.ones(64), torch.ones(64)],
            [torch.zeros(1), torch.zeros(1)], [1, 1, 1, 1], [None] * 4, [torch.zeros(1, 1, 4, 64)],
            [torch.zeros(1, 1, 4, 64)], torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long), 1e-5, 0.125, 1, 1, 64, torch.float32, torch.float32,
        )  # fmt: skip
