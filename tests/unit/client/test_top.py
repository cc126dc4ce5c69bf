"""`meshserve top`: its figures from hand-built expositions (docs/metrics.md's names), its frame, and one
`--once` run against local HTTP endpoints, one of them dead."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import math
import os
import pty
import socket
import sys
import termios
import threading
from collections.abc import Iterator

import pytest
from rich.console import Console

from services.cli import _build_parser
from services.client import top
from services.client.top_metrics import (
    Poll,
    TargetScrape,
    bucket_delta,
    buckets,
    build_view,
    by_label,
    classify,
    discover_workers,
    histogram_quantile,
    mean_between,
    natural_key,
    parse_exposition,
    rate,
    total,
)
from services.common.ports import free_port

M = 'model_name="tiny"'


def histogram(name: str, counts: dict[str, float], total_sum: float, labels: str = M) -> str:
    """The text of one histogram: cumulative bucket counts by `le`, then _count and _sum."""
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels},le="{le}"}} {n}' for le, n in counts.items()]
    lines += [f"{name}_count{{{labels}}} {counts['+Inf']}", f"{name}_sum{{{labels}}} {total_sum}"]
    return "\n".join(lines) + "\n"


def gateway_text(gen: float, prompt: float, stop: float, length: float, ttft: dict[str, float]) -> str:
    return (
        "# TYPE meshserve:generation_tokens_total counter\n"
        f"meshserve:generation_tokens_total{{{M}}} {gen}\n"
        "# TYPE meshserve:prompt_tokens_total counter\n"
        f"meshserve:prompt_tokens_total{{{M}}} {prompt}\n"
        "# TYPE meshserve:request_success_total counter\n"
        f'meshserve:request_success_total{{{M},finished_reason="stop"}} {stop}\n'
        f'meshserve:request_success_total{{{M},finished_reason="length"}} {length}\n'
        + histogram("meshserve:time_to_first_token_seconds", ttft, 1.0)
        + histogram("meshserve:inter_token_latency_seconds", {"0.01": 10, "0.05": 20, "+Inf": 20}, 0.4)
    )


def scheduler_text(queries: float, hits: float) -> str:
    return (
        f"meshserve:num_requests_waiting{{{M}}} 2\n"
        f"meshserve:num_requests_running{{{M}}} 3\n"
        f"meshserve:kv_cache_usage_perc{{{M}}} 0.25\n"
        f"meshserve:num_workers{{{M}}} 1\n"
        f'meshserve:worker_num_requests_running{{{M},worker="worker-0"}} 3\n'
        f'meshserve:worker_num_requests_waiting{{{M},worker="worker-0"}} 2\n'
        f'meshserve:worker_kv_cache_usage_perc{{{M},worker="worker-0"}} 0.25\n'
        f'meshserve:worker_num_requests_running{{{M},worker="worker-1"}} 0\n'
        f"meshserve:prefix_cache_queries_total{{{M}}} {queries}\n"
        f"meshserve:prefix_cache_hits_total{{{M}}} {hits}\n"
    )


def worker_text(steps: float, batch_sum: float, tokens: float, step_s: float) -> str:
    w = f'{M},worker="worker-0"'
    dev = f'{w},platform="npu",card="0",chip="0",device_name="910B3"'
    return (
        f"meshserve:worker_steps_total{{{w}}} {steps}\n"
        f"meshserve:worker_batch_size_sum{{{w}}} {batch_sum}\n"
        f"meshserve:worker_batch_size_count{{{w}}} {steps}\n"
        f"meshserve:worker_step_tokens_sum{{{w}}} {tokens}\n"
        f"meshserve:worker_step_tokens_count{{{w}}} {steps}\n"
        f"meshserve:worker_step_duration_seconds_sum{{{w}}} {step_s}\n"
        f"meshserve:worker_step_duration_seconds_count{{{w}}} {steps}\n"
        f"meshserve:worker_batch_requests{{{w}}} 3\n"
        f"meshserve:worker_kv_blocks_used{{{w}}} 10\n"
        f"meshserve:worker_kv_blocks_total{{{w}}} 40\n"
        f"meshserve:device_temperature_celsius{{{dev}}} 45\n"
        f"meshserve:device_power_watts{{{dev}}} 90\n"
        f"meshserve:device_memory_used_bytes{{{dev}}} 16e9\n"
        f"meshserve:device_memory_total_bytes{{{dev}}} 64e9\n"
        f"meshserve:device_utilization_ratio{{{dev}}} 0.5\n"
        f"meshserve:device_healthy{{{dev}}} 1\n"
    )


def worker_rows(screen: str) -> list[list[str]]:
    """The cells of the workers table's rows (the devices table, below it, starts with worker ids too)."""
    workers = screen.split("\ndevices")[0]
    return [line.split() for line in workers.splitlines() if line.strip().startswith("worker-")]


