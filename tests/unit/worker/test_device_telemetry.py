"""DeviceTelemetry: gauges set and removed from readings, telemetry_up, CPU exports nothing, the thread."""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from structlog.testing import capture_logs

from services.worker.telemetry.device_telemetry import DeviceTelemetry
from services.worker.telemetry.npu_smi import ChipReading, ReadResult, TelemetryError, parse_npu_smi_info
from tests.support.fake_npu_smi import install_fake_npu_smi
from tests.unit.worker.test_nvml_telemetry import FakeGpu, FakePynvml

DATA = Path(__file__).resolve().parents[2] / "data" / "npu_smi"
MS_SWIFT_910B3 = DATA / "info_910b3_8x_ms_swift.txt"
VLLM_ASCEND_A3 = DATA / "info_ascend910_a3_16chip_vllm_ascend_2667.txt"
HOT_88C_DERIVED = DATA / "info_910b3_88c_derived.txt"
ALARM_DERIVED = DATA / "info_910b3_alarm_derived.txt"
MIB = 1024 * 1024
# Far longer than any of these tests needs; only a broken implementation ever waits this long.
WAIT_S = 30.0

DEVICE_GAUGES = (
    "meshserve:device_temperature_celsius",
    "meshserve:device_power_watts",
    "meshserve:device_memory_used_bytes",
    "meshserve:device_memory_total_bytes",
    "meshserve:device_utilization_ratio",
    "meshserve:device_healthy",
)


def _recorded(path: Path) -> list[ChipReading]:
    parsed = parse_npu_smi_info(path.read_text())
    assert isinstance(parsed, list)
    return parsed


class Script:
    """A reader that returns what the test queued (the last result repeats), counting calls."""

    def __init__(self, *results: ReadResult) -> None:
        self.results = list(results)
        self.calls = 0
        self.closed = 0

    def __call__(self) -> ReadResult:
        self.calls += 1
        return self.results.pop(0) if len(self.results) > 1 else self.results[0]

    def close(self) -> None:
        self.closed += 1


def _telemetry(registry: CollectorRegistry, reader: object, platform: str = "npu") -> DeviceTelemetry:
    return DeviceTelemetry(registry, platform, model_name="m", worker="w0", reader=reader)  # type: ignore[arg-type]


def _chip(card: str, chip: str = "0", device: str = "910B3", platform: str = "npu") -> dict[str, str]:
    return {"model_name": "m", "worker": "w0", "platform": platform, "card": card, "chip": chip, "device_name": device}


def _up(registry: CollectorRegistry, platform: str = "npu") -> float | None:
    return registry.get_sample_value(
        "meshserve:device_telemetry_up", {"model_name": "m", "worker": "w0", "platform": platform}
    )


def _series(registry: CollectorRegistry, name: str) -> list[dict[str, str]]:
    return [s.labels for m in registry.collect() for s in m.samples if s.name == name]


# --- gauges from readings -----------------------------------------------------------------------


def test_recorded_910b3_sets_every_gauge() -> None:
    registry = CollectorRegistry()
    telemetry = _telemetry(registry, Script(_recorded(MS_SWIFT_910B3)))
    telemetry.poll_once()
    get = registry.get_sample_value
    assert get("meshserve:device_temperature_celsius", _chip("0")) == 43.0
    assert get("meshserve:device_temperature_celsius", _chip("4")) == 45.0
    assert get("meshserve:device_power_watts", _chip("6")) == 103.8
    assert get("meshserve:device_memory_used_bytes", _chip("7")) == 3315 * MIB
    assert get("meshserve:device_memory_total_bytes", _chip("0")) == 65536 * MIB
    assert get("meshserve:device_utilization_ratio", _chip("3")) == 0.0
    assert get("meshserve:device_healthy", _chip("5")) == 1.0
    assert _up(registry) == 1.0
    for name in DEVICE_GAUGES:
        assert len(_series(registry, name)) == 8, name


def test_unhealthy_chip_reads_zero() -> None:
    registry = CollectorRegistry()
    _telemetry(registry, Script(_recorded(ALARM_DERIVED))).poll_once()
    assert registry.get_sample_value("meshserve:device_healthy", _chip("5")) == 0.0
    assert registry.get_sample_value("meshserve:device_healthy", _chip("4")) == 1.0


def test_none_fields_leave_their_series_absent() -> None:
    registry = CollectorRegistry()
    _telemetry(registry, Script(_recorded(VLLM_ASCEND_A3))).poll_once()
    # A3 prints the card's power on chip 0 only; chip 1's "-" is no series, not a zero.
    assert registry.get_sample_value("meshserve:device_power_watts", _chip("2", "0", "Ascend910")) == 176.3
    assert registry.get_sample_value("meshserve:device_power_watts", _chip("2", "1", "Ascend910")) is None
    assert len(_series(registry, "meshserve:device_power_watts")) == 8
    assert len(_series(registry, "meshserve:device_temperature_celsius")) == 16


