"""CUDA GPU readings through NVML (``pynvml`` from nvidia-ml-py): the same ChipReading as npu-smi gives.

NVML reads the driver directly, without a CUDA context, so polling it never touches the model's device
state. ``pynvml`` is imported on first use: the worker imports this module on every platform, and a CPU
or NPU host has neither the package's library nor a driver behind it.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from types import ModuleType
from typing import Any

from services.worker.telemetry.npu_smi import ChipReading, ReadResult, TelemetryError

HEALTHY = "OK"
MILLIWATTS_PER_WATT = 1000.0
# NVML's code for "this GPU has no such sensor/counter" (pynvml.NVML_ERROR_NOT_SUPPORTED); used when a
# module does not define it.
_NOT_SUPPORTED_DEFAULT = 3


class NvmlReader:
    """Reads every GPU NVML sees; call it for a ReadResult, ``close()`` when done. Never raises.

    NVML is initialised on the first read and kept (nvmlInit per read costs driver round trips every
    interval); a failed init is retried on the next read, so a driver that comes up late is picked up.
    ``nvml`` replaces the ``pynvml`` module (tests inject a fake one; there is no GPU there).
    """

    def __init__(self, nvml: ModuleType | Any | None = None) -> None:
        self._nvml: Any = nvml
        self._initialised = False
        # The telemetry thread reads while stop() may close from another thread.
        self._lock = threading.Lock()

    def __call__(self) -> ReadResult:
        with self._lock:
            try:
                return self._read()
            except Exception as exc:
                # Never an exception out of the reader: an NVML binding surprise costs one read.
                return TelemetryError(f"NVML read failed: {exc!r}")

    def close(self) -> None:
        """Shut NVML down if this reader initialised it; safe to call twice or before any read."""
        with self._lock:
            if not self._initialised:
                return
            self._initialised = False
            # Shutting down is best effort: the process keeps running either way.
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()

    def _module(self) -> Any | TelemetryError:
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                return TelemetryError(f"NVML unavailable: pynvml is not installed ({exc})")
        return self._nvml

    def _read(self) -> ReadResult:
        nvml = self._module()
        if isinstance(nvml, TelemetryError):
            return nvml
        if not self._initialised:
            try:
                nvml.nvmlInit()
            except nvml.NVMLError as exc:
                return TelemetryError(f"nvmlInit failed: {exc}")
            self._initialised = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            # A driver reload or a lost GPU can invalidate the session: initialise again next time.
            self._initialised = False
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            return TelemetryError(f"nvmlDeviceGetCount failed: {exc}")
        if count == 0:
            return TelemetryError("NVML reports no GPUs")
        return [self._device(nvml, index) for index in range(count)]

    def _device(self, nvml: Any, index: int) -> ChipReading:
        card = str(index)
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            return _unhealthy(card, "", f"nvmlDeviceGetHandleByIndex: {exc}")
        errors: list[str] = []

        def query(what: str, fn: Any, *args: Any) -> Any:
            try:
                return fn(handle, *args)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", _NOT_SUPPORTED_DEFAULT):
                    # No power sensor (some boards, MIG) is a missing field, not a sick GPU.
                    return None
                errors.append(f"{what}: {exc}")
                return None

        raw_name = query("name", nvml.nvmlDeviceGetName)
        name = raw_name.decode(errors="replace") if isinstance(raw_name, bytes) else str(raw_name or "")
        temperature = query("temperature", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        power_mw = query("power", nvml.nvmlDeviceGetPowerUsage)
        memory = query("memory", nvml.nvmlDeviceGetMemoryInfo)
        rates = query("utilization", nvml.nvmlDeviceGetUtilizationRates)
        return ChipReading(
            card=card,
            chip="0",
            device_name=name,
            healthy=not errors,
            health=HEALTHY if not errors else "NVMLError: " + "; ".join(errors),
            temperature_celsius=None if temperature is None else float(temperature),
            power_watts=None if power_mw is None else float(power_mw) / MILLIWATTS_PER_WATT,
            aicore_utilization=None if rates is None else float(rates.gpu) / 100.0,
            hbm_used_bytes=None if memory is None else int(memory.used),
            hbm_total_bytes=None if memory is None else int(memory.total),
        )


def _unhealthy(card: str, name: str, health: str) -> ChipReading:
    return ChipReading(
        card=card,
        chip="0",
        device_name=name,
        healthy=False,
        health=f"NVMLError: {health}",
        temperature_celsius=None,
        power_watts=None,
        aicore_utilization=None,
        hbm_used_bytes=None,
        hbm_total_bytes=None,
    )


def read_nvml(nvml: ModuleType | Any | None = None) -> ReadResult:
    """One-shot read: initialise NVML, read every GPU, shut NVML down. Never raises."""
    reader = NvmlReader(nvml)
    try:
        return reader()
    finally:
        reader.close()