def up(name: str, at: float, text: str) -> TargetScrape:
    return TargetScrape(name, name.split("-")[0], f"http://x/{name}", at, parse_exposition(text))


def down(name: str, at: float) -> TargetScrape:
    return TargetScrape(name, name.split("-")[0], f"http://x/{name}", at, None, "ConnectError")


HEALTH = {"gateway": "SERVING", "scheduler": "SERVING"}
FIRST = Poll(
    (
        up("gateway", 100.0, gateway_text(100, 50, 3, 1, {"0.1": 2, "0.5": 4, "+Inf": 4})),
        up("scheduler", 100.0, scheduler_text(100, 10)),
        up("kvstore", 100.0, "meshserve_kvstore_hits_total 0\n"),
        up("worker-0", 100.5, worker_text(10, 20, 100, 0.2)),
        down("worker-1", 100.5),
    ),
    HEALTH,
)
SECOND = Poll(
    (
        up("gateway", 102.0, gateway_text(300, 90, 6, 2, {"0.1": 2, "0.5": 8, "+Inf": 8})),
        up("scheduler", 102.0, scheduler_text(200, 60)),
        up("kvstore", 102.0, "meshserve_kvstore_hits_total 0\n"),
        up("worker-0", 102.5, worker_text(30, 80, 300, 0.6)),
        down("worker-1", 102.5),
    ),
    HEALTH,
)


def test_exposition_samples_keep_the_colon_names_and_sum_over_labels() -> None:
    samples = parse_exposition(gateway_text(300, 90, 6, 2, {"0.1": 2, "+Inf": 8}))
    assert total(samples, "meshserve:request_success_total") == 8
    assert total(samples, "meshserve:request_success_total", finished_reason="stop") == 6
    assert total(samples, "meshserve:request_errors_total") is None
    assert by_label(samples, "meshserve:request_success_total", "finished_reason") == {"stop": 6, "length": 2}
    assert buckets(samples, "meshserve:time_to_first_token_seconds") == {0.1: 2, math.inf: 8}
    with pytest.raises(ValueError):
        parse_exposition("<html>not metrics</html>")


def test_rate_is_growth_per_second_and_a_restart_counts_from_zero() -> None:
    assert rate(100, 300, 2.0) == 100
    assert rate(300, 50, 2.0) == 25  # went down: restarted, all 50 are new
    assert rate(None, 300, 2.0) is None
    assert rate(100, None, 2.0) is None
    assert rate(100, 300, 0.0) is None


def test_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    cumulative = {0.1: 2, 0.5: 8, math.inf: 8}
    # rank 4 of 8 is the 2nd of the 6 observations in (0.1, 0.5].
    assert histogram_quantile(0.5, cumulative) == pytest.approx(0.1 + 0.4 * 2 / 6)
    # rank 1 of 8 is halfway through the first bucket, which starts at 0.
    assert histogram_quantile(0.125, cumulative) == pytest.approx(0.05)
    assert histogram_quantile(1.0, cumulative) == pytest.approx(0.5)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.99, {0.1: 1, 0.5: 2, math.inf: 10}) == 0.5


@pytest.mark.parametrize("cumulative", [{0.1: 0, math.inf: 0}, {0.1: 3, 0.5: 5}, {math.inf: 4}, {}])
def test_quantile_is_none_without_observations_or_an_inf_bucket(cumulative: dict[float, float]) -> None:
    assert histogram_quantile(0.5, cumulative) is None


