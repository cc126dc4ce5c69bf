"""NUMA / CPU-affinity binding for worker ranks: NPU-local CPUs from ``npu-smi info -t topo``, else sysfs NUMA.

Never asks for CPUs outside the process's current affinity (the container's cpuset); empty ``cpus`` = no binding.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.worker.npu_smi_command import CommandRunner, NpuSmiFailure, refusal, run_npu_smi

CpuList = tuple[int, ...]
BindingSource = Literal["npu-smi", "sysfs-numa", "none"]

CPU_BINDING_POLICIES: tuple[str, ...] = ("auto", "off")
DEFAULT_CPU_BINDING_POLICY = "auto"
NPU_SMI_TOPO_ARGS: tuple[str, ...] = ("info", "-t", "topo")
NPU_SMI_TIMEOUT_S = 10
ASCEND_VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
DEFAULT_SYSFS_ROOT = Path("/sys")
NPU_DEVICE_TYPE = "npu"

_DEVICE_COLUMN = re.compile(r"[A-Za-z]+\d+")
_NPU_LABEL = re.compile(r"NPU(\d+)")
_NODE_DIR = re.compile(r"node(\d+)")
_LEGEND_ENTRY = re.compile(r"\s*(\S+)\s*=\s*(.*?)\s*")


@dataclass(frozen=True)
class NpuTopology:
    """Parsed ``npu-smi info -t topo``: per-NPU CPU affinity, NPU-to-NPU link types and the legend."""

    cpu_affinity: dict[int, CpuList | None]
    links: dict[int, dict[int, str]]
    legend: dict[str, str]

    @property
    def npus(self) -> CpuList:
        """NPU ids in the order npu-smi listed their rows."""
        return tuple(self.links)

    def link(self, a: int, b: int) -> str | None:
        """Link type between NPU ``a`` and NPU ``b`` ("HCCS", "PIX", "X" for self, ...), None if not listed."""
        return self.links.get(a, {}).get(b)


@dataclass(frozen=True)
class TopoUnsupported:
    """npu-smi could not provide a topology (absent, failed, refused, or printed something unparseable)."""

    reason: str


@dataclass(frozen=True)
class CpuBinding:
    """A binding decision or what was applied: ``cpus`` is empty exactly when ``source`` is "none"."""

    cpus: CpuList
    source: BindingSource
    reason: str


def parse_cpulist(text: str) -> CpuList:
    """Parse a Linux cpulist ("0-23,96-119", "5", "") into sorted unique CPU ids; ValueError on bad syntax."""
    cpus: set[int] = set()
    for raw in text.strip().split(","):
        part = raw.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad cpulist element {part!r} in {text!r}")
        start, end = int(lo), int(hi) if sep else int(lo)
        if end < start:
            raise ValueError(f"descending range {part!r} in {text!r}")
        cpus.update(range(start, end + 1))
    return tuple(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """Render CPU ids in the compact cpulist form ("0-23,96-119") for logs and reasons."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        ranges.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(ranges)


def parse_npu_smi_topo(text: str) -> NpuTopology | TopoUnsupported:
    """Parse ``npu-smi info -t topo`` output; never raises, unusable output gives TopoUnsupported."""
    lines = text.splitlines()
    header_at = _find_header(lines)
    if header_at is None:
        first = next((ln.strip() for ln in lines if ln.strip()), "")
        return TopoUnsupported(refusal(text) or f"no topology matrix in npu-smi output (first line: {first[:120]!r})")

    device_cols, extra_cols = _split_header(lines[header_at])
    affinity_col = next((i for i, name in enumerate(extra_cols) if _norm(name) == "cpu affinity"), None)
    cpu_affinity: dict[int, CpuList | None] = {}
    links: dict[int, dict[int, str]] = {}
    for line in lines[header_at + 1 :]:
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.lower().startswith("legend"):
            break
        tokens = stripped.split()
        label = _NPU_LABEL.fullmatch(tokens[0])
        if label is None:
            # Non-NPU rows (e.g. NIC rows on newer boards) carry no CPU affinity for a device rank.
            continue
        npu = int(label.group(1))
        cells = tokens[1 : 1 + len(device_cols)]
        links[npu] = {
            int(m.group(1)): cell
            for col, cell in zip(device_cols, cells, strict=False)
            if (m := _NPU_LABEL.fullmatch(col)) is not None
        }
        extras = tokens[1 + len(device_cols) :]
        cpu_affinity[npu] = None
        if affinity_col is not None and affinity_col < len(extras):
            try:
                cpu_affinity[npu] = parse_cpulist(extras[affinity_col]) or None
            except ValueError:
                # "NA" / "-" style placeholders: affinity unknown for this NPU, not a parse failure.
                cpu_affinity[npu] = None
    if not links:
        return TopoUnsupported("npu-smi topology header without NPU rows")
    return NpuTopology(cpu_affinity=cpu_affinity, links=links, legend=_parse_legend(lines))


