"""`meshserve bench` flags: parsing, validation and the in-process backends' contract."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest

from services.client.bench import command
from services.client.bench.datasets import BenchRequest
from services.client.bench.records import RequestRecord
from tests.unit.client.bench_cli import bench_parse_error, parse_bench, tiny_model_config

_parse = parse_bench
_parse_error = bench_parse_error


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tiny_model_config(tmp_path)


def test_defaults() -> None:
    ns = _parse()
    assert ns.address == "127.0.0.1:50051"
    assert ns.backend == "meshserve"
    assert ns.dataset == "random"
    assert ns.num_prompts == 100
    assert math.isinf(ns.request_rate)
    assert ns.burstiness == 1.0
    assert ns.max_concurrency is None
    assert ns.goodput is None
    assert ns.dtype == "float32"
    assert ns.scheduler_address is None
    assert (ns.num_conversations, ns.num_turns, ns.turn_input_len, ns.turn_output_len) == (8, 6, (200, 200), (64, 64))


@pytest.mark.parametrize(("text", "expected"), [("7", (7, 7)), ("5-40", (5, 40)), (" 3-3 ", (3, 3))])
def test_length_ranges(text: str, expected: tuple[int, int]) -> None:
    assert command.length_range(text) == expected
    assert _parse("--random-input-len", text).random_input_len == expected


@pytest.mark.parametrize("text", ["0", "9-3", "a", "1-", "-4", "2-x", "1.5"])
def test_bad_length_ranges_name_the_flag(capsys: pytest.CaptureFixture[str], text: str) -> None:
    assert "--random-output-len" in _parse_error(capsys, f"--random-output-len={text}")


@pytest.mark.parametrize(("text", "rate"), [("inf", math.inf), ("INF", math.inf), ("2.5", 2.5), ("10", 10.0)])
def test_request_rate(text: str, rate: float) -> None:
    assert _parse("--request-rate", text).request_rate == rate


@pytest.mark.parametrize("text", ["0", "-1", "nan", "fast"])
def test_bad_request_rate(capsys: pytest.CaptureFixture[str], text: str) -> None:
    assert "--request-rate" in _parse_error(capsys, f"--request-rate={text}")


@pytest.mark.parametrize(("flag", "value"), [("--burstiness", "0"), ("--burstiness", "inf"), ("--num-prompts", "0"),
                                             ("--max-concurrency", "0"), ("--num-warmups", "-1"), ("--backend", "vllm"),
                                             ("--dataset", "sharegpt"), ("--dtype", "float16"),
                                             ("--num-conversations", "0"), ("--num-turns", "0"),
                                             ("--turn-input-len", "5-2"), ("--turn-output-len", "0")])  # fmt: skip
def test_other_bad_values_name_the_flag(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    assert flag in _parse_error(capsys, f"{flag}={value}")


def test_goodput_parsing() -> None:
    ns = _parse("--goodput", "ttft:500", "TPOT:50", "e2el:2000.5", "itl:80")
    assert command.goodput_slos(ns.goodput) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.5, "itl": 80.0}
    assert command.goodput_slos(None) is None


@pytest.mark.parametrize("text", ["ttft", "latency:5", "ttft:x", "ttft:0", "tpot:-3", "ttft:inf"])
def test_bad_goodput(capsys: pytest.CaptureFixture[str], text: str) -> None:
    assert "--goodput" in _parse_error(capsys, "--goodput", text)


async def test_repeated_goodput_metric_exits_2(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    ns = _parse("--model", str(model_dir), "--goodput", "ttft:5", "ttft:6")
    assert await command.main(ns) == 2
    assert "--goodput: ttft given more than once" in capsys.readouterr().err


async def test_missing_model_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert await command.main(_parse("--model", str(tmp_path / "nope"))) == 2
    assert "--model" in capsys.readouterr().err
    assert await command.main(_parse("--model", str(tmp_path))) == 2
    assert "config.json" in capsys.readouterr().err


async def test_jsonl_needs_a_path(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    assert await command.main(_parse("--model", str(model_dir), "--dataset", "jsonl")) == 2
    assert "--dataset-path is required" in capsys.readouterr().err


def test_workloads_from_flags(model_dir: Path) -> None:
    ns = _parse(
        "--model", str(model_dir), "--num-prompts", "9", "--random-input-len", "5-8", "--random-output-len", "3"
    )
    requests = command.build_workload(ns, model_dir)
    assert len(requests) == 9
    assert all(5 <= len(r.prompt_token_ids) <= 8 and r.output_len == 3 for r in requests)
    assert all(t < 300 for r in requests for t in r.prompt_token_ids)
    ns = _parse("--model", str(model_dir), "--dataset", "shared-prefix", "--num-prompts", "4",
                "--shared-prefix-len", "16", "--shared-suffix-len", "2-4", "--shared-output-len", "6")  # fmt: skip
    requests = command.build_workload(ns, model_dir)
    assert len(requests) == 4
    assert len({tuple(r.prompt_token_ids[:16]) for r in requests}) == 1
    assert all(18 <= len(r.prompt_token_ids) <= 20 and r.output_len == 6 for r in requests)


def test_multi_turn_workload_from_flags(model_dir: Path) -> None:
    ns = _parse("--model", str(model_dir), "--dataset", "multi-turn", "--num-conversations", "3", "--num-turns", "4",
                "--turn-input-len", "6-9", "--turn-output-len", "2", "--seed", "5")  # fmt: skip
    conversations = command.build_conversations(ns, model_dir)
    assert [len(c) for c in conversations] == [4] * 3
    assert all(6 <= len(c[0].prompt_token_ids) <= 9 for c in conversations)
    assert all(t.output_len == 2 for c in conversations for t in c)
    assert all(t < 300 for c in conversations for r in c for t in r.prompt_token_ids)
    assert command.build_conversations(ns, model_dir) == conversations
    # Single-turn datasets become one conversation per request.
    ns = _parse("--model", str(model_dir), "--num-prompts", "4", "--random-input-len", "3", "--random-output-len", "1")
    assert command.build_conversations(ns, model_dir) == [[r] for r in command.build_workload(ns, model_dir)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "multi-turn", "--backend", "transformers"], "--dataset multi-turn needs --backend meshserve"),
        (["--scheduler-address", "127.0.0.1:1", "--backend", "raw-runner"], "--scheduler-address needs --backend"),
    ],
)
async def test_meshserve_only_flags_exit_2_elsewhere(
    capsys: pytest.CaptureFixture[str], model_dir: Path, args: list[str], message: str
) -> None:
    assert await command.main(_parse("--model", str(model_dir), *args)) == 2
    assert message in capsys.readouterr().err


def test_jsonl_workload_uses_the_model_tokenizer(tmp_path: Path) -> None:
    from tests.unit.gateway import build_tiny_model_dir

    model = build_tiny_model_dir(tmp_path / "tok")
    data = tmp_path / "w.jsonl"
    data.write_text(
        json.dumps({"prompt": "Hello world"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi"}], "output_len": 3}) + "\n"
    )  # fmt: skip
    ns = _parse("--model", str(model), "--dataset", "jsonl", "--dataset-path", str(data), "--jsonl-output-len", "9")
    requests = command.build_workload(ns, model)
    assert [r.output_len for r in requests] == [9, 3]
    assert all(r.prompt_token_ids for r in requests)
    data.write_text('{"prompt": 1}\n{oops\n')
    with pytest.raises(command.UsageError, match=r"--dataset-path.*not JSON"):
        command.build_workload(ns, model)


@pytest.mark.parametrize(
    ("backend", "module", "function"),
    [
        ("transformers", "services.worker.benchmarks.transformers_baseline", "run_transformers_baseline"),
        ("raw-runner", "services.worker.benchmarks.raw_runner", "run_raw_runner"),
    ],
)
async def test_in_process_backends_get_the_workload(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    model_dir: Path,
    tmp_path: Path,
    backend: str,
    module: str,
    function: str,
) -> None:
    calls: list[tuple[Path, list[BenchRequest], int, str, bool]] = []

    def fake(
        model: Path, requests: list[BenchRequest], batch_size: int, dtype: str, progress: bool
    ) -> tuple[list[RequestRecord], float]:
        calls.append((model, requests, batch_size, dtype, progress))
        records = [
            RequestRecord(len(r.prompt_token_ids), r.output_len, 0.0, [0.1 * (i + 1) for i in range(r.output_len)])
            for r in requests
        ]
        return records, 2.0

    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{function: fake}))
    out = tmp_path / "r.json"
    args = ["--backend", backend, "--model", str(model_dir), "--num-prompts", "3", "--random-input-len", "4",
            "--random-output-len", "2", "--dtype", "bfloat16", "--no-progress", "--save-result", str(out)]  # fmt: skip
    assert await command.main(_parse(*args)) == 0
    (model, requests, batch_size, dtype, progress) = calls[0]
    assert (model, batch_size, dtype, progress) == (model_dir, 1, "bfloat16", False)
    assert [(len(r.prompt_token_ids), r.output_len) for r in requests] == [(4, 2)] * 3
    data = json.loads(out.read_text())
    assert data["backend"] == backend
    assert data["completed"] == 3
    assert data["total_output_tokens"] == 6
    assert data["request_throughput"] == 1.5
    assert data["max_concurrency"] == 1
    assert data["dtype"] == "bfloat16"
    assert "Successful requests:                     3" in capsys.readouterr().out
    calls.clear()
    assert await command.main(_parse(*args, "--max-concurrency", "4")) == 0
    assert calls[0][2] == 4
