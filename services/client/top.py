"""`meshserve top`: a terminal view of a running suite from its Prometheus metrics and gRPC health, like
vllm-top or nvtop: the queue, throughput and recent latencies, then one row per worker and per device.

By default the metric endpoints are `meshserve up --metrics-port BASE`'s layout (launcher.metrics_ports) and
the number of workers is read from the scheduler's per-worker series. Every refresh scrapes all endpoints
and checks health concurrently, each bounded by --timeout, so a dead endpoint shows as down instead of
stalling the screen. The figures themselves are computed in top_metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import termios
import time
import tty
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from services.client.launcher import metrics_ports
from services.client.top_metrics import (
    ROLES,
    Poll,
    TargetScrape,
    View,
    build_view,
    classify,
    discover_workers,
    parse_exposition,
)
from services.common.channels import open_channel
from services.common.ports import DEFAULT_METRICS_PORT
from services.gateway.settings import DEFAULT_PORT as GATEWAY_PORT
from services.scheduler.settings import DEFAULT_PORT as SCHEDULER_PORT

if TYPE_CHECKING:
    # Only for annotations: the CLI builds its parser from this module, and httpx takes ~0.2 s to import.
    import httpx

# The port every container of deploy/ exports metrics on; `meshserve up --metrics-port 9400` uses it as base.
DEFAULT_METRICS_BASE = DEFAULT_METRICS_PORT
DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 1.0
T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `meshserve top`."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help=f"the BASE of `meshserve up --metrics-port BASE`: gateway BASE, scheduler BASE+1, kvstore BASE+2, "
        f"worker-i BASE+3+i (default {DEFAULT_METRICS_BASE} unless --targets is given)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="workers of that layout (default: as many as the scheduler reports, at least 1)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="host of the metrics ports and of the default addresses")
    parser.add_argument(
        "--gateway", default=None, help=f"gateway gRPC address for health (default HOST:{GATEWAY_PORT})"
    )
    parser.add_argument(
        "--scheduler", default=None, help=f"scheduler gRPC address for health (default HOST:{SCHEDULER_PORT})"
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        type=_target_argument,
        default=[],
        metavar="URL",
        help="more metrics endpoints, as URL or NAME=URL (NAME gateway, scheduler, kvstore or worker-ID; "
        "without one the service is told by its metric names); instead of the layout unless --metrics-port",
    )
    parser.add_argument("--interval", type=_positive_float, default=DEFAULT_INTERVAL_S, help="seconds per refresh")
    parser.add_argument(
        "--timeout", type=_positive_float, default=DEFAULT_TIMEOUT_S, help="seconds one scrape or health check waits"
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="print one frame and exit (two scrapes INTERVAL apart, so it has rates); exit code 1 if nothing answered",
    )


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


@dataclass(frozen=True)
class Target:
    """One metrics endpoint to scrape."""

    name: str
    role: str  # one of top_metrics.ROLES, or "unknown" (told from what it exports)
    url: str


def _metrics_url(text: str) -> str:
    """http://HOST:PORT/metrics from HOST:PORT or a URL without a path (services serve /metrics only)."""
    url = text if "://" in text else f"http://{text}"
    try:
        parts = urlsplit(url)
    except ValueError as err:
        raise ValueError(f"{text!r} is not a URL: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not an http(s) URL with a host")
    return url if parts.path not in ("", "/") else url.rstrip("/") + "/metrics"


def parse_target(text: str) -> Target:
    """A --targets entry: URL, or NAME=URL where NAME's first part (before a dash) names the service.
    ValueError when the URL is none."""
    name, sep, rest = text.partition("=")
    if sep and name and not any(c in name for c in ":/"):
        role = name.split("-")[0]
        return Target(name, role if role in ROLES else "unknown", _metrics_url(rest))
    url = _metrics_url(text)
    return Target(url, "unknown", url)


