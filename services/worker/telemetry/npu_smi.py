"""Ascend NPU readings from ``npu-smi info``: per chip temperature, power, HBM, AI-core use and health.

The default ``npu-smi info`` table gives every chip two rows under a two-row header::

    | NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
    | Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
    | 0     910B3               | OK            | 101.8       43                0    / 0             |
    | 0                         | 0000:C1:00.0  | 0           0    / 0          3318 / 65536         |

Atlas A3 boards (``Ascend910``) print ``Chip  Phy-ID`` and one row pair per chip of a card, 310 cards
print no HBM column (their ``Memory-Usage`` is the device memory), and a process table may follow. The
recorded outputs in tests/data/npu_smi show each of these. The shared reading types (``ChipReading``,
``TelemetryError``) live here and are what the NVML reader returns too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from services.worker.npu_smi_command import CommandRunner, NpuSmiFailure, refusal, run_npu_smi

NPU_SMI_INFO_ARGS: tuple[str, ...] = ("info",)
# Shorter than cpu_binding's NPU_SMI_TIMEOUT_S (a one-off at startup): this read repeats every few
# seconds, and a slow one must not stall the next.
DEFAULT_TIMEOUT_S = 3.0
HEALTHY = "OK"
MIB = 1024 * 1024


@dataclass(frozen=True)
class ChipReading:
    """One chip's state as the tool reported it; None where the tool printed no usable number."""

    card: str
    chip: str
    device_name: str
    healthy: bool
    health: str
    temperature_celsius: float | None
    power_watts: float | None
    aicore_utilization: float | None  # 0-1: AI-core busy share (NPU), SM busy share (CUDA)
    hbm_used_bytes: int | None
    hbm_total_bytes: int | None


@dataclass(frozen=True)
class TelemetryError:
    """A read that produced no readings (tool absent, failed, timed out, or printed something unparseable)."""

    reason: str


ReadResult = list[ChipReading] | TelemetryError

# npu-smi's refusals read "This device does not support querying <what>."; loose across versions, as in
# cpu_binding.
# The trailing process table ("| NPU  Chip | Process id | Process name | Process memory(MB) |") ends the
# device rows; its "No running processes found in NPU 0" lines must not be read as cards.
_PROCESS_TABLE = re.compile(r"process\s+(id|name|memory)", re.IGNORECASE)
# Header labels end in a unit in parentheses and may hold a space ("NPU Util(%)" on newer tools).
_LABEL = re.compile(r"[^\s()][^()]*?\([^)]*\)")
# A value is one token ("101.8", "NA", "-") or a used/total pair ("3318 / 65536", "58626/ 65536").
_VALUE = re.compile(r"(?P<used>[^\s/]+)\s*/\s*(?P<total>[^\s/]+)|(?P<single>[^\s/]+)")
_MISSING = frozenset({"", "NA", "N/A", "-", "--"})

_POWER = "power(w)"
_TEMP = "temp(c)"
_UTIL = ("aicore(%)", "nputil(%)")
_HBM = "hbm-usage(mb)"
# 310/310P cards have no HBM column: their Memory-Usage is the device memory a model lives in.
_MEMORY = "memory-usage(mb)"

Value = str | tuple[str, str]


@dataclass(frozen=True)
class _Layout:
    """Where the fields sit, read from the two header rows."""

    header_end: int  # index of the first line after the header
    health_col: int  # pipe-separated column of Health (row 1) and Bus-Id (row 2)
    values_col: int  # pipe-separated column of the space-separated numbers
    card_labels: tuple[tuple[str, int], ...]  # (normalised label, start offset in the cell), row 1
    chip_labels: tuple[tuple[str, int], ...]  # the same for row 2


def parse_npu_smi_info(text: str) -> ReadResult:
    """Parse the default ``npu-smi info`` table into one reading per chip; never raises.

    Output without a device table (a refusal, an error, garbage) gives a TelemetryError that says why.
    """
    try:
        return _parse(text)
    except Exception as exc:
        # The contract is "never raises": a shape nobody has recorded yet costs one failed read, not the
        # telemetry thread.
        return TelemetryError(f"could not parse npu-smi output: {exc!r}")


def _parse(text: str) -> ReadResult:
    lines = text.splitlines()
    layout = _find_layout(lines)
    if layout is None:
        first = next((ln.strip() for ln in lines if ln.strip()), "")
        return TelemetryError(refusal(text) or f"no device table in npu-smi output (first line: {first[:120]!r})")

    readings: list[ChipReading] = []
    card_row: list[str] | None = None
    for line in lines[layout.header_end :]:
        stripped = line.strip()
        if _PROCESS_TABLE.search(stripped):
            break
        if not stripped.startswith("|"):
            # A border ("+====", "+----") or an elision ("..." in pasted output). A chip's two rows are
            # always adjacent, so a card row still waiting here lost its second row.
            if card_row is not None:
                readings.append(_reading(layout, card_row, None))
                card_row = None
            continue
        cells = _cells(stripped)
        if card_row is None:
            if _card_id(layout, cells) is not None:
                card_row = cells
            continue
        readings.append(_reading(layout, card_row, cells))
        card_row = None
    if card_row is not None:
        readings.append(_reading(layout, card_row, None))
    if not readings:
        return TelemetryError("npu-smi printed a device table header but no NPU rows")
    return readings


