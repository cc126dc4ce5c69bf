"""nvml: the NVML reader against a fake ``pynvml`` module (no GPU here), and the real one without a driver."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from services.worker.telemetry.npu_smi import ChipReading, TelemetryError
from services.worker.telemetry.nvml import NvmlReader, read_nvml

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_UNKNOWN = 999
NVML_ERROR_GPU_IS_LOST = 15
GIB = 1024**3


class FakeNVMLError(Exception):
    """pynvml.NVMLError's shape: the NVML return code in ``.value``."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_GPU_IS_LOST: "GPU is lost"}.get(
            self.value, f"NVML error {self.value}"
        )


@dataclass
class FakeGpu:
    name: str | bytes = "NVIDIA H200"
    temperature: int = 41
    power_mw: int = 123_456
    used: int = 10 * GIB
    total: int = 141 * GIB
    gpu_util: int = 37
    # call name -> NVML error code that call raises for this GPU
    fails: dict[str, int] = field(default_factory=dict)


class FakePynvml:
    """The subset of pynvml the reader calls, with call counts for init/shutdown."""

    NVML_TEMPERATURE_GPU = 0
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[FakeGpu], *, init_error: int | None = None, count_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.count_error = count_error
        self.inits = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise FakeNVMLError(self.count_error)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        gpu = self.gpus[index]
        self._maybe_fail(gpu, "handle")
        return gpu

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str | bytes:
        self._maybe_fail(handle, "name")
        return handle.name

    def nvmlDeviceGetTemperature(self, handle: FakeGpu, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        self._maybe_fail(handle, "temperature")
        return handle.temperature

    def nvmlDeviceGetPowerUsage(self, handle: FakeGpu) -> int:
        self._maybe_fail(handle, "power")
        return handle.power_mw

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> Any:
        self._maybe_fail(handle, "memory")
        return SimpleNamespace(used=handle.used, total=handle.total, free=handle.total - handle.used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu) -> Any:
        self._maybe_fail(handle, "utilization")
        return SimpleNamespace(gpu=handle.gpu_util, memory=5)

    @staticmethod
    def _maybe_fail(gpu: FakeGpu, call: str) -> None:
        if call in gpu.fails:
            raise FakeNVMLError(gpu.fails[call])


def _readings(result: object) -> list[ChipReading]:
    assert isinstance(result, list), result
    return result


def _reason(result: object) -> str:
    assert isinstance(result, TelemetryError), result
    return result.reason


def test_two_gpus_map_onto_chip_readings() -> None:
    fake = FakePynvml(
        [FakeGpu(), FakeGpu(name=b"NVIDIA A100-SXM4-80GB", temperature=88, power_mw=400_000, gpu_util=100)]
    )
    readings = _readings(NvmlReader(fake)())
    assert readings == [
        ChipReading(
            card="0",
            chip="0",
            device_name="NVIDIA H200",
            healthy=True,
            health="OK",
            temperature_celsius=41.0,
            power_watts=123.456,
            aicore_utilization=0.37,
            hbm_used_bytes=10 * GIB,
            hbm_total_bytes=141 * GIB,
        ),
        ChipReading(
            card="1",
            chip="0",
            device_name="NVIDIA A100-SXM4-80GB",
            healthy=True,
            health="OK",
            temperature_celsius=88.0,
            power_watts=400.0,
            aicore_utilization=1.0,
            hbm_used_bytes=10 * GIB,
            hbm_total_bytes=141 * GIB,
        ),
    ]


def test_a_failing_call_marks_that_gpu_unhealthy_and_keeps_the_rest() -> None:
    fake = FakePynvml([FakeGpu(), FakeGpu(fails={"temperature": NVML_ERROR_UNKNOWN})])
    first, second = _readings(NvmlReader(fake)())
    assert first.healthy is True
    assert second.healthy is False
    assert second.health.startswith("NVMLError: temperature")
    assert second.temperature_celsius is None
    assert second.power_watts == 123.456
    assert second.hbm_total_bytes == 141 * GIB


def test_not_supported_is_a_missing_field_not_a_sick_gpu() -> None:
    fake = FakePynvml([FakeGpu(fails={"power": NVML_ERROR_NOT_SUPPORTED})])
    (reading,) = _readings(NvmlReader(fake)())
    assert reading.power_watts is None
    assert reading.healthy is True
    assert reading.health == "OK"
    assert reading.temperature_celsius == 41.0


def test_a_lost_gpu_without_a_handle() -> None:
    fake = FakePynvml([FakeGpu(fails={"handle": NVML_ERROR_GPU_IS_LOST}), FakeGpu()])
    lost, fine = _readings(NvmlReader(fake)())
    assert lost == ChipReading(
        card="0",
        chip="0",
        device_name="",
        healthy=False,
        health="NVMLError: nvmlDeviceGetHandleByIndex: GPU is lost",
        temperature_celsius=None,
        power_watts=None,
        aicore_utilization=None,
        hbm_used_bytes=None,
        hbm_total_bytes=None,
    )
    assert fine.healthy is True


def test_init_failure_is_an_error_and_is_retried() -> None:
    fake = FakePynvml([FakeGpu()], init_error=NVML_ERROR_UNKNOWN)
    reader = NvmlReader(fake)
    assert "nvmlInit failed" in _reason(reader())
    fake.init_error = None
    assert len(_readings(reader())) == 1
    assert fake.inits == 1


def test_init_once_across_reads_and_shutdown_on_close() -> None:
    fake = FakePynvml([FakeGpu()])
    reader = NvmlReader(fake)
    for _ in range(3):
        _readings(reader())
    assert fake.inits == 1
    reader.close()
    reader.close()
    assert fake.shutdowns == 1
    # A read after close initialises again.
    _readings(reader())
    assert fake.inits == 2


def test_close_before_any_read_does_nothing() -> None:
    fake = FakePynvml([FakeGpu()])
    NvmlReader(fake).close()
    assert fake.shutdowns == 0


def test_count_failure_reinitialises_next_time() -> None:
    fake = FakePynvml([FakeGpu()], count_error=NVML_ERROR_UNINITIALIZED)
    reader = NvmlReader(fake)
    assert "nvmlDeviceGetCount failed" in _reason(reader())
    fake.count_error = None
    _readings(reader())
    assert fake.inits == 2


def test_no_gpus_is_an_error() -> None:
    assert _reason(NvmlReader(FakePynvml([]))()) == "NVML reports no GPUs"


def test_unexpected_exceptions_never_escape() -> None:
    fake = FakePynvml([FakeGpu()])

    def broken() -> int:
        raise RuntimeError("binding surprise")

    fake.nvmlDeviceGetCount = broken  # type: ignore[method-assign]
    assert "binding surprise" in _reason(NvmlReader(fake)())


def test_pynvml_is_imported_lazily_from_sys_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePynvml([FakeGpu()])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    reader = NvmlReader()
    assert _readings(reader())[0].device_name == "NVIDIA H200"


def test_pynvml_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes the import raise ImportError, as if nvidia-ml-py were not installed.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert "pynvml is not installed" in _reason(NvmlReader()())


def test_read_nvml_shuts_down_after_one_read() -> None:
    fake = FakePynvml([FakeGpu()])
    assert len(_readings(read_nvml(fake))) == 1
    assert (fake.inits, fake.shutdowns) == (1, 1)


def test_the_real_pynvml_never_raises() -> None:
    # Here there is no NVIDIA driver, so this is an error result; on a GPU machine it reads the GPUs.
    result = read_nvml()
    if isinstance(result, TelemetryError):
        assert result.reason
    else:
        assert result and all(isinstance(r, ChipReading) and r.chip == "0" for r in result)
