"""Flags come from the settings classes; flags beat MESHSERVE_* variables, which beat defaults."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from services import cli
from services.common.byte_sizes import parse_size
from services.common.settings import add_settings_arguments, settings_from_args
from services.scheduler.settings import SchedulerSettings
from services.scheduler.waiting_queue import DEFAULT_SCHEDULING_POLICY
from services.worker.settings import WorkerSettings


def _parse(cls: type, argv: list[str]):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, cls)
    return settings_from_args(cls, parser.parse_args(argv))


def test_flag_beats_env_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parse(SchedulerSettings, []).max_num_seqs == 128
    monkeypatch.setenv("MESHSERVE_MAX_NUM_SEQS", "7")
    assert _parse(SchedulerSettings, []).max_num_seqs == 7
    assert _parse(SchedulerSettings, ["--max-num-seqs", "9"]).max_num_seqs == 9


def test_bool_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parse(SchedulerSettings, []).enable_prefix_caching is True
    assert _parse(SchedulerSettings, ["--no-enable-prefix-caching"]).enable_prefix_caching is False
    monkeypatch.setenv("MESHSERVE_ENABLE_PREFIX_CACHING", "false")
    assert _parse(SchedulerSettings, []).enable_prefix_caching is False


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValidationError, match="max_num_seqs"):
        _parse(SchedulerSettings, ["--max-num-seqs", "0"])
    with pytest.raises(ValidationError, match="kv_cache_memory"):
        _parse(WorkerSettings, ["--kv-cache-memory", "lots"])


@pytest.mark.parametrize(
    ("text", "size"), [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5G", 3 << 29), ("4096", 4096), ("8k", 8192)]
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_worker_parallel_and_precision_flags() -> None:
    settings = _parse(
        WorkerSettings,
        ["--tensor-parallel-size", "8", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:29500",
         "--precision", "bf16-fp16-fp32", "--cpu-binding", "off", "--gpu-memory-utilization", "0.8"],
    )  # fmt: skip
    assert settings.ranks_per_node == 4
    assert (settings.precision, settings.cpu_binding, settings.gpu_memory_utilization) == ("bf16-fp16-fp32", "off", 0.8)


def test_pipeline_stages_multiply_the_ranks_hosts_share() -> None:
    settings = _parse(
        WorkerSettings,
        ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "3", "--nnodes", "3", "--dist-init-addr", "h:1",
         "--pp-layer-partition", "10, 10,12"],
    )  # fmt: skip
    assert (settings.world_size, settings.ranks_per_node, settings.layer_partition) == (6, 2, (10, 10, 12))
    assert _parse(WorkerSettings, []).layer_partition is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tensor-parallel-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "multiple of --nnodes 2"),
        (["--pipeline-parallel-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"],
         "--pipeline-parallel-size 3 = 3 ranks must be a multiple of --nnodes 2"),
        (["--pipeline-parallel-size", "0"], "pipeline_parallel_size"),
        (["--pp-layer-partition", "8,x"], "--pp-layer-partition must be comma-separated layer counts"),
        (["--pp-layer-partition", "8,0"], "every stage needs at least one layer"),
        (["--nnodes", "2", "--node-rank", "2", "--tensor-parallel-size", "2", "--dist-init-addr", "h:1"],
         "--node-rank 2 must be < --nnodes 2"),
        (["--nnodes", "2", "--tensor-parallel-size", "2"], "--nnodes > 1 needs --dist-init-addr"),
        (["--precision", "bf16-fp8-fp32"], "COMPUTE 'fp8'"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    ],
)  # fmt: skip
def test_worker_settings_refuse_bad_combinations(argv: list[str], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        _parse(WorkerSettings, argv)
    assert message in str(info.value)


def test_the_scheduling_policy_and_its_aging_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert _parse(SchedulerSettings, []).scheduling_policy == DEFAULT_SCHEDULING_POLICY
    settings = _parse(SchedulerSettings, ["--scheduling-policy", "fcfs", "--scheduling-aging-tokens-per-second", "250"])
    assert (settings.scheduling_policy, settings.scheduling_aging_tokens_per_second) == ("fcfs", 250.0)
    with pytest.raises(SystemExit):
        _parse(SchedulerSettings, ["--scheduling-policy", "lifo"])
    assert "--scheduling-policy: invalid choice: 'lifo'" in capsys.readouterr().err
    with pytest.raises(ValidationError) as info:
        _parse(SchedulerSettings, ["--scheduling-aging-tokens-per-second", "0"])
    assert "scheduling_aging_tokens_per_second" in str(info.value)


def test_swap_preemption_refuses_selective_saves() -> None:
    settings = _parse(SchedulerSettings, ["--kv-store-write-policy", "write-through-selective"])
    assert settings.kv_store_write_policy == "write-through-selective"
    with pytest.raises(ValidationError) as info:
        _parse(SchedulerSettings, ["--preemption-mode", "swap", "--kv-store-write-policy", "write-through-selective"])
    assert "use --kv-store-write-policy write-through with it" in str(info.value)


def test_list_flags_repeat_and_take_several_values() -> None:
    import argparse

    from services.common.settings import add_settings_arguments, settings_from_args
    from services.gateway.settings import GatewaySettings

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, GatewaySettings)
    args = parser.parse_args(["--api-key", "a", "--api-key", "b", "c", "--served-model-name", "smol"])
    settings = settings_from_args(GatewaySettings, args)
    assert settings.api_key == ["a", "b", "c"] and settings.served_model_name == ["smol"]


def test_structured_flags_take_one_json_object(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parse(SchedulerSettings, []).speculative_config is None
    spec = _parse(SchedulerSettings, ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert spec.speculative_config is not None and spec.speculative_config.num_speculative_tokens == 3
    monkeypatch.setenv("MESHSERVE_SPECULATIVE_CONFIG", '{"num_speculative_tokens": 5, "prompt_lookup_max": 2}')
    from_env = _parse(SchedulerSettings, []).speculative_config
    assert from_env is not None and (from_env.num_speculative_tokens, from_env.prompt_lookup_max) == (5, 2)
    with pytest.raises(ValidationError, match=r"speculative_config\.num_speculative_tokens"):
        _parse(SchedulerSettings, ["--speculative-config", '{"num_speculative_tokens": 0}'])
    # Not JSON, or not an object: argparse names the flag.
    for text in ("num_speculative_tokens=3", "[3]"):
        with pytest.raises(SystemExit):
            _parse(SchedulerSettings, ["--speculative-config", text])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["scheduler", "--max-num-seqs", "0"],
         "meshserve scheduler: error: --max-num-seqs (env MESHSERVE_MAX_NUM_SEQS): Input should be greater than"),
        (["scheduler", "--preemption-mode", "swap", "--kv-store-write-policy", "write-through-selective"],
         "meshserve scheduler: error: --preemption-mode swap resumes a preempted request"),
        (["worker", "--pp-layer-partition", "8,0"],
         "meshserve worker: error: --pp-layer-partition (env MESHSERVE_PP_LAYER_PARTITION): --pp-layer-partition 8,0"),
    ],
)  # fmt: skip
def test_a_service_refuses_bad_settings_as_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's exit (status 2) with the flag and the fix on one line, not pydantic's traceback."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err and "pydantic" not in err