def _find_header(lines: Sequence[str]) -> int | None:
    """Index of the matrix header: the first line starting with an NPU column that has no "X" (self) cell."""
    for i, line in enumerate(lines):
        tokens = line.split()
        if tokens and _NPU_LABEL.fullmatch(tokens[0]) and "X" not in tokens:
            return i
    return None


def _split_header(line: str) -> tuple[list[str], list[str]]:
    """Split a header into device columns (NPU0, NIC0, ...) and the trailing named columns ("CPU Affinity")."""
    tokens = line.split()
    n_dev = 0
    while n_dev < len(tokens) and _DEVICE_COLUMN.fullmatch(tokens[n_dev]):
        n_dev += 1
    rest = line.strip()
    for tok in tokens[:n_dev]:
        rest = rest[len(tok) :].lstrip()
    # Trailing names contain single spaces ("CPU Affinity"), so only tabs or 2+ spaces separate them.
    extras = [name for name in re.split(r"\t|\s{2,}", rest) if name.strip()]
    return tokens[:n_dev], [name.strip() for name in extras]


def _parse_legend(lines: Sequence[str]) -> dict[str, str]:
    """Read the ``Legend:`` block ("X = Self", "HCCS = Connection traversing HCCS.", ...)."""
    legend: dict[str, str] = {}
    in_legend = False
    for line in lines:
        if line.strip().lower().startswith("legend"):
            in_legend = True
            continue
        if in_legend and (m := _LEGEND_ENTRY.fullmatch(line)) is not None:
            legend[m.group(1)] = m.group(2)
    return legend


def _norm(name: str) -> str:
    return " ".join(name.lower().split())


def query_npu_topology(runner: CommandRunner | None = None) -> NpuTopology | TopoUnsupported:
    """Run ``npu-smi info -t topo`` (through ``runner`` when given) and parse it; never raises."""
    output = run_npu_smi(NPU_SMI_TOPO_ARGS, NPU_SMI_TIMEOUT_S, runner)
    if isinstance(output, NpuSmiFailure):
        return TopoUnsupported(output.reason)
    return parse_npu_smi_topo(output)