def _target_argument(text: str) -> Target:
    try:
        return parse_target(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def layout_targets(host: str, base: int, num_workers: int) -> list[Target]:
    """The endpoints `meshserve up --metrics-port BASE` opens for num_workers workers."""
    return [
        Target(name, name.split("-")[0], f"http://{host}:{port}/metrics")
        for name, port in metrics_ports(base, num_workers).items()
    ]


async def scrape(client: httpx.AsyncClient, target: Target, timeout: float) -> TargetScrape:
    """One endpoint's samples, or why there are none; never raises for a dead or odd endpoint."""
    import httpx

    def down(why: str) -> TargetScrape:
        return TargetScrape(target.name, target.role, target.url, time.monotonic(), None, why)

    try:
        # httpx's timeout bounds each phase (connect, read, ...); this bounds the whole scrape.
        async with asyncio.timeout(timeout):
            reply = await client.get(target.url)
    except TimeoutError:
        return down("timeout")
    except (httpx.HTTPError, httpx.InvalidURL) as err:  # InvalidURL (a bad --targets entry) is no HTTPError
        return down(type(err).__name__)
    at = time.monotonic()
    if reply.status_code != 200:
        return down(f"HTTP {reply.status_code}")
    try:
        samples = parse_exposition(reply.text)
    except ValueError:
        return down("not a Prometheus exposition")
    role = target.role if target.role != "unknown" else classify(samples)
    return TargetScrape(target.name, role, target.url, at, samples)


async def check_health(stub: health_pb2_grpc.HealthStub, timeout: float) -> str:
    """grpc.health.v1 status of the whole server (SERVING, NOT_SERVING), "down", or the gRPC code's name."""
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as err:
        if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return "down"
        return str(err.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class Poller:
    """Scrapes every endpoint and checks health, all at once, once per poll()."""

    def __init__(
        self,
        *,
        host: str,
        metrics_base: int | None,
        workers: int | None,
        extra: Sequence[Target],
        health: dict[str, str],
        timeout: float,
    ) -> None:
        """metrics_base None: only `extra`; workers None: as many as the scheduler reports (at least 1)."""
        import httpx

        self.host = host
        self.metrics_base = metrics_base
        self.num_workers = workers or 1
        self._discover = workers is None
        self.extra = list(extra)
        self.timeout = timeout
        # Endpoints are the suite's own: an HTTP(S)_PROXY meant for the internet must not carry them.
        self._client = httpx.AsyncClient(timeout=timeout, trust_env=False, headers={"Accept": "text/plain"})
        self._channels = {name: open_channel(address) for name, address in health.items()}
        self._health = {name: health_pb2_grpc.HealthStub(ch) for name, ch in self._channels.items()}
        # What unnamed --targets turned out to be, so one that goes down keeps its place in the view.
        self._roles: dict[str, str] = {}

    def targets(self, num_workers: int | None = None) -> list[Target]:
        """The endpoints of one poll: the layout's (for num_workers, default the current count), then extra."""
        extra = [Target(t.name, self._roles.get(t.name, t.role), t.url) for t in self.extra]
        if self.metrics_base is None:
            return extra
        return [*layout_targets(self.host, self.metrics_base, num_workers or self.num_workers), *extra]

    async def _scrape_all(self, targets: Sequence[Target]) -> list[TargetScrape]:
        scrapes = await asyncio.gather(*(scrape(self._client, t, self.timeout) for t in targets))
        for s in scrapes:
            if s.up and s.role != "unknown":
                self._roles[s.name] = s.role
        return list(scrapes)

    async def _check_all(self) -> dict[str, str]:
        names = list(self._health)
        states = await asyncio.gather(*(check_health(self._health[n], self.timeout) for n in names))
        return dict(zip(names, states, strict=True))

    async def poll(self) -> Poll:
        """Every endpoint's scrape and both health checks; takes at most about twice --timeout."""
        targets = self.targets()
        scrapes, health = await asyncio.gather(self._scrape_all(targets), self._check_all())
        if self._discover and self.metrics_base is not None:
            found = max(
                (discover_workers(s.samples or ()) for s in scrapes if s.role == "scheduler" and s.up), default=0
            )
            # Only ever more: a worker the scheduler lost keeps its row, shown down, instead of vanishing.
            if found > self.num_workers:
                layout = self.targets(found)
                known = {t.name for t in targets}
                scrapes += await self._scrape_all([t for t in layout if t.name not in known])
                self.num_workers = found
        return Poll(tuple(scrapes), health)

    async def aclose(self) -> None:
        """Close the HTTP client and the health channels."""
        await self._client.aclose()
        for channel in self._channels.values():
            await channel.close()


# Rendering: pure functions of a View, so `--once` and the live screen print the same frame.


def _num(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


_STYLES = {"SERVING": "green", "serving": "green", "up": "cyan", "NOT_SERVING": "yellow"}


def _state(text: str | None) -> Text:
    if text is None:
        return Text("-", style="dim")
    return Text(text, style=_STYLES.get(text, "bold red"))


def _window(value: float | None, recent: bool) -> str:
    """Which observations a latency figure covers."""
    if value is None:
        return ""
    return " (last interval)" if recent else " (since start)"


def _header(view: View) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("model", view.model or "?")
    health = Text()
    for name in ("gateway", "scheduler"):
        health.append(f"{name} ")
        health.append_text(_state(view.health.get(name)))
        health.append("   ")
    health.append("kvstore ")
    health.append_text(_state(view.kvstore))
    grid.add_row("health", health)
    ready = "-" if view.workers_ready is None else str(view.workers_ready)
    grid.add_row("workers", f"{ready} ready of {len(view.workers)} shown")
    grid.add_row(
        "queue",
        f"waiting {_num(view.waiting, '.0f')}   running {_num(view.running, '.0f')}   KV {_pct(view.kv_usage)} %"
        f"   prefix hits {_pct(view.prefix_hit_rate)} %",
    )
    total = "-" if view.generation_tokens_total is None else f"{view.generation_tokens_total:,.0f}"
    grid.add_row(
        "throughput",
        f"{_num(view.requests_per_s, '.2f')} req/s   gen {_num(view.generation_tokens_per_s)} tok/s   "
        f"prompt {_num(view.prompt_tokens_per_s)} tok/s   {total} tokens generated",
    )
    grid.add_row(
        "latency",
        f"TTFT p50 {_seconds(view.ttft_p50)}  p99 {_seconds(view.ttft_p99)}{_window(view.ttft_p50, view.ttft_recent)}"
        f"   ITL p50 {_seconds(view.itl_p50)}{_window(view.itl_p50, view.itl_recent)}",
    )
    targets = Text(f"{view.targets_up}/{view.targets_total} up")
    if view.down:
        targets.append("   down: " + ", ".join(view.down), style="red")
    grid.add_row("metrics", targets)
    return grid


def _workers_table(view: View) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title="workers", title_justify="left", pad_edge=False)
    table.add_column("worker")
    table.add_column("state")
    for name in ("running", "waiting", "batch", "KV %", "steps/s", "tok/s", "step"):
        table.add_column(name, justify="right")
    for row in view.workers:
        table.add_row(
            row.worker,
            _state(row.state),
            _num(row.running, ".0f"),
            _num(row.waiting, ".0f"),
            _num(row.batch_size),
            _pct(row.kv_usage),
            _num(row.steps_per_s),
            _num(row.tokens_per_s),
            _seconds(row.step_seconds),
        )
    return table


def _devices_table(view: View) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title="devices", title_justify="left", pad_edge=False)
    table.add_column("worker")
    table.add_column("device")
    table.add_column("name")
    for name in ("temp °C", "power W", "HBM %", "util %"):
        table.add_column(name, justify="right")
    table.add_column("health")
    for row in view.devices:
        health = None if row.healthy is None else ("up" if row.healthy else "unhealthy")
        table.add_row(
            row.worker,
            row.device or "-",
            row.device_name or "-",
            _num(row.temperature_c, ".0f"),
            _num(row.power_w, ".0f"),
            _pct(row.memory_used),
            _pct(row.utilization),
            _state(health),
        )
    return table


def render(view: View, *, interval: float, clock: str = "", live: bool = True) -> RenderableType:
    """One frame: the header, the workers and, when any worker reports devices, the devices."""
    title = Text.assemble(("meshserve top", "bold"), f"   {clock}   every {interval:g} s", "   q quits" if live else "")
    parts: list[RenderableType] = [title, _header(view), _workers_table(view)]
    if view.devices:
        parts.append(_devices_table(view))
    return Group(*parts)


# The loop.


@contextlib.contextmanager
def quit_keys(quit: asyncio.Event) -> Iterator[None]:
    """While inside: q sets quit. stdin goes to cbreak mode (keys come one by one, unechoed) if it is a TTY;
    its settings are restored on the way out, however that happens. Ctrl-C is left to the SIGINT handler."""
    if sys.stdin is None or not sys.stdin.isatty():
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()

    def on_input() -> None:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data or b"q" in data.lower():  # no data: the terminal went away
            quit.set()

    tty.setcbreak(fd)
    loop.add_reader(fd, on_input)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def unless_quit(awaitable: Awaitable[T], quit: asyncio.Event) -> T | None:
    """awaitable's result; None (and it cancelled) if quit is set first, so a key is never kept waiting."""
    task = asyncio.ensure_future(awaitable)
    waiter = asyncio.ensure_future(quit.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


def _clock() -> str:
    return time.strftime("%H:%M:%S")


async def _watch(poller: Poller, interval: float) -> int:
    loop = asyncio.get_running_loop()
    quit = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, quit.set)
    console = Console()
    try:
        with (
            quit_keys(quit),
            Live(
                console=console, screen=True, auto_refresh=False, redirect_stdout=False, redirect_stderr=False
            ) as live,
        ):
            live.update(Text("meshserve top: scraping..."), refresh=True)
            previous: Poll | None = None
            while not quit.is_set():
                started = loop.time()
                current = await unless_quit(poller.poll(), quit)
                if current is None:
                    break
                live.update(render(build_view(previous, current), interval=interval, clock=_clock()), refresh=True)
                previous = current
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(quit.wait(), timeout=max(0.0, started + interval - loop.time()))
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


async def _once(poller: Poller, interval: float) -> int:
    first = await poller.poll()
    await asyncio.sleep(interval)
    second = await poller.poll()
    view = build_view(first, second)
    Console().print(render(view, interval=interval, clock=_clock(), live=False))
    return 0 if view.targets_up or "SERVING" in view.health.values() else 1


def make_poller(ns: argparse.Namespace) -> Poller:
    """The Poller of `meshserve top`'s flags."""
    extra: list[Target] = ns.targets
    base = ns.metrics_port if ns.metrics_port is not None or extra else DEFAULT_METRICS_BASE
    return Poller(
        host=ns.host,
        metrics_base=base,
        workers=ns.workers,
        extra=extra,
        health={
            "gateway": ns.gateway or f"{ns.host}:{GATEWAY_PORT}",
            "scheduler": ns.scheduler or f"{ns.host}:{SCHEDULER_PORT}",
        },
        timeout=ns.timeout,
    )


async def run(ns: argparse.Namespace) -> int:
    """`meshserve top`: the live screen until q or Ctrl-C, or one frame with --once."""
    if ns.workers is not None and ns.workers < 1:
        print("meshserve top: --workers must be at least 1", file=sys.stderr)
        return 2
    poller = make_poller(ns)
    try:
        return await (_once(poller, ns.interval) if ns.once else _watch(poller, ns.interval))
    finally:
        await poller.aclose()