def test_quantile_rejects_a_q_outside_0_1() -> None:
    with pytest.raises(ValueError):
        histogram_quantile(1.5, {0.1: 1, math.inf: 1})


def test_bucket_delta_is_the_interval_and_the_whole_after_a_restart() -> None:
    before = {0.1: 2, 0.5: 4, math.inf: 4}
    assert bucket_delta(before, {0.1: 2, 0.5: 8, math.inf: 8}) == {0.1: 0, 0.5: 4, math.inf: 4}
    assert bucket_delta(before, {0.1: 1, 0.5: 1, math.inf: 1}) == {0.1: 1, 0.5: 1, math.inf: 1}
    assert bucket_delta(None, before) == before


def test_mean_between_two_scrapes() -> None:
    assert mean_between(20, 10, 80, 30) == 3  # 60 over 20 steps
    assert mean_between(None, None, 80, 30) == pytest.approx(80 / 30)  # no earlier scrape: since the start
    assert mean_between(80, 30, 80, 30) == 0  # no step in between
    assert mean_between(80, 30, 10, 5) == 2  # restarted
    assert mean_between(None, None, None, None) is None


def test_workers_are_discovered_from_the_schedulers_per_worker_series() -> None:
    assert discover_workers(parse_exposition(scheduler_text(0, 0))) == 2  # worker-0 and worker-1
    three = parse_exposition('meshserve:worker_requests_routed_total{worker="worker-2"} 1\n')
    assert discover_workers(three) == 3  # worker-2 is the third port of the layout
    assert discover_workers(parse_exposition("meshserve:num_workers 4\n")) == 4
    assert discover_workers(()) == 0


def test_services_are_told_apart_by_what_they_export() -> None:
    assert classify(parse_exposition(gateway_text(1, 1, 1, 1, {"+Inf": 1}))) == "gateway"
    assert classify(parse_exposition(scheduler_text(0, 0))) == "scheduler"
    assert classify(parse_exposition(worker_text(1, 1, 1, 1))) == "worker"
    assert classify(parse_exposition("meshserve:kvstore_hits_total 1\n")) == "kvstore"
    assert classify(parse_exposition("python_gc_objects_collected_total 1\n")) == "unknown"


def test_natural_order_of_worker_ids() -> None:
    assert sorted(["worker-10", "worker-2", "worker-1"], key=natural_key) == ["worker-1", "worker-2", "worker-10"]


def test_view_between_two_polls() -> None:
    view = build_view(FIRST, SECOND)
    assert view.model == "tiny"
    assert view.health == HEALTH
    assert view.kvstore == "up"
    assert (view.waiting, view.running, view.kv_usage, view.workers_ready) == (2, 3, 0.25, 1)
    assert view.prefix_hit_rate == pytest.approx(0.5)  # 50 hits of 100 queried tokens in the interval
    assert view.requests_per_s == pytest.approx(2.0)  # 4 finished in 2 s
    assert view.generation_tokens_per_s == pytest.approx(100.0)
    assert view.prompt_tokens_per_s == pytest.approx(20.0)
    assert view.generation_tokens_total == 300
    # The interval's 4 first tokens all fell in (0.1, 0.5].
    assert view.ttft_recent
    assert view.ttft_p50 == pytest.approx(0.3)
    assert view.ttft_p99 == pytest.approx(0.1 + 0.4 * 3.96 / 4)
    # No token gap observed in the interval: the cumulative figure stands in, and says so.
    assert not view.itl_recent and view.itl_p50 == pytest.approx(0.01)
    assert (view.targets_up, view.targets_total) == (4, 5)
    assert view.down == ("worker-1 (ConnectError)",)

    first, second = view.workers
    assert first.worker == "worker-0" and first.state == "serving"
    assert (first.running, first.waiting, first.kv_usage) == (3, 2, 0.25)
    assert first.steps_per_s == pytest.approx(10.0)
    assert first.tokens_per_s == pytest.approx(100.0)
    assert first.batch_size == pytest.approx(3.0)
    assert first.step_seconds == pytest.approx(0.02)
    assert second.worker == "worker-1" and second.state == "down" and second.running == 0

    (device,) = view.devices
    assert (device.worker, device.device, device.device_name) == ("worker-0", "npu 0/0", "910B3")
    assert (device.temperature_c, device.power_w, device.utilization, device.healthy) == (45, 90, 0.5, True)
    assert device.memory_used == pytest.approx(0.25)