def read_numa_nodes(sysfs_root: Path | str = DEFAULT_SYSFS_ROOT) -> dict[int, CpuList]:
    """NUMA node id -> CPUs from ``<root>/devices/system/node/node*/cpulist``; {} when sysfs lacks NUMA info."""
    node_dir = Path(sysfs_root) / "devices" / "system" / "node"
    nodes: dict[int, CpuList] = {}
    try:
        entries = list(node_dir.iterdir())
    except OSError:
        return nodes
    for entry in entries:
        m = _NODE_DIR.fullmatch(entry.name)
        if m is None:
            continue
        try:
            nodes[int(m.group(1))] = parse_cpulist((entry / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return dict(sorted(nodes.items()))


def physical_npu_index(local_index: int, visible_devices: str | None) -> int:
    """Map a local device index to the physical NPU id through ASCEND_RT_VISIBLE_DEVICES ("4,5,6,7")."""
    if local_index < 0:
        raise ValueError(f"negative device index {local_index}")
    if visible_devices is None or not visible_devices.strip():
        return local_index
    entries = [e.strip() for e in visible_devices.split(",") if e.strip()]
    if local_index >= len(entries):
        raise ValueError(f"device index {local_index} outside {ASCEND_VISIBLE_DEVICES_ENV}={visible_devices!r}")
    entry = entries[local_index]
    if not entry.isdigit():
        raise ValueError(f"non-numeric entry {entry!r} in {ASCEND_VISIBLE_DEVICES_ENV}={visible_devices!r}")
    return int(entry)


def plan_binding(
    *,
    device_type: str,
    local_rank: int,
    ranks_per_node: int,
    allowed_cpus: Iterable[int],
    numa_nodes: Mapping[int, Sequence[int]],
    npu_topology: NpuTopology | TopoUnsupported | None = None,
    physical_npu: int | None = None,
) -> CpuBinding:
    """Decide the CPU set for one rank without I/O: npu-smi affinity for an NPU, else a NUMA node.

    An empty ``cpus`` (source "none") means leave the affinity alone; ``reason`` says why either way.
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    if not 0 <= local_rank < ranks_per_node:
        raise ValueError(f"local_rank {local_rank} outside [0, {ranks_per_node})")
    allowed = set(allowed_cpus)
    if not allowed:
        return CpuBinding((), "none", "no CPUs in the process affinity mask")

    why_not_npu = ""
    if device_type == NPU_DEVICE_TYPE:
        if physical_npu is None:
            why_not_npu = "no physical NPU id given"
        elif npu_topology is None:
            why_not_npu = "npu-smi topology not queried"
        elif isinstance(npu_topology, TopoUnsupported):
            why_not_npu = npu_topology.reason
        elif (affinity := npu_topology.cpu_affinity.get(physical_npu)) is None:
            why_not_npu = f"npu-smi lists no CPU affinity for NPU{physical_npu}"
        else:
            usable = tuple(sorted(allowed.intersection(affinity)))
            if not usable:
                # The cpuset excludes every NPU-local CPU; binding elsewhere would be an arbitrary guess.
                return CpuBinding(
                    (),
                    "none",
                    f"NPU{physical_npu} affinity {format_cpulist(affinity)} is disjoint from "
                    f"allowed CPUs {format_cpulist(allowed)}",
                )
            return CpuBinding(usable, "npu-smi", f"NPU{physical_npu} CPU affinity {format_cpulist(affinity)}")

    prefix = f"{why_not_npu}; " if why_not_npu else ""
    # Only nodes the cpuset reaches count, so a cpuset spanning 2 of 4 nodes splits ranks over those 2
    # instead of handing some ranks an empty intersection. Which node is device-local is unknown here, so
    # ranks go out in contiguous blocks (r * n_nodes // ranks_per_node): 8 ranks on 4 nodes -> 0,0,1,1,...
    # keeps neighbouring ranks together (they tend to share a socket/switch, as NPU0/1 do on 910B boxes)
    # and 2 ranks on 4 nodes -> 0,2 lands on different sockets on Kunpeng's 2x2 layout rather than sharing one.
    usable_nodes = {
        node: tuple(sorted(allowed.intersection(cpus)))
        for node, cpus in sorted(numa_nodes.items())
        if allowed.intersection(cpus)
    }
    if len(usable_nodes) <= 1:
        # One node (or none known) covering the allowed CPUs: pinning to it changes nothing.
        return CpuBinding((), "none", f"{prefix}allowed CPUs span {len(usable_nodes)} NUMA node(s); not binding")
    node_ids = list(usable_nodes)
    node = node_ids[local_rank * len(node_ids) // ranks_per_node]
    cpus = usable_nodes[node]
    return CpuBinding(
        cpus,
        "sysfs-numa",
        f"{prefix}local rank {local_rank}/{ranks_per_node} -> NUMA node {node} of {node_ids} "
        f"(CPUs {format_cpulist(cpus)})",
    )


def apply_binding(
    policy: str,
    *,
    device_type: str,
    local_rank: int,
    ranks_per_node: int,
    device_index: int | None = None,
    runner: CommandRunner | None = None,
    sysfs_root: Path | str = DEFAULT_SYSFS_ROOT,
    environ: Mapping[str, str] | None = None,
) -> CpuBinding:
    """Apply a ``--cpu-binding`` policy ("auto" | "off") at rank startup and report what was done.

    Call it before starting thread pools: only the calling thread and threads it creates later are pinned.
    """
    if policy not in CPU_BINDING_POLICIES:
        raise ValueError(f"unknown --cpu-binding policy {policy!r}; expected one of {CPU_BINDING_POLICIES}")
    if policy == "off":
        return CpuBinding((), "none", "--cpu-binding=off")
    if not hasattr(os, "sched_setaffinity"):
        return CpuBinding((), "none", "platform has no sched_setaffinity")

    allowed = os.sched_getaffinity(0)
    env = os.environ if environ is None else environ
    topology: NpuTopology | TopoUnsupported | None = None
    physical: int | None = None
    if device_type == NPU_DEVICE_TYPE:
        # npu-smi rows are numbered by the host's NPU ids; the local index only counts the visible ones.
        try:
            physical = physical_npu_index(
                local_rank if device_index is None else device_index, env.get(ASCEND_VISIBLE_DEVICES_ENV)
            )
        except ValueError as exc:
            return CpuBinding((), "none", str(exc))
        topology = query_npu_topology(runner)

    plan = plan_binding(
        device_type=device_type,
        local_rank=local_rank,
        ranks_per_node=ranks_per_node,
        allowed_cpus=allowed,
        numa_nodes=read_numa_nodes(sysfs_root),
        npu_topology=topology,
        physical_npu=physical,
    )
    if not plan.cpus:
        return plan
    try:
        os.sched_setaffinity(0, plan.cpus)
    except OSError as exc:
        return CpuBinding((), "none", f"sched_setaffinity({format_cpulist(plan.cpus)}) failed: {exc}")
    return plan
