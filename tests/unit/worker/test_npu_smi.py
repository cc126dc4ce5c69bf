"""npu_smi: parsing recorded ``npu-smi info`` outputs, odd input, and running the tool (fake on PATH)."""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.worker import cpu_binding
from services.worker.telemetry import npu_smi
from services.worker.telemetry.npu_smi import ChipReading, TelemetryError, parse_npu_smi_info, read_npu_smi
from tests.support.fake_npu_smi import install_fake_npu_smi, path_with

DATA = Path(__file__).resolve().parents[2] / "data" / "npu_smi"
MS_SWIFT_910B3 = DATA / "info_910b3_8x_ms_swift.txt"
ARTHURCHIAO_910B1 = DATA / "info_910b1_8x_arthurchiao.txt"
VLLM_ASCEND_910PROB = DATA / "info_910prob_8x_vllm_ascend_1047.txt"
VLLM_ASCEND_A3 = DATA / "info_ascend910_a3_16chip_vllm_ascend_2667.txt"
OPENYUANRONG_910A_WARNING = DATA / "info_910a_warning_openyuanrong_fixture.txt"
HPCKURT_310 = DATA / "info_310_1x_hpckurt.txt"
ALARM_DERIVED = DATA / "info_910b3_alarm_derived.txt"
HOT_88C_DERIVED = DATA / "info_910b3_88c_derived.txt"
TOPO_UNSUPPORTED = DATA / "topo_unsupported_openyuanrong_fixture.txt"

MIB = 1024 * 1024


def _readings(path: Path) -> list[ChipReading]:
    parsed = parse_npu_smi_info(path.read_text())
    assert isinstance(parsed, list), parsed
    return parsed


def _one(text: str) -> ChipReading:
    parsed = parse_npu_smi_info(text)
    assert isinstance(parsed, list) and len(parsed) == 1, parsed
    return parsed[0]


def _reason(result: object) -> str:
    assert isinstance(result, TelemetryError), result
    return result.reason


def _by_chip(readings: Sequence[ChipReading]) -> dict[tuple[str, str], ChipReading]:
    return {(r.card, r.chip): r for r in readings}


# --- recorded outputs ---------------------------------------------------------------------------


def test_every_recorded_info_output_parses_into_readings() -> None:
    files = sorted(DATA.glob("info_*.txt"))
    assert len(files) >= 8
    for path in files:
        readings = _readings(path)
        assert readings, path
        assert all(isinstance(r, ChipReading) for r in readings)


def test_ms_swift_910b3_exact_numbers() -> None:
    readings = _readings(MS_SWIFT_910B3)
    # (card, power W, temp C, HBM used MB) as printed; every chip is chip 0 of a 64 GB 910B3.
    expected = [
        ("0", 101.8, 43.0, 3318),
        ("1", 92.0, 39.0, 3314),
        ("2", 102.0, 40.0, 3314),
        ("3", 99.8, 40.0, 3314),
        ("4", 98.6, 45.0, 3314),
        ("5", 99.7, 44.0, 3314),
        ("6", 103.8, 45.0, 3314),
        ("7", 98.2, 44.0, 3315),
    ]
    assert [(r.card, r.power_watts, r.temperature_celsius, r.hbm_used_bytes) for r in readings] == [
        (card, power, temp, used * MIB) for card, power, temp, used in expected
    ]
    for r in readings:
        assert r.chip == "0"
        assert r.device_name == "910B3"
        assert r.healthy is True
        assert r.health == "OK"
        assert r.hbm_total_bytes == 65536 * MIB
        assert r.aicore_utilization == 0.0


def test_arthurchiao_910b1_with_elided_rows() -> None:
    # The blog replaced cards 2-6 with "..."; only the printed cards come back.
    readings = _readings(ARTHURCHIAO_910B1)
    assert [(r.card, r.chip, r.device_name) for r in readings] == [
        ("0", "0", "910B1"),
        ("1", "0", "910B1"),
        ("7", "0", "910B1"),
    ]
    assert [r.power_watts for r in readings] == [88.4, 92.1, 92.7]
    assert [r.temperature_celsius for r in readings] == [46.0, 47.0, 48.0]
    assert [r.hbm_used_bytes for r in readings] == [4175 * MIB, 4175 * MIB, 4174 * MIB]
    assert all(r.hbm_total_bytes == 65536 * MIB and r.healthy for r in readings)