def test_first_view_has_no_rates_and_cumulative_latencies() -> None:
    view = build_view(None, FIRST)
    assert view.requests_per_s is None and view.generation_tokens_per_s is None
    assert view.generation_tokens_total == 100
    assert not view.ttft_recent
    assert view.ttft_p50 == pytest.approx(0.1)  # rank 2 of 4: the top of the first bucket
    assert view.workers[0].batch_size == pytest.approx(2.0)  # 20 requests over 10 steps, since the start
    assert view.workers[0].state == "serving"  # running requests, though no step rate yet


def test_an_interval_without_first_tokens_shows_the_cumulative_ttft() -> None:
    same_later = Poll(tuple(dataclasses.replace(t, at=t.at + 2.0) for t in FIRST.targets), HEALTH)
    view = build_view(FIRST, same_later)
    assert not view.ttft_recent and view.ttft_p50 == pytest.approx(0.1)
    assert view.workers[0].batch_size == 0  # no step in the interval
    assert view.workers[0].steps_per_s == 0 and view.workers[0].step_seconds is None


def test_a_worker_without_requests_or_steps_is_up_and_the_kv_falls_back_to_its_blocks() -> None:
    lines = worker_text(10, 20, 100, 0.2).splitlines(keepends=True)
    idle = "".join(line for line in lines if not line.startswith("meshserve:worker_batch_requests"))
    poll = Poll((up("worker-0", 1.0, idle),))
    (row,) = build_view(Poll((up("worker-0", 0.0, idle),)), poll).workers
    assert row.state == "up"
    assert row.kv_usage == pytest.approx(0.25)  # 10 of 40 blocks: no scheduler to ask


def test_the_frame_shows_header_workers_and_devices() -> None:
    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(top.render(build_view(FIRST, SECOND), interval=1.0, clock="12:00:00"))
    screen = console.export_text()
    assert "model       tiny" in screen
    assert "gateway SERVING" in screen and "kvstore up" in screen
    assert "gen 100.0 tok/s" in screen and "300 tokens generated" in screen
    assert "TTFT p50 300 ms  p99 496 ms (last interval)   ITL p50 10 ms (since start)" in screen
    assert "down: worker-1 (ConnectError)" in screen
    rows = {row[0]: row for row in worker_rows(screen)}
    assert rows["worker-0"][:9] == ["worker-0", "serving", "3", "2", "3.0", "25.0", "10.0", "100.0", "20"]
    assert rows["worker-1"][1] == "down"
    assert "910B3" in screen and "npu 0/0" in screen


def test_targets_from_the_layout_and_from_flags() -> None:
    layout = top.layout_targets("10.0.0.5", 9400, 2)
    assert [(t.name, t.role, t.url) for t in layout] == [
        ("gateway", "gateway", "http://10.0.0.5:9400/metrics"),
        ("scheduler", "scheduler", "http://10.0.0.5:9401/metrics"),
        ("kvstore", "kvstore", "http://10.0.0.5:9402/metrics"),
        ("worker-0", "worker", "http://10.0.0.5:9403/metrics"),
        ("worker-1", "worker", "http://10.0.0.5:9404/metrics"),
    ]
    assert top.parse_target("worker-a=h:9400") == top.Target("worker-a", "worker", "http://h:9400/metrics")
    assert top.parse_target("http://h:9/metrics?x=1").role == "unknown"
    assert top.parse_target("https://h:9/").url == "https://h:9/metrics"
    for bad in ("gateway=", "http://[bad/", "ftp://h:9/metrics"):
        with pytest.raises(ValueError):
            top.parse_target(bad)
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["top", "--targets", "scheduler="])


