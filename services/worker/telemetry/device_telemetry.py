"""Device telemetry: polls npu-smi (NPU) or NVML (CUDA) on a daemon thread and exports ``meshserve:device_*``.

The poll runs on its own daemon thread, never on the model's step thread or the asyncio loop: npu-smi
is a subprocess that can take seconds, and a stalled read must cost a missed reading, not a step. Gauges
follow docs/metrics.md: per chip, labels ``model_name, worker, platform, card, chip, device_name``, plus
``meshserve:device_telemetry_up`` (``model_name, worker, platform``). The CPU platform exports nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, Final

import structlog
from prometheus_client import CollectorRegistry, Gauge

from services.common.metrics.names import MODEL_NAME_LABEL, metric
from services.worker.telemetry.npu_smi import DEFAULT_TIMEOUT_S, ChipReading, ReadResult, TelemetryError
from services.worker.telemetry.npu_smi import read_npu_smi as _read_npu_smi
from services.worker.telemetry.nvml import NvmlReader

log = structlog.get_logger()

PLATFORMS: Final[tuple[str, ...]] = ("npu", "cuda", "cpu")
Reader = Callable[[], ReadResult]

DEFAULT_INTERVAL_S: Final = 5.0
WORKER_LABEL: Final = "worker"
PLATFORM_LABEL: Final = "platform"
DEVICE_LABELS: Final[tuple[str, ...]] = (MODEL_NAME_LABEL, WORKER_LABEL, PLATFORM_LABEL, "card", "chip", "device_name")
UP_LABELS: Final[tuple[str, ...]] = (MODEL_NAME_LABEL, WORKER_LABEL, PLATFORM_LABEL)
# Distinct failure reasons remembered for warn-once; a tool echoing ever-changing text cannot grow it
# without bound (past this, new reasons are still counted in telemetry_up, just not logged).
MAX_REMEMBERED_REASONS: Final = 256

# (gauge suffix, help, how a reading gives its value); a None value leaves the series absent.
_FIELDS: Final[tuple[tuple[str, str, Callable[[ChipReading], float | None]], ...]] = (
    ("device_temperature_celsius", "Chip temperature (npu-smi or NVML)", lambda r: r.temperature_celsius),
    ("device_power_watts", "Board power", lambda r: r.power_watts),
    ("device_memory_used_bytes", "HBM used", lambda r: None if r.hbm_used_bytes is None else float(r.hbm_used_bytes)),
    (
        "device_memory_total_bytes",
        "HBM total",
        lambda r: None if r.hbm_total_bytes is None else float(r.hbm_total_bytes),
    ),
    (
        "device_utilization_ratio",
        "AI-core (NPU) or SM (CUDA) utilisation, 0-1",
        lambda r: r.aicore_utilization,
    ),
    ("device_healthy", "1 when the tool reports the chip healthy, else 0", lambda r: 1.0 if r.healthy else 0.0),
)


def default_reader(platform: str, timeout: float) -> Reader | None:
    """The reader a platform polls: npu-smi on PATH for "npu", NVML for "cuda", none for "cpu"."""
    if platform == "npu":
        return functools.partial(_read_npu_smi, timeout=timeout)
    if platform == "cuda":
        return NvmlReader()
    return None


class DeviceTelemetry:
    """Per-chip device gauges for one worker, refreshed every ``interval`` seconds on a daemon thread.

    ``reader`` (tests) replaces the platform's reader: a callable returning readings or a TelemetryError.
    A read that fails, raises or times out sets ``device_telemetry_up`` to 0 and removes the device
    series, warning once per distinct reason.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        platform: str,
        *,
        model_name: str,
        worker: str,
        interval: float = DEFAULT_INTERVAL_S,
        timeout: float = DEFAULT_TIMEOUT_S,
        reader: Reader | None = None,
    ) -> None:
        if platform not in PLATFORMS:
            raise ValueError(f"unknown platform {platform!r}; expected one of {PLATFORMS}")
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.platform = platform
        self.interval = interval
        self.timeout = timeout
        self._base = (model_name, worker, platform)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # poll_once runs on the thread and, in tests, on the caller; the gauge bookkeeping is shared.
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._failing = False
        self._reader_closed = False
        self._gauges: dict[str, Gauge] = {}
        self._series: dict[str, set[tuple[str, ...]]] = {}
        self._up: Gauge | None = None
        self._reader: Reader | None = None
        if platform == "cpu":
            # No device_* series at all, not even telemetry_up: a 0 would look like a cold idle card.
            return
        self._reader = reader if reader is not None else default_reader(platform, timeout)
        for suffix, help_text, _ in _FIELDS:
            self._gauges[suffix] = Gauge(metric(suffix), help_text, DEVICE_LABELS, registry=registry)
            self._series[suffix] = set()
        self._up = Gauge(
            metric("device_telemetry_up"),
            "1 when the last device read succeeded, 0 when it failed or timed out",
            UP_LABELS,
            registry=registry,
        )

    @property
    def enabled(self) -> bool:
        """False on the CPU platform, which exports nothing and starts no thread."""
        return self._reader is not None

    @property
    def running(self) -> bool:
        """Whether the polling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the polling thread (first read at once); a no-op on CPU or when already running."""
        if not self.enabled or self.running:
            return
        self._stop.clear()
        with self._lock:
            self._reader_closed = False
        self._thread = threading.Thread(target=self._run, name="device-telemetry", daemon=True)
        self._thread.start()

    def stop(self, join_timeout: float | None = None) -> None:
        """Stop polling and join the thread, waiting at most ``join_timeout`` (default: the read timeout).

        A read that ignores its timeout is left to finish on the daemon thread, which exits after it;
        the caller (worker shutdown) is never held hostage by a hung tool.
        """
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(self.timeout if join_timeout is None else join_timeout)
            if thread.is_alive():
                log.warning("device telemetry read still running at stop; leaving it to finish", platform=self.platform)
                return
            self._thread = None
        self._close_reader()

    def poll_once(self) -> ReadResult:
        """Read once and update the gauges; never raises. The CPU platform reads nothing and returns []."""
        reader = self._reader
        if reader is None:
            return []
        try:
            result = reader()
        except Exception as exc:
            # A reader bug must not kill the thread: it reads as a failed poll.
            result = TelemetryError(f"device reader raised {exc!r}")
        if not isinstance(result, TelemetryError | list):
            result = TelemetryError(f"device reader returned {type(result).__name__}, not readings")
        with self._lock:
            if isinstance(result, TelemetryError):
                self._record_failure(result.reason)
            else:
                self._record_success(result)
        return result

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll_once()
                self._stop.wait(self.interval)
        finally:
            if self._stop.is_set():
                self._close_reader()

    def _record_success(self, readings: Iterable[ChipReading]) -> None:
        wanted: dict[str, dict[tuple[str, ...], float]] = {suffix: {} for suffix in self._gauges}
        for reading in readings:
            chip_labels: tuple[str, ...] = (*self._base, str(reading.card), str(reading.chip), reading.device_name)
            for suffix, _, value_of in _FIELDS:
                value = value_of(reading)
                if value is not None:
                    wanted[suffix][chip_labels] = value
        for suffix, gauge in self._gauges.items():
            current = wanted[suffix]
            for gone in self._series[suffix] - current.keys():
                # The chip vanished or the value turned unreadable: absent, never a stale number.
                gauge.remove(*gone)
            for series, value in current.items():
                gauge.labels(*series).set(value)
            self._series[suffix] = set(current)
        self._set_up(1.0)
        if self._failing:
            log.info("device telemetry recovered", platform=self.platform)
            self._failing = False

    def _record_failure(self, reason: str) -> None:
        # Stale numbers would read as live ones (a card that fell off the bus would stay "healthy"), so a
        # failed read drops the device series and telemetry_up says why they are gone.
        for suffix, gauge in self._gauges.items():
            for labels in self._series[suffix]:
                gauge.remove(*labels)
            self._series[suffix] = set()
        self._set_up(0.0)
        self._failing = True
        if reason not in self._warned and len(self._warned) < MAX_REMEMBERED_REASONS:
            self._warned.add(reason)
            log.warning("device telemetry read failed", platform=self.platform, reason=reason)

    def _set_up(self, value: float) -> None:
        if self._up is not None:
            self._up.labels(*self._base).set(value)

    def _close_reader(self) -> None:
        with self._lock:
            if self._reader_closed:
                return
            self._reader_closed = True
            close: Any = getattr(self._reader, "close", None)
        if callable(close):
            # Closing NVML is best effort; shutdown goes on regardless.
            with contextlib.suppress(Exception):
                close()