def test_910prob_reads_hbm_not_the_device_os_memory_and_skips_the_process_table() -> None:
    readings = _readings(VLLM_ASCEND_910PROB)
    # Memory-Usage (2387 / 13553, ...) is the device OS's DDR; the model's memory is the HBM column.
    assert [r.hbm_used_bytes for r in readings] == [n * MIB for n in (18, 8, 5, 4, 10, 14, 3, 2)]
    assert {r.hbm_total_bytes for r in readings} == {32768 * MIB}
    assert [r.power_watts for r in readings] == [78.0, 75.8, 78.2, 76.5, 78.8, 77.0, 83.0, 77.3]
    assert [r.temperature_celsius for r in readings] == [38.0, 38.0, 39.0, 39.0, 38.0, 38.0, 40.0, 38.0]
    # Eight cards, then "No running processes found in NPU 0..7": none of those lines is a card.
    assert [r.card for r in readings] == [str(i) for i in range(8)]
    assert {r.device_name for r in readings} == {"910ProB"}


def test_a3_two_chips_per_card_and_dash_power() -> None:
    readings = _readings(VLLM_ASCEND_A3)
    assert [(r.card, r.chip) for r in readings] == [(str(c), str(k)) for c in range(8) for k in (0, 1)]
    chips = _by_chip(readings)
    # The card's power is printed on chip 0; chip 1 shows "-".
    assert [chips[(str(c), "0")].power_watts for c in range(8)] == [
        178.9,
        186.1,
        176.3,
        177.9,
        180.9,
        189.1,
        183.0,
        186.2,
    ]
    assert all(chips[(str(c), "1")].power_watts is None for c in range(8))
    assert chips[("0", "0")].temperature_celsius == 36.0
    assert chips[("2", "1")].temperature_celsius == 37.0
    assert chips[("6", "0")].temperature_celsius == 38.0
    assert chips[("0", "0")].hbm_used_bytes == 3412 * MIB
    assert chips[("0", "1")].hbm_used_bytes == 3189 * MIB
    assert chips[("7", "1")].hbm_used_bytes == 3188 * MIB
    assert {r.hbm_total_bytes for r in readings} == {65536 * MIB}
    # The second number of "1     15" is the physical id, not the chip.
    assert chips[("7", "1")].chip == "1"
    assert {r.device_name for r in readings} == {"Ascend910"}
    assert all(r.healthy for r in readings)


def test_910a_warning_fixture_is_unhealthy() -> None:
    readings = _readings(OPENYUANRONG_910A_WARNING)
    assert [(r.card, r.healthy, r.health) for r in readings] == [(str(i), False, "Warning") for i in range(4)]
    assert [r.power_watts for r in readings] == [72.0, 70.2, 70.8, 68.8]
    assert [r.temperature_celsius for r in readings] == [39.0, 37.0, 37.0, 39.0]
    # "30750/ 32768" (no space before the slash) is still one pair.
    assert [r.hbm_used_bytes for r in readings] == [3 * MIB, 3 * MIB, 30750 * MIB, 0]
    assert {r.hbm_total_bytes for r in readings} == {32768 * MIB}


def test_310_uses_memory_usage_as_device_memory() -> None:
    (reading,) = _readings(HPCKURT_310)
    assert reading == ChipReading(
        card="0",
        chip="0",
        device_name="310",
        healthy=True,
        health="OK",
        temperature_celsius=61.0,
        power_watts=12.8,
        aicore_utilization=0.0,
        hbm_used_bytes=577 * MIB,
        hbm_total_bytes=7759 * MIB,
    )


def test_alarm_derived_marks_only_that_card_unhealthy() -> None:
    readings = _readings(ALARM_DERIVED)
    assert [r.card for r in readings if not r.healthy] == ["5"]
    alarm = _by_chip(readings)[("5", "0")]
    assert alarm.health == "Alarm"
    # Only the Health field was changed from the ms-swift capture.
    original = _by_chip(_readings(MS_SWIFT_910B3))[("5", "0")]
    assert dataclasses.replace(alarm, healthy=True, health="OK") == original


