"""cpu_binding: npu-smi topo parsing on recorded outputs, cpulists, sysfs NUMA fallback and applying affinity."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.worker import cpu_binding
from services.worker.cpu_binding import (
    CpuBinding,
    NpuTopology,
    TopoUnsupported,
    apply_binding,
    format_cpulist,
    parse_cpulist,
    parse_npu_smi_topo,
    physical_npu_index,
    plan_binding,
    query_npu_topology,
    read_numa_nodes,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "npu_smi"
MS_SWIFT = DATA / "topo_910b_8x_hccs_ms_swift.txt"
ARTHURCHIAO = DATA / "topo_910b_8x_hccs_arthurchiao.txt"
FOUR_PXB = DATA / "topo_4x_pxb_sys_openyuanrong_fixture.txt"
UNSUPPORTED = DATA / "topo_unsupported_openyuanrong_fixture.txt"


def _topo(path: Path) -> NpuTopology:
    parsed = parse_npu_smi_topo(path.read_text())
    assert isinstance(parsed, NpuTopology), parsed
    return parsed


def _runner(stdout: str = "", stderr: str = "", returncode: int = 0, calls: list[list[str]] | None = None):
    def run(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        if calls is not None:
            calls.append(list(cmd))
        return subprocess.CompletedProcess(list(cmd), returncode, stdout, stderr)

    return run


def _fake_sysfs(root: Path, nodes: dict[int, str]) -> Path:
    base = root / "devices" / "system" / "node"
    base.mkdir(parents=True)
    # Real sysfs also has non-node entries here; they must be ignored.
    (base / "online").write_text("0-1\n")
    (base / "possible").write_text("0-1\n")
    for node, cpulist in nodes.items():
        (base / f"node{node}").mkdir()
        (base / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    return root


# --- recorded npu-smi outputs -------------------------------------------------------------------


def test_every_recorded_output_is_parsed_without_raising() -> None:
    files = sorted(DATA.glob("*.txt"))
    assert len(files) >= 4
    for path in files:
        assert isinstance(parse_npu_smi_topo(path.read_text()), NpuTopology | TopoUnsupported)


def test_ms_swift_910b_hccs_matrix() -> None:
    topo = _topo(MS_SWIFT)
    assert topo.npus == tuple(range(8))
    assert topo.cpu_affinity[0] == tuple(range(144, 168))
    assert topo.cpu_affinity[1] == tuple(range(144, 168))
    assert topo.cpu_affinity[2] == tuple(range(96, 120))
    assert topo.cpu_affinity[4] == tuple(range(0, 24))
    assert topo.cpu_affinity[7] == tuple(range(48, 72))
    assert topo.link(0, 1) == "HCCS"
    assert topo.link(0, 0) == "X"
    assert topo.link(7, 6) == "HCCS"
    assert all(topo.link(a, b) == ("X" if a == b else "HCCS") for a in range(8) for b in range(8))
    assert topo.link(0, 8) is None
    assert topo.legend["X"] == "Self"
    assert topo.legend["HCCS"] == "Connection traversing HCCS."
    assert topo.legend["NA"] == "Unknown relationship."
    assert set(topo.legend) == {"X", "SYS", "PHB", "PIX", "PXB", "HCCS", "NA"}


def test_arthurchiao_910b_layout_without_leading_tab() -> None:
    topo = _topo(ARTHURCHIAO)
    assert topo.npus == tuple(range(8))
    assert topo.cpu_affinity[0] == tuple(range(144, 168))
    assert topo.cpu_affinity[1] == tuple(range(0, 24))
    assert topo.cpu_affinity[4] == tuple(range(96, 120))
    assert topo.cpu_affinity[5] == tuple(range(48, 72))
    assert topo.link(0, 1) == "HCCS"
    assert topo.legend["PXB"] == "Path traversing multipul PCIe switches"
    assert "NA" not in topo.legend


def test_four_npu_pcie_fixture_link_types() -> None:
    topo = _topo(FOUR_PXB)
    assert topo.npus == (0, 1, 2, 3)
    assert topo.link(0, 1) == "PXB"
    assert topo.link(0, 2) == "SYS"
    assert topo.link(3, 3) == "X"
    assert topo.cpu_affinity[3] == tuple(range(0, 24))
    assert topo.legend == {"X": "Self"}


def test_does_not_support_output_is_unsupported() -> None:
    parsed = parse_npu_smi_topo(UNSUPPORTED.read_text())
    assert isinstance(parsed, TopoUnsupported)
    assert "does not support querying topo" in parsed.reason


def test_garbage_and_empty_output_are_unsupported() -> None:
    assert isinstance(parse_npu_smi_topo(""), TopoUnsupported)
    assert isinstance(parse_npu_smi_topo("segfault\n"), TopoUnsupported)


def test_multi_list_affinity_na_cells_and_nic_columns() -> None:
    # Shapes seen in other tools' parsers: a list affinity, an "NA" affinity, NIC columns/rows.
    text = (
        "        NPU0    NPU1    NIC0    CPU Affinity\n"
        "NPU0     X      SIO     PIX     0-23,96-119\n"
        "NPU1    SIO      X      PIX     NA\n"
        "NIC0    PIX     PIX      X      \n"
    )
    topo = _topo_from(text)
    assert topo.cpu_affinity == {0: tuple(range(0, 24)) + tuple(range(96, 120)), 1: None}
    assert topo.link(0, 1) == "SIO"
    assert topo.npus == (0, 1)


def test_topology_without_cpu_affinity_column_has_no_affinity() -> None:
    topo = _topo_from("        NPU0    NPU1\nNPU0     X      HCCS\nNPU1    HCCS     X\n")
    assert topo.cpu_affinity == {0: None, 1: None}
    assert topo.link(1, 0) == "HCCS"


def _topo_from(text: str) -> NpuTopology:
    parsed = parse_npu_smi_topo(text)
    assert isinstance(parsed, NpuTopology), parsed
    return parsed


# --- running npu-smi ----------------------------------------------------------------------------


def test_query_uses_the_topo_command_and_parses_stdout() -> None:
    calls: list[list[str]] = []
    topo = query_npu_topology(_runner(MS_SWIFT.read_text(), calls=calls))
    assert calls == [["npu-smi", "info", "-t", "topo"]]
    assert isinstance(topo, NpuTopology)
    assert topo.cpu_affinity[6] == tuple(range(48, 72))


def test_query_failures_are_unsupported_not_raised() -> None:
    def missing(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError("npu-smi")

    def slow(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(list(cmd), 10)

    def denied(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        raise PermissionError("denied")

    assert query_npu_topology(missing) == TopoUnsupported("npu-smi not found")
    assert "timed out" in _reason(query_npu_topology(slow))
    assert "could not run" in _reason(query_npu_topology(denied))
    assert "exited 3" in _reason(query_npu_topology(_runner("", "dcmi init failed", returncode=3)))
    refused = query_npu_topology(_runner(UNSUPPORTED.read_text(), returncode=255))
    assert "does not support querying topo" in _reason(refused)
    assert "does not support" in _reason(query_npu_topology(_runner(UNSUPPORTED.read_text())))


def test_default_runner_without_npu_smi_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert query_npu_topology() == TopoUnsupported("npu-smi not found")


def _reason(result: NpuTopology | TopoUnsupported) -> str:
    assert isinstance(result, TopoUnsupported), result
    return result.reason


# --- cpulists -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ()),
        ("\n", ()),
        ("5", (5,)),
        ("0-3", (0, 1, 2, 3)),
        ("0-1,4", (0, 1, 4)),
        ("8-9,0-1\n", (0, 1, 8, 9)),
        ("3,1,3,2", (1, 2, 3)),
        ("0-23,96-119", tuple(range(24)) + tuple(range(96, 120))),
        ("7-7", (7,)),
    ],
)
def test_parse_cpulist(text: str, expected: tuple[int, ...]) -> None:
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("bad", ["a", "1-", "-3", "5-2", "0-3:2", "1;2", "NA", " 0 - 0 ,"])
def test_parse_cpulist_rejects_bad_syntax(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_cpulist(bad)


def test_format_cpulist_round_trips() -> None:
    assert format_cpulist([]) == ""
    assert format_cpulist([3, 1, 2, 9]) == "1-3,9"
    text = "0-23,96-119"
    assert format_cpulist(parse_cpulist(text)) == text


# --- ASCEND_RT_VISIBLE_DEVICES ------------------------------------------------------------------


def test_physical_npu_index_mapping() -> None:
    assert physical_npu_index(2, None) == 2
    assert physical_npu_index(2, "") == 2
    assert physical_npu_index(0, "4,5,6,7") == 4
    assert physical_npu_index(3, "4,5,6,7") == 7
    assert physical_npu_index(1, " 6 , 2 ") == 2
    with pytest.raises(ValueError, match="outside"):
        physical_npu_index(4, "4,5,6,7")
    with pytest.raises(ValueError, match="non-numeric"):
        physical_npu_index(0, "npu4")
    with pytest.raises(ValueError, match="negative"):
        physical_npu_index(-1, None)


# --- sysfs --------------------------------------------------------------------------------------


def test_read_numa_nodes_from_fake_tree(tmp_path: Path) -> None:
    root = _fake_sysfs(tmp_path, {0: "0-23", 1: "24-47", 10: "96-119", 2: ""})
    assert read_numa_nodes(root) == {0: tuple(range(24)), 1: tuple(range(24, 48)), 2: (), 10: tuple(range(96, 120))}


def test_read_numa_nodes_missing_or_broken_tree(tmp_path: Path) -> None:
    assert read_numa_nodes(tmp_path) == {}
    root = _fake_sysfs(tmp_path / "sys", {0: "0-1", 1: "garbage"})
    assert read_numa_nodes(root) == {0: (0, 1)}


# --- plan_binding -------------------------------------------------------------------------------

KUNPENG_NODES = {0: tuple(range(0, 24)), 1: tuple(range(24, 48)), 2: tuple(range(48, 72)), 3: tuple(range(72, 96))}


def test_plan_npu_uses_topo_affinity_of_the_physical_npu() -> None:
    topo = _topo(MS_SWIFT)
    plan = plan_binding(
        device_type="npu",
        local_rank=0,
        ranks_per_node=4,
        allowed_cpus=range(192),
        numa_nodes=KUNPENG_NODES,
        npu_topology=topo,
        physical_npu=physical_npu_index(0, "4,5,6,7"),
    )
    assert plan == CpuBinding(tuple(range(24)), "npu-smi", "NPU4 CPU affinity 0-23")


def test_plan_npu_intersects_with_allowed_cpus() -> None:
    plan = plan_binding(
        device_type="npu",
        local_rank=0,
        ranks_per_node=1,
        allowed_cpus=[150, 151, 3],
        numa_nodes={},
        npu_topology=_topo(MS_SWIFT),
        physical_npu=0,
    )
    assert plan.cpus == (150, 151)
    assert plan.source == "npu-smi"


def test_plan_npu_empty_intersection_does_not_bind() -> None:
    plan = plan_binding(
        device_type="npu",
        local_rank=0,
        ranks_per_node=1,
        allowed_cpus=[0, 1],
        numa_nodes=KUNPENG_NODES,
        npu_topology=_topo(MS_SWIFT),
        physical_npu=0,
    )
    assert plan.cpus == ()
    assert plan.source == "none"
    assert "144-167" in plan.reason and "disjoint" in plan.reason


def test_plan_npu_unsupported_topo_falls_back_to_numa() -> None:
    plan = plan_binding(
        device_type="npu",
        local_rank=3,
        ranks_per_node=4,
        allowed_cpus=range(96),
        numa_nodes=KUNPENG_NODES,
        npu_topology=TopoUnsupported("npu-smi: This device does not support querying topo."),
        physical_npu=3,
    )
    assert plan.source == "sysfs-numa"
    assert plan.cpus == tuple(range(72, 96))
    assert "does not support" in plan.reason


def test_plan_npu_without_affinity_entry_falls_back_to_numa() -> None:
    plan = plan_binding(
        device_type="npu",
        local_rank=0,
        ranks_per_node=2,
        allowed_cpus=range(96),
        numa_nodes=KUNPENG_NODES,
        npu_topology=_topo(MS_SWIFT),
        physical_npu=12,
    )
    assert plan.source == "sysfs-numa"
    assert "no CPU affinity for NPU12" in plan.reason


@pytest.mark.parametrize(
    ("ranks", "expected_nodes"),
    [(8, [0, 0, 1, 1, 2, 2, 3, 3]), (4, [0, 1, 2, 3]), (2, [0, 2]), (1, [0]), (3, [0, 1, 2])],
)
def test_plan_numa_blocks_ranks_across_nodes(ranks: int, expected_nodes: list[int]) -> None:
    chosen = []
    for rank in range(ranks):
        plan = plan_binding(
            device_type="cuda", local_rank=rank, ranks_per_node=ranks, allowed_cpus=range(96), numa_nodes=KUNPENG_NODES
        )
        assert plan.source == "sysfs-numa"
        chosen.append(plan.cpus[0] // 24)
    assert chosen == expected_nodes


def test_plan_numa_only_uses_nodes_the_cpuset_reaches() -> None:
    # A cpuset covering nodes 1 and 3 only: ranks split over those two, never over unusable nodes.
    allowed = list(range(24, 48)) + list(range(80, 84))
    plans = [
        plan_binding(device_type="cpu", local_rank=r, ranks_per_node=2, allowed_cpus=allowed, numa_nodes=KUNPENG_NODES)
        for r in range(2)
    ]
    assert [p.cpus for p in plans] == [tuple(range(24, 48)), (80, 81, 82, 83)]


def test_plan_single_node_or_no_numa_info_does_nothing() -> None:
    for nodes in ({0: tuple(range(8))}, {}, {0: tuple(range(8)), 1: ()}):
        plan = plan_binding(device_type="cpu", local_rank=0, ranks_per_node=1, allowed_cpus=range(8), numa_nodes=nodes)
        assert plan == CpuBinding((), "none", plan.reason)
        assert "not binding" in plan.reason
    # Two nodes on the host but the cpuset sits inside one of them: also nothing to gain.
    plan = plan_binding(
        device_type="cpu", local_rank=0, ranks_per_node=2, allowed_cpus=[0, 1], numa_nodes=KUNPENG_NODES
    )
    assert plan.source == "none"


def test_plan_rejects_bad_rank_arguments() -> None:
    with pytest.raises(ValueError):
        plan_binding(device_type="cpu", local_rank=2, ranks_per_node=2, allowed_cpus=[0], numa_nodes={})
    with pytest.raises(ValueError):
        plan_binding(device_type="cpu", local_rank=0, ranks_per_node=0, allowed_cpus=[0], numa_nodes={})


def test_plan_with_no_allowed_cpus() -> None:
    plan = plan_binding(device_type="cpu", local_rank=0, ranks_per_node=1, allowed_cpus=[], numa_nodes=KUNPENG_NODES)
    assert plan.source == "none"


# --- apply_binding ------------------------------------------------------------------------------


def _forbid_setaffinity(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(pid: int, cpus: object) -> None:
        raise AssertionError("must not change affinity")

    monkeypatch.setattr(cpu_binding.os, "sched_setaffinity", boom)


def test_apply_off_does_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _forbid_setaffinity(monkeypatch)

    def no_run(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        raise AssertionError("must not run npu-smi")

    result = apply_binding("off", device_type="npu", local_rank=0, ranks_per_node=8, runner=no_run, sysfs_root=tmp_path)
    assert result == CpuBinding((), "none", "--cpu-binding=off")


def test_apply_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="policy"):
        apply_binding("numa", device_type="cpu", local_rank=0, ranks_per_node=1)


def test_apply_npu_with_visible_devices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[int, tuple[int, ...]]] = []
    monkeypatch.setattr(cpu_binding.os, "sched_getaffinity", lambda pid: set(range(192)))
    monkeypatch.setattr(cpu_binding.os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, tuple(cpus))))
    result = apply_binding(
        "auto",
        device_type="npu",
        local_rank=1,
        ranks_per_node=2,
        runner=_runner(MS_SWIFT.read_text()),
        sysfs_root=tmp_path,
        environ={"ASCEND_RT_VISIBLE_DEVICES": "6,2"},
    )
    assert result == CpuBinding(tuple(range(96, 120)), "npu-smi", "NPU2 CPU affinity 96-119")
    assert calls == [(0, tuple(range(96, 120)))]


def test_apply_npu_bad_visible_devices_does_not_bind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _forbid_setaffinity(monkeypatch)
    result = apply_binding(
        "auto",
        device_type="npu",
        local_rank=2,
        ranks_per_node=4,
        runner=_runner(MS_SWIFT.read_text()),
        sysfs_root=tmp_path,
        environ={"ASCEND_RT_VISIBLE_DEVICES": "0,1"},
    )
    assert result.source == "none" and "outside" in result.reason


def test_apply_npu_disjoint_cpuset_does_not_bind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _forbid_setaffinity(monkeypatch)
    monkeypatch.setattr(cpu_binding.os, "sched_getaffinity", lambda pid: {0, 1})
    result = apply_binding(
        "auto",
        device_type="npu",
        local_rank=0,
        ranks_per_node=1,
        runner=_runner(MS_SWIFT.read_text()),
        sysfs_root=_fake_sysfs(tmp_path, {0: "0-23", 6: "144-167"}),
        environ={},
    )
    assert result.source == "none" and "disjoint" in result.reason


def test_apply_single_node_cpu_machine_does_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _forbid_setaffinity(monkeypatch)
    allowed = sorted(os.sched_getaffinity(0))
    root = _fake_sysfs(tmp_path, {0: format_cpulist(allowed)})
    result = apply_binding("auto", device_type="cpu", local_rank=0, ranks_per_node=1, sysfs_root=root)
    assert result.source == "none"


def test_apply_reports_setaffinity_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def refuse(pid: int, cpus: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(cpu_binding.os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setattr(cpu_binding.os, "sched_setaffinity", refuse)
    root = _fake_sysfs(tmp_path, {0: "0-1", 1: "2-3"})
    result = apply_binding("auto", device_type="cpu", local_rank=0, ranks_per_node=2, sysfs_root=root)
    assert result.source == "none" and "failed" in result.reason


def test_apply_really_sets_affinity_within_allowed_cpus(tmp_path: Path) -> None:
    original = os.sched_getaffinity(0)
    allowed = sorted(original)
    if len(allowed) < 2:
        pytest.skip("needs at least two allowed CPUs")
    half = len(allowed) // 2
    node0, node1 = allowed[:half], allowed[half:]
    root = _fake_sysfs(tmp_path, {0: format_cpulist(node0), 1: format_cpulist(node1)})
    try:
        result = apply_binding("auto", device_type="cpu", local_rank=1, ranks_per_node=2, sysfs_root=root)
        assert result.source == "sysfs-numa"
        assert result.cpus == tuple(node1)
        assert os.sched_getaffinity(0) == set(node1)
    finally:
        os.sched_setaffinity(0, original)
    assert os.sched_getaffinity(0) == original
