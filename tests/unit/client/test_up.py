"""`meshserve up` flags and its prints, without starting any service."""

from __future__ import annotations

import argparse
import os
import typing

import pytest

from services.client import up
from services.scheduler.settings import SchedulerSettings


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(argv)


def test_workers_has_num_workers_as_an_alias() -> None:
    assert _parse().workers == 1
    assert _parse("--workers", "3").workers == 3
    assert _parse("--num-workers", "2").workers == 2


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_workers_must_be_a_positive_count(value: str) -> None:
    with pytest.raises(SystemExit):
        _parse("--workers", value)


@pytest.mark.parametrize("flag", ["--port", "--scheduler-port", "--worker-port", "--kv-store-port"])
@pytest.mark.parametrize("value", ["0", "-1", "65536", "any"])
def test_ports_other_services_dial_must_be_fixed(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """0 (any free port) would leave the other services nowhere to connect and `up` waiting for health."""
    assert getattr(_parse(flag, "65535"), flag[2:].replace("-", "_")) == 65535
    with pytest.raises(SystemExit):
        _parse(flag, value)
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--routing", "--preemption-mode", "--kv-store-write-policy", "--scheduling-policy"])
def test_scheduler_choices_reach_it_only_when_given(flag: str) -> None:
    """`up` offers the scheduler's own choices (one list), and passes a choice on only when given."""
    field = flag[2:].replace("-", "_")
    choices = typing.get_args(SchedulerSettings.model_fields[field].annotation)
    assert len(choices) >= 2
    assert flag not in up.scheduler_args(_parse())
    for choice in choices:
        args = up.scheduler_args(_parse(flag, choice))
        assert args[args.index(flag) : args.index(flag) + 2] == [flag, choice]
    with pytest.raises(SystemExit):
        _parse(flag, "random")


def test_say_survives_a_closed_pipe() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # what `| tee` looks like once Ctrl-C killed tee
    with os.fdopen(write_end, "w") as stream:
        up.say("meshserve: stopping...", stream)
        up.say("meshserve: again", stream)


def test_engine_flags_reach_every_service_that_uses_them() -> None:
    ns = _parse(
        "/models/smol",
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        "4096",
        "-tp",
        "2",
        "-pp",
        "3",
        "--block-size",
        "32",
        "--seed",
        "7",
        "-q",
        "int8",
        "--load-format",
        "dummy",
        "--served-model-name",
        "smol",
        "alias",
        "--api-key",
        "k1",
        "--api-key",
        "k2",
        "--log-level",
        "debug",
    )
    assert up.model_argument(ns) == "/models/smol"
    worker, scheduler, gateway = up.worker_args(ns), up.scheduler_args(ns), up.gateway_args(ns)
    for flags, flag, value in (
        (worker, "--max-num-seqs", "256"),
        (worker, "--max-num-batched-tokens", "4096"),
        (scheduler, "--max-num-seqs", "256"),
        (worker, "--tensor-parallel-size", "2"),
        (worker, "--pipeline-parallel-size", "3"),
        (worker, "--block-size", "32"),
        (worker, "--seed", "7"),
        (worker, "--quantization", "int8"),
        (worker, "--load-format", "dummy"),
    ):
        assert flags[flags.index(flag) + 1] == value, (flag, flags)
    assert gateway[gateway.index("--served-model-name") + 1 :][:2] == ["smol", "alias"]
    assert [gateway[i + 1] for i, f in enumerate(gateway) if f == "--api-key"] == ["k1", "k2"]
    assert up.common_args(ns) == ["--log-level", "debug"]


def test_one_model_only() -> None:
    assert up.model_argument(_parse("--model", "/m")) == "/m"
    assert up.model_argument(_parse("/m", "--model", "/m")) == "/m"
    with pytest.raises(ValueError, match="two models"):
        up.model_argument(_parse("/a", "--model", "/b"))


def test_metrics_ports_one_per_service() -> None:
    from services.client.launcher import metrics_ports

    assert metrics_ports(9000, 2) == {
        "gateway": 9000,
        "scheduler": 9001,
        "kvstore": 9002,
        "worker-0": 9003,
        "worker-1": 9004,
    }


def test_speculative_config_is_checked_by_up_and_reaches_the_scheduler() -> None:
    assert "--speculative-config" not in up.scheduler_args(_parse())
    text = '{"num_speculative_tokens": 4, "disable_by_batch_size": 4}'
    args = up.scheduler_args(_parse("--speculative-config", text))
    assert args[args.index("--speculative-config") + 1] == text
    with pytest.raises(SystemExit):
        _parse("--speculative-config", '{"num_speculative_tokens": 4, "typo": 1}')


def test_the_gateway_and_the_workers_get_their_own_models(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker import model_fetch

    monkeypatch.setattr(up, "_model_dir", lambda given: given or "/cache/SmolLM2-135M-Instruct")
    monkeypatch.setattr(model_fetch, "ensure_embedded_gguf", lambda: "/cache/SmolLM2-135M-Instruct.Q4_1.gguf")
    embedded = "/cache/SmolLM2-135M-Instruct"
    assert up.suite_models(_parse()) == (embedded, embedded)
    assert up.suite_models(_parse("-q", "int8")) == (embedded, embedded)
    # The embedded model's own Q4_1 file for the workers; the gateway tokenizes with the directory.
    assert up.suite_models(_parse("-q", "gguf")) == (embedded, "/cache/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert up.suite_models(_parse("/m/dir")) == ("/m/dir", "/m/dir")
    assert up.suite_models(_parse("/m/x.gguf", "--tokenizer", "/m/dir", "-q", "gguf")) == ("/m/dir", "/m/x.gguf")
    with pytest.raises(ValueError, match=r"is a \.gguf file: give --tokenizer DIR"):
        up.suite_models(_parse("/m/x.gguf"))