def test_88c_derived_changes_only_card_4_temperature() -> None:
    hot = _readings(HOT_88C_DERIVED)
    original = _readings(MS_SWIFT_910B3)
    assert _by_chip(hot)[("4", "0")].temperature_celsius == 88.0
    assert max(r.temperature_celsius or 0.0 for r in hot) == 88.0
    assert [r for r in hot if r.card != "4"] == [r for r in original if r.card != "4"]


# --- odd input ----------------------------------------------------------------------------------

HEADER = (
    "| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|\n"
    "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |\n"
    "+===========================+===============+====================================================+\n"
)


def test_na_fields_parse_to_none_and_unhealthy() -> None:
    text = (
        HEADER + "| 3     910B3               | NA            | NA          NA                NA   / NA            |\n"
        "| 0                         | 0000:82:00.0  | NA          NA   / NA         NA   / NA            |\n"
    )
    reading = _one(text)
    assert reading == ChipReading(
        card="3",
        chip="0",
        device_name="910B3",
        healthy=False,
        health="NA",
        temperature_celsius=None,
        power_watts=None,
        aicore_utilization=None,
        hbm_used_bytes=None,
        hbm_total_bytes=None,
    )


@pytest.mark.parametrize("health", ["Alarm", "Critical", "Warning", "NA", ""])
def test_any_health_but_ok_is_unhealthy(health: str) -> None:
    text = (
        HEADER + f"| 0     910B3               | {health:<14}| 101.8       43                0    / 0             |\n"
        "| 0                         | 0000:C1:00.0  | 0           0    / 0          3318 / 65536         |\n"
    )
    parsed = parse_npu_smi_info(text)
    assert isinstance(parsed, list)
    assert parsed[0].healthy is False
    assert parsed[0].health == health
    assert parsed[0].temperature_celsius == 43.0


def test_cut_off_rows_keep_what_was_printed() -> None:
    # The shape of openyuanrong's wrongNpuMem fixture: each row ends after its first number.
    text = (
        HEADER + "| 0     910A           | Warning       | 72.0\n"
        "| 0                    | 0000:C1:00.0  | 0\n"
        "+======================+===============+====================================================+\n"
    )
    reading = _one(text)
    assert reading.power_watts == 72.0
    assert reading.temperature_celsius is None
    assert reading.aicore_utilization == 0.0
    assert reading.hbm_used_bytes is None and reading.hbm_total_bytes is None


def test_card_row_without_its_chip_row() -> None:
    text = (
        HEADER + "| 0     910B3               | OK            | 101.8       43                0    / 0             |\n"
    )
    reading = _one(text)
    assert (reading.card, reading.chip, reading.temperature_celsius, reading.hbm_used_bytes) == ("0", "0", 43.0, None)


def test_aicore_percent_becomes_a_ratio() -> None:
    text = (
        HEADER + "| 0     910B3               | OK            | 101.8       43                0    / 0             |\n"
        "| 0                         | 0000:C1:00.0  | 37          0    / 0          3318 / 65536         |\n"
    )
    reading = _one(text)
    assert reading.aicore_utilization == pytest.approx(0.37)


@pytest.mark.parametrize(
    "text",
    ["", "\n\n", "segfault\n", "dcmi module initialize failed. ret is -8005\n", HEADER, "| | | |\n" * 4],
)
def test_output_without_device_rows_is_an_error(text: str) -> None:
    assert isinstance(parse_npu_smi_info(text), TelemetryError)


def test_unsupported_refusal_is_an_error_naming_it() -> None:
    assert "does not support querying topo" in _reason(parse_npu_smi_info(TOPO_UNSUPPORTED.read_text()))


def test_every_prefix_of_every_recording_parses_without_raising() -> None:
    for path in sorted(DATA.glob("info_*.txt")):
        text = path.read_text()
        for end in range(0, len(text), 7):
            assert isinstance(parse_npu_smi_info(text[:end]), list | TelemetryError)