def test_series_of_a_vanished_chip_or_a_value_turned_none_are_removed() -> None:
    readings = _recorded(MS_SWIFT_910B3)
    without_card_7 = readings[:7]
    card_0_unreadable = [dataclasses.replace(readings[0], temperature_celsius=None), *readings[1:7]]
    registry = CollectorRegistry()
    telemetry = _telemetry(registry, Script(readings, without_card_7, card_0_unreadable))
    telemetry.poll_once()
    assert registry.get_sample_value("meshserve:device_temperature_celsius", _chip("7")) == 44.0
    telemetry.poll_once()
    for name in DEVICE_GAUGES:
        assert registry.get_sample_value(name, _chip("7")) is None, name
    assert registry.get_sample_value("meshserve:device_temperature_celsius", _chip("0")) == 43.0
    telemetry.poll_once()
    assert registry.get_sample_value("meshserve:device_temperature_celsius", _chip("0")) is None
    assert registry.get_sample_value("meshserve:device_power_watts", _chip("0")) == 101.8
    assert _up(registry) == 1.0


def test_a_renamed_device_replaces_its_series() -> None:
    first = _recorded(MS_SWIFT_910B3)[:1]
    renamed = [dataclasses.replace(first[0], device_name="910B4")]
    registry = CollectorRegistry()
    telemetry = _telemetry(registry, Script(first, renamed))
    telemetry.poll_once()
    telemetry.poll_once()
    assert registry.get_sample_value("meshserve:device_healthy", _chip("0", device="910B3")) is None
    assert registry.get_sample_value("meshserve:device_healthy", _chip("0", device="910B4")) == 1.0


def test_names_survive_the_text_exposition() -> None:
    registry = CollectorRegistry()
    _telemetry(registry, Script(_recorded(MS_SWIFT_910B3))).poll_once()
    text = generate_latest(registry).decode()
    for name in (*DEVICE_GAUGES, "meshserve:device_telemetry_up"):
        assert f"\n{name}{{" in text, name


# --- failures -----------------------------------------------------------------------------------


def test_failed_read_sets_up_zero_and_drops_device_series() -> None:
    registry = CollectorRegistry()
    telemetry = _telemetry(registry, Script(_recorded(MS_SWIFT_910B3), TelemetryError("npu-smi timed out after 3s")))
    telemetry.poll_once()
    assert _up(registry) == 1.0
    result = telemetry.poll_once()
    assert result == TelemetryError("npu-smi timed out after 3s")
    assert _up(registry) == 0.0
    for name in DEVICE_GAUGES:
        assert _series(registry, name) == [], name


def test_warns_once_per_distinct_reason_and_logs_recovery() -> None:
    registry = CollectorRegistry()
    a, b = TelemetryError("npu-smi not found"), TelemetryError("npu-smi exited 3: 'dcmi'")
    telemetry = _telemetry(registry, Script(a, a, a, b, a, b, _recorded(MS_SWIFT_910B3)))
    with capture_logs() as logs:
        for _ in range(7):
            telemetry.poll_once()
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["reason"] for e in warnings] == [a.reason, b.reason]
    assert all(e["platform"] == "npu" for e in warnings)
    assert [e["event"] for e in logs if e["log_level"] == "info"] == ["device telemetry recovered"]
    assert _up(registry) == 1.0


def test_a_raising_reader_is_a_failed_read() -> None:
    def boom() -> ReadResult:
        raise RuntimeError("reader bug")

    registry = CollectorRegistry()
    telemetry = _telemetry(registry, boom)
    result = telemetry.poll_once()
    assert isinstance(result, TelemetryError) and "reader bug" in result.reason
    assert _up(registry) == 0.0


def test_a_reader_returning_nonsense_is_a_failed_read() -> None:
    registry = CollectorRegistry()
    result = _telemetry(registry, lambda: {"not": "readings"}).poll_once()
    assert isinstance(result, TelemetryError)
    assert _up(registry) == 0.0


# --- platforms ----------------------------------------------------------------------------------


def test_cpu_creates_nothing_and_starts_no_thread() -> None:
    registry = CollectorRegistry()
    reader = Script(_recorded(MS_SWIFT_910B3))
    telemetry = _telemetry(registry, reader, platform="cpu")
    assert telemetry.enabled is False
    telemetry.start()
    assert telemetry.running is False
    assert telemetry.poll_once() == []
    telemetry.stop()
    assert reader.calls == 0
    assert list(registry.collect()) == []
    assert generate_latest(registry) == b""


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="platform"):
        DeviceTelemetry(CollectorRegistry(), "tpu", model_name="m", worker="w0")
    with pytest.raises(ValueError, match="interval"):
        DeviceTelemetry(CollectorRegistry(), "npu", model_name="m", worker="w0", interval=0)
    with pytest.raises(ValueError, match="timeout"):
        DeviceTelemetry(CollectorRegistry(), "npu", model_name="m", worker="w0", timeout=-1)