# --once against real HTTP endpoints on loopback.


def _free_run(count: int) -> int:
    """A base port with base..base+count-1 all free right now."""
    for _ in range(50):
        base = free_port()
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free ports")


@pytest.fixture
def endpoints() -> Iterator[int]:
    """gateway, scheduler, kvstore and worker-0 of the layout at BASE; worker-1 (BASE+4) listens on nothing."""
    base = _free_run(5)
    texts = [
        gateway_text(300, 90, 6, 2, {"0.1": 2, "0.5": 8, "+Inf": 8}),
        scheduler_text(200, 60),
        "meshserve_kvstore_hits_total 1\n",
        worker_text(30, 80, 300, 0.6),
    ]
    servers = []
    for offset, text in enumerate(texts):
        body = text.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            payload = body

            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(self.payload)

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", base + offset), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        yield base
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


async def test_once_prints_one_frame_with_the_discovered_workers(
    endpoints: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    nowhere = f"127.0.0.1:{free_port()}"
    health = ["--gateway", nowhere, "--scheduler", nowhere]
    ns = _build_parser().parse_args(["top", "--once", "--metrics-port", str(endpoints), "--interval", "0.05", *health])
    assert await top.run(ns) == 0
    screen = capsys.readouterr().out
    assert "gateway down" in screen and "scheduler down" in screen  # no gRPC server there
    assert "300 tokens generated" in screen
    # The scheduler names worker-1, so its port (BASE+4) was scraped too, and found dead.
    assert "4/5 up" in screen and "worker-1 (ConnectError)" in screen
    assert [row[:2] for row in worker_rows(screen)] == [["worker-0", "serving"], ["worker-1", "down"]]


async def test_odd_answers_are_down_with_the_reason(endpoints: int) -> None:
    poller = top.Poller(
        host="127.0.0.1",
        metrics_base=None,
        workers=None,
        extra=[
            top.parse_target(f"http://127.0.0.1:{endpoints}/other"),
            top.parse_target(f"127.0.0.1:{endpoints + 2}"),
        ],
        health={},
        timeout=2.0,
    )
    try:
        poll = await poller.poll()
    finally:
        await poller.aclose()
    missing, kvstore = poll.targets
    assert (missing.up, missing.error) == (False, "HTTP 404")
    assert (kvstore.up, kvstore.role) == (True, "kvstore")  # told by its names


async def test_once_exits_1_when_nothing_answers(capsys: pytest.CaptureFixture[str]) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    health = ["--gateway", nowhere, "--scheduler", nowhere]
    ns = _build_parser().parse_args(["top", "--once", "--targets", f"gateway={nowhere}", "--interval", "0.01", *health])
    assert await top.run(ns) == 1
    assert "0/1 up" in capsys.readouterr().out


# Keys.


async def test_q_on_a_tty_quits_and_the_terminal_settings_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    master, slave = pty.openpty()
    with os.fdopen(slave, "r") as tty_in, os.fdopen(master, "wb", buffering=0) as keyboard:
        monkeypatch.setattr(sys, "stdin", tty_in)
        before = termios.tcgetattr(slave)
        quit = asyncio.Event()
        with top.quit_keys(quit):
            assert not termios.tcgetattr(slave)[3] & termios.ICANON  # cbreak: keys come one by one
            keyboard.write(b"x")
            keyboard.write(b"q")
            await asyncio.wait_for(quit.wait(), timeout=30)
        assert termios.tcgetattr(slave) == before


async def test_unless_quit_cancels_the_poll_when_quit_comes_first() -> None:
    quit = asyncio.Event()
    started = asyncio.Event()

    async def slow() -> int:
        started.set()
        await asyncio.sleep(3600)
        return 1

    async def press() -> None:
        await started.wait()
        quit.set()

    asyncio.get_running_loop().create_task(press())
    assert await top.unless_quit(slow(), quit) is None
    assert await top.unless_quit(asyncio.sleep(0, result=7), asyncio.Event()) == 7