def test_garbage_does_not_raise() -> None:
    for text in ("|" * 500, "| Health | Temp(C) |\n| x | y | z |\n", "\x00\xff|Health|Temp(C)\n|1 a|OK|1 / 2 / 3\n"):
        assert isinstance(parse_npu_smi_info(text), list | TelemetryError)


# --- running npu-smi ----------------------------------------------------------------------------


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty directory that alone is on PATH: npu-smi exists only if a test installs it there."""
    directory = tmp_path / "bin"
    directory.mkdir()
    monkeypatch.setenv("PATH", str(directory))
    return directory


def test_reads_a_fake_npu_smi_on_path(fake_bin: Path) -> None:
    install_fake_npu_smi(fake_bin, VLLM_ASCEND_A3)
    assert read_npu_smi(timeout=30) == _readings(VLLM_ASCEND_A3)


def test_tool_missing_from_path(fake_bin: Path) -> None:
    assert read_npu_smi() == TelemetryError("npu-smi not found")


def test_tool_timing_out(fake_bin: Path) -> None:
    install_fake_npu_smi(fake_bin, MS_SWIFT_910B3, delay_s=60)
    assert "timed out after 0.5s" in _reason(read_npu_smi(timeout=0.5))


def test_non_zero_exit(fake_bin: Path, tmp_path: Path) -> None:
    output = tmp_path / "error.txt"
    output.write_text("dcmi module initialize failed. ret is -8005\n")
    install_fake_npu_smi(fake_bin, output, exit_code=3)
    reason = _reason(read_npu_smi(timeout=30))
    assert "exited 3" in reason
    assert "-8005" in reason


def test_non_zero_exit_with_a_refusal(fake_bin: Path) -> None:
    install_fake_npu_smi(fake_bin, TOPO_UNSUPPORTED, exit_code=255)
    assert "does not support querying topo" in _reason(read_npu_smi(timeout=30))


def test_runner_failures_are_errors_not_raised(fake_bin: Path) -> None:
    install_fake_npu_smi(fake_bin, MS_SWIFT_910B3)

    def missing(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(cmd[0])

    def slow(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(list(cmd), timeout)

    def denied(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        raise PermissionError("denied")

    assert read_npu_smi(runner=missing) == TelemetryError("npu-smi not found")
    assert "timed out after 3s" in _reason(read_npu_smi(runner=slow))
    assert "could not run" in _reason(read_npu_smi(runner=denied))


def test_runs_info_from_the_path_it_found(fake_bin: Path) -> None:
    script = install_fake_npu_smi(fake_bin, MS_SWIFT_910B3)
    calls: list[tuple[list[str], float]] = []

    def record(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        calls.append((list(cmd), timeout))
        return subprocess.CompletedProcess(list(cmd), 0, MS_SWIFT_910B3.read_text(), "")

    assert read_npu_smi(timeout=2.5, runner=record) == _readings(MS_SWIFT_910B3)
    assert calls == [([str(script), "info"], 2.5)]


def test_fake_tool_refuses_topo_so_cpu_binding_falls_back(fake_bin: Path) -> None:
    install_fake_npu_smi(fake_bin, MS_SWIFT_910B3)
    topo = cpu_binding.query_npu_topology()
    assert isinstance(topo, cpu_binding.TopoUnsupported)
    assert "does not support querying topo" in topo.reason


def test_fake_tool_serves_the_file_as_it_is_now(fake_bin: Path, tmp_path: Path) -> None:
    output = tmp_path / "now.txt"
    output.write_text(MS_SWIFT_910B3.read_text())
    install_fake_npu_smi(fake_bin, output)
    assert read_npu_smi(timeout=30) == _readings(MS_SWIFT_910B3)
    output.write_text(HOT_88C_DERIVED.read_text())
    assert read_npu_smi(timeout=30) == _readings(HOT_88C_DERIVED)


def test_path_with_puts_the_directory_first(tmp_path: Path) -> None:
    assert path_with(tmp_path, "/usr/bin:/bin") == f"{tmp_path}:/usr/bin:/bin"
    assert path_with(tmp_path, "") == str(tmp_path)


def test_telemetry_and_cpu_binding_run_one_tool() -> None:
    assert npu_smi.run_npu_smi is cpu_binding.run_npu_smi