def _cells(line: str) -> list[str]:
    """The pipe-separated cells of a table row, inner spacing kept (offsets within a cell matter)."""
    body = line.strip()
    body = body.removeprefix("|").removesuffix("|")
    return body.split("|")


def _find_layout(lines: Sequence[str]) -> _Layout | None:
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped.startswith("|"):
            continue
        cells = _cells(stripped)
        names = [cell.strip().lower() for cell in cells]
        if "health" not in names:
            continue
        health_col = names.index("health")
        values_col = next(
            (j for j, cell in enumerate(cells) if any(label == _TEMP for label, _ in _labels(cell))), None
        )
        if values_col is None:
            continue
        chip_labels: tuple[tuple[str, int], ...] = ()
        header_end = i + 1
        if header_end < len(lines) and lines[header_end].strip().startswith("|"):
            second = _cells(lines[header_end].strip())
            if values_col < len(second):
                chip_labels = _labels(second[values_col])
            header_end += 1
        return _Layout(
            header_end=header_end,
            health_col=health_col,
            values_col=values_col,
            card_labels=_labels(cells[values_col]),
            chip_labels=chip_labels,
        )
    return None


def _labels(cell: str) -> tuple[tuple[str, int], ...]:
    return tuple(("".join(m.group(0).lower().split()), m.start()) for m in _LABEL.finditer(cell))


def _card_id(layout: _Layout, cells: Sequence[str]) -> str | None:
    ident = " ".join(cells[: layout.health_col]).split()
    return ident[0] if ident and ident[0].isdigit() else None


def _values(cell: str | None, labels: Sequence[tuple[str, int]]) -> dict[str, Value]:
    """Map a row's numbers to the header labels above them."""
    if cell is None or not labels:
        return {}
    found: list[tuple[Value, int]] = []
    for m in _VALUE.finditer(cell):
        single = m.group("single")
        value: Value = single if single is not None else (m.group("used"), m.group("total"))
        found.append((value, m.start()))
    if len(found) == len(labels):
        # One number per label: order decides, whatever the spacing.
        return {label: value for (label, _), (value, _) in zip(labels, found, strict=True)}
    # A field left blank or cut off: npu-smi left-aligns each number under its label, so the label whose
    # column starts at or just before the number owns it.
    out: dict[str, Value] = {}
    for value, start in found:
        owner = labels[0][0]
        for label, label_start in labels:
            if label_start <= start + 1:
                owner = label
        out.setdefault(owner, value)
    return out


def _number(value: Value | None) -> float | None:
    if value is None or isinstance(value, tuple):
        return None
    return _float(value)


def _float(token: str) -> float | None:
    if token.strip().upper() in _MISSING:
        return None
    try:
        return float(token)
    except ValueError:
        return None


def _usage_bytes(value: Value | None) -> tuple[int | None, int | None]:
    """(used, total) bytes from a "used / total" MB pair; a total of 0 means the tool has no such memory."""
    if not isinstance(value, tuple):
        return None, None
    used, total = _float(value[0]), _float(value[1])
    if total is None or total <= 0:
        return None, None
    return (None if used is None else round(used * MIB)), round(total * MIB)


def _reading(layout: _Layout, card_cells: Sequence[str], chip_cells: Sequence[str] | None) -> ChipReading:
    ident = " ".join(card_cells[: layout.health_col]).split()
    card = ident[0]
    health = card_cells[layout.health_col].strip() if layout.health_col < len(card_cells) else ""
    card_values = _values(_cell(card_cells, layout.values_col), layout.card_labels)
    chip = "0"
    chip_values: dict[str, Value] = {}
    if chip_cells is not None:
        chip_ident = " ".join(chip_cells[: layout.health_col]).split()
        # "0" on 910B, "1     1" (chip, physical id) on A3; the second number is not the chip id.
        if chip_ident and chip_ident[0].isdigit():
            chip = chip_ident[0]
        chip_values = _values(_cell(chip_cells, layout.values_col), layout.chip_labels)
    util = next((_number(chip_values[key]) for key in _UTIL if key in chip_values), None)
    used, total = _usage_bytes(chip_values.get(_HBM, chip_values.get(_MEMORY)))
    return ChipReading(
        card=card,
        chip=chip,
        device_name=" ".join(ident[1:]),
        healthy=health.upper() == HEALTHY,
        health=health,
        temperature_celsius=_number(card_values.get(_TEMP)),
        power_watts=_number(card_values.get(_POWER)),
        aicore_utilization=None if util is None else util / 100.0,
        hbm_used_bytes=used,
        hbm_total_bytes=total,
    )


def _cell(cells: Sequence[str], index: int) -> str | None:
    return cells[index] if index < len(cells) else None


def read_npu_smi(*, timeout: float = DEFAULT_TIMEOUT_S, runner: CommandRunner | None = None) -> ReadResult:
    """Run ``npu-smi info`` (found on PATH) with a timeout and parse it; never raises."""
    output = run_npu_smi(NPU_SMI_INFO_ARGS, timeout, runner)
    if isinstance(output, NpuSmiFailure):
        return TelemetryError(output.reason)
    return parse_npu_smi_info(output)