def test_npu_default_reader_runs_npu_smi_from_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_npu_smi(tmp_path, HOT_88C_DERIVED)
    monkeypatch.setenv("PATH", str(tmp_path))
    registry = CollectorRegistry()
    DeviceTelemetry(registry, "npu", model_name="m", worker="w0", timeout=30).poll_once()
    assert registry.get_sample_value("meshserve:device_temperature_celsius", _chip("4")) == 88.0
    assert registry.get_sample_value("meshserve:device_temperature_celsius", _chip("3")) == 40.0
    assert _up(registry) == 1.0


def test_npu_default_reader_without_npu_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    registry = CollectorRegistry()
    with capture_logs() as logs:
        result = DeviceTelemetry(registry, "npu", model_name="m", worker="w0").poll_once()
    assert result == TelemetryError("npu-smi not found")
    assert _up(registry) == 0.0
    assert [e["reason"] for e in logs if e["log_level"] == "warning"] == ["npu-smi not found"]


def test_cuda_default_reader_uses_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePynvml([FakeGpu(temperature=88)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    registry = CollectorRegistry()
    telemetry = DeviceTelemetry(registry, "cuda", model_name="m", worker="w0")
    telemetry.poll_once()
    labels = _chip("0", "0", "NVIDIA H200", platform="cuda")
    assert registry.get_sample_value("meshserve:device_temperature_celsius", labels) == 88.0
    assert registry.get_sample_value("meshserve:device_utilization_ratio", labels) == 0.37
    assert _up(registry, "cuda") == 1.0
    telemetry.stop()
    assert fake.shutdowns == 1


# --- the thread ---------------------------------------------------------------------------------


def test_thread_polls_until_stopped_and_closes_the_reader() -> None:
    polled = threading.Event()
    readings = _recorded(MS_SWIFT_910B3)

    class Signalling(Script):
        def __call__(self) -> ReadResult:
            result = super().__call__()
            polled.set()
            return result

    reader = Signalling(readings)
    registry = CollectorRegistry()
    telemetry = _telemetry(registry, reader)
    telemetry.start()
    assert telemetry.running is True
    assert polled.wait(WAIT_S)
    telemetry.start()  # already running: no second thread
    assert [t.name for t in threading.enumerate()].count("device-telemetry") == 1
    telemetry.stop(join_timeout=WAIT_S)
    assert telemetry.running is False
    assert reader.calls >= 1
    assert reader.closed == 1
    assert registry.get_sample_value("meshserve:device_healthy", _chip("0")) == 1.0


def test_poll_thread_is_a_daemon_off_the_callers_thread() -> None:
    seen: list[threading.Thread] = []
    polled = threading.Event()

    def reader() -> ReadResult:
        seen.append(threading.current_thread())
        polled.set()
        return []

    telemetry = _telemetry(CollectorRegistry(), reader)
    telemetry.start()
    assert polled.wait(WAIT_S)
    telemetry.stop(join_timeout=WAIT_S)
    assert seen[0] is not threading.current_thread()
    assert seen[0].daemon is True


def test_a_slow_reader_never_blocks_start_or_stop() -> None:
    entered = threading.Event()
    release = threading.Event()

    def stuck() -> ReadResult:
        entered.set()
        release.wait(WAIT_S)
        return TelemetryError("npu-smi timed out after 3s")

    telemetry = DeviceTelemetry(CollectorRegistry(), "npu", model_name="m", worker="w0", timeout=0.01, reader=stuck)
    telemetry.start()  # returns while the first read is still running
    assert entered.wait(WAIT_S)
    telemetry.stop()  # waits at most the read timeout, then leaves the read to finish on the daemon thread
    assert telemetry.running is True  # the read is still stuck: stop did not wait for it
    release.set()
    thread = next(t for t in threading.enumerate() if t.name == "device-telemetry")
    thread.join(WAIT_S)
    assert telemetry.running is False


def test_restart_after_stop() -> None:
    polls = threading.Semaphore(0)

    def reader() -> ReadResult:
        polls.release()
        return []

    telemetry = _telemetry(CollectorRegistry(), reader)
    telemetry.start()
    assert polls.acquire(timeout=WAIT_S)
    telemetry.stop(join_timeout=WAIT_S)
    telemetry.start()
    assert polls.acquire(timeout=WAIT_S)
    telemetry.stop(join_timeout=WAIT_S)
    assert telemetry.running is False
