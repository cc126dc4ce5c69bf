"""The figures of `meshserve top`: scrapes parsed into samples, counter rates, histogram quantiles, and the view
of one refresh built from two polls.

Everything here is pure (no I/O, no clock: times come in with the scrapes), so each figure is checked on
exposition text built by hand. The metric names are docs/metrics.md's.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# Gateway: what clients see.
TTFT = "meshserve:time_to_first_token_seconds"
ITL = "meshserve:inter_token_latency_seconds"
REQUEST_SUCCESS = "meshserve:request_success_total"
GENERATION_TOKENS = "meshserve:generation_tokens_total"
PROMPT_TOKENS = "meshserve:prompt_tokens_total"
REQUESTS_STARTED = "meshserve:requests_started_total"
# Scheduler: the queue and each worker as the scheduler sees it (series with a `worker` label).
NUM_WAITING = "meshserve:num_requests_waiting"
NUM_RUNNING = "meshserve:num_requests_running"
KV_USAGE = "meshserve:kv_cache_usage_perc"
NUM_WORKERS = "meshserve:num_workers"
PREFIX_QUERIES = "meshserve:prefix_cache_queries_total"
PREFIX_HITS = "meshserve:prefix_cache_hits_total"
WORKER_RUNNING = "meshserve:worker_num_requests_running"  # the scheduler's view of one worker
WORKER_BATCH = "meshserve:worker_batch_requests"  # the worker's own persistent batch
WORKER_WAITING = "meshserve:worker_num_requests_waiting"
WORKER_KV_USAGE = "meshserve:worker_kv_cache_usage_perc"
WORKER_ROUTED = "meshserve:worker_requests_routed_total"
# Worker: its steps and its devices.
WORKER_STEPS = "meshserve:worker_steps_total"
WORKER_STEP_DURATION = "meshserve:worker_step_duration_seconds"
WORKER_BATCH_SIZE = "meshserve:worker_batch_size"
WORKER_STEP_TOKENS = "meshserve:worker_step_tokens"
WORKER_KV_BLOCKS_USED = "meshserve:worker_kv_blocks_used"
WORKER_KV_BLOCKS_TOTAL = "meshserve:worker_kv_blocks_total"
DEVICE_TEMPERATURE = "meshserve:device_temperature_celsius"
DEVICE_POWER = "meshserve:device_power_watts"
DEVICE_MEMORY_USED = "meshserve:device_memory_used_bytes"
DEVICE_MEMORY_TOTAL = "meshserve:device_memory_total_bytes"
DEVICE_UTILIZATION = "meshserve:device_utilization_ratio"
DEVICE_HEALTHY = "meshserve:device_healthy"
DEVICE_PREFIX = "meshserve:device_"
# The catalogue's spelling, and the one the kvstore has exported so far.
KVSTORE_PREFIXES = ("meshserve:kvstore_", "meshserve_kvstore_")

# The scheduler's per-worker series: which workers it knows.
SCHEDULER_WORKER_SERIES = (WORKER_RUNNING, WORKER_WAITING, WORKER_KV_USAGE, WORKER_ROUTED)
ROLES = ("gateway", "scheduler", "kvstore", "worker")
_WORKER_INDEX = re.compile(r"worker-(\d+)")


@dataclass(frozen=True)
class Sample:
    """One sample of an exposition: `name{labels} value`."""

    name: str
    labels: Mapping[str, str]
    value: float


def parse_exposition(text: str) -> tuple[Sample, ...]:
    """Every sample of a Prometheus text exposition, flat; ValueError when the text is not one."""
    return tuple(
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


def _selected(samples: Iterable[Sample], name: str, match: Mapping[str, str]) -> list[Sample]:
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in match.items())]


def total(samples: Iterable[Sample], name: str, **match: str) -> float | None:
    """The sum of the series named `name` whose labels include `match`; None when there is none.

    Summing lets one figure cover the label values a view does not split on (`finished_reason`, `model_name`).
    """
    values = [s.value for s in _selected(samples, name, match)]
    return math.fsum(values) if values else None


def by_label(samples: Iterable[Sample], name: str, label: str) -> dict[str, float]:
    """The series named `name` summed per value of `label` (series without it left out)."""
    sums: dict[str, float] = {}
    for s in samples:
        if s.name == name and label in s.labels:
            sums[s.labels[label]] = sums.get(s.labels[label], 0.0) + s.value
    return sums


def label_values(samples: Iterable[Sample], label: str, names: Iterable[str] | None = None) -> list[str]:
    """The distinct values of `label` (over the series in `names`, or all), in order of first appearance."""
    wanted = None if names is None else set(names)
    seen: dict[str, None] = {}
    for s in samples:
        if (wanted is None or s.name in wanted) and label in s.labels:
            seen.setdefault(s.labels[label], None)
    return list(seen)


def buckets(samples: Iterable[Sample], histogram: str, **match: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound (`le`, +Inf as math.inf), series summed."""
    counts: dict[float, float] = {}
    for s in _selected(samples, histogram + "_bucket", match):
        bound = float(s.labels["le"]) if "le" in s.labels else None
        if bound is not None:
            counts[bound] = counts.get(bound, 0.0) + s.value
    return counts


def grown(previous: float, current: float) -> float:
    """How much a counter grew; one that went down was restarted, so all it holds now is new."""
    return current - previous if current >= previous else current


def rate(previous: float | None, current: float | None, elapsed: float) -> float | None:
    """A counter's growth per second between two scrapes `elapsed` seconds apart; None without both."""
    if previous is None or current is None or elapsed <= 0:
        return None
    return grown(previous, current) / elapsed


def bucket_delta(previous: Mapping[float, float] | None, current: Mapping[float, float]) -> dict[float, float]:
    """The observations between two scrapes, per bucket (cumulative, like the buckets themselves).

    After a restart (a count went down, or the bounds changed) the current buckets are all new.
    """
    if not previous or set(previous) != set(current) or any(current[b] < previous[b] for b in current):
        return dict(current)
    return {b: current[b] - previous[b] for b in current}


def histogram_quantile(q: float, cumulative: Mapping[float, float]) -> float | None:
    """The q-quantile estimated from cumulative bucket counts, as Prometheus' histogram_quantile does.

    Linear interpolation inside the bucket holding the rank (from 0 for the first bucket); a rank in the
    +Inf bucket answers the highest finite bound. None without observations or without a +Inf bucket.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], not {q}")
    bounds = sorted(cumulative)
    if len(bounds) < 2 or bounds[-1] != math.inf:
        return None
    # Counts scraped while a request was being observed can be off by one between buckets: keep them monotonic.
    counts: list[float] = []
    for b in bounds:
        counts.append(max(cumulative[b], counts[-1] if counts else 0.0))
    observations = counts[-1]
    if observations <= 0:
        return None
    rank = q * observations
    index = bisect.bisect_left(counts, rank)
    if index == len(bounds) - 1:
        return bounds[-2]
    if index == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if index == 0 else bounds[index - 1]
    below = 0.0 if index == 0 else counts[index - 1]
    in_bucket = counts[index] - below
    if in_bucket <= 0:
        return bounds[index]
    return start + (bounds[index] - start) * (rank - below) / in_bucket


def mean_between(
    previous_sum: float | None, previous_count: float | None, current_sum: float | None, current_count: float | None
) -> float | None:
    """A histogram's mean over the observations between two scrapes (all of them without a previous scrape);
    0 when none happened in between, None when the histogram is not there."""
    if current_sum is None or current_count is None:
        return None
    if previous_sum is None or previous_count is None or current_count < previous_count:
        return current_sum / current_count if current_count else None
    count = current_count - previous_count
    return (current_sum - previous_sum) / count if count else 0.0


def classify(samples: Sequence[Sample]) -> str:
    """Which service an exposition comes from, by the names only it exports ("unknown" when none)."""
    names = {s.name for s in samples}
    if any(n.startswith(KVSTORE_PREFIXES) for n in names):
        return "kvstore"
    if NUM_WAITING in names or NUM_WORKERS in names:
        return "scheduler"
    worker_names = (WORKER_STEPS, WORKER_BATCH_SIZE + "_count", WORKER_KV_BLOCKS_TOTAL)
    if any(n in names for n in worker_names) or any(n.startswith(DEVICE_PREFIX) for n in names):
        return "worker"
    if names & {GENERATION_TOKENS, REQUESTS_STARTED, REQUEST_SUCCESS, TTFT + "_count"}:
        return "gateway"
    return "unknown"


def worker_index(worker_id: str) -> int | None:
    """i of `meshserve up`'s worker id worker-i; None for any other id."""
    found = _WORKER_INDEX.fullmatch(worker_id)
    return int(found.group(1)) if found else None


def discover_workers(scheduler: Sequence[Sample]) -> int:
    """How many worker metrics ports `meshserve up` opened, judged from the scheduler's exposition: the most
    of the workers it has series for (worker-i counts as i + 1 workers) and its `num_workers` gauge."""
    ids = label_values(scheduler, "worker", SCHEDULER_WORKER_SERIES)
    indexes = [i + 1 for i in map(worker_index, ids) if i is not None]
    attached = total(scheduler, NUM_WORKERS) or 0.0
    return max([len(ids), *indexes, int(attached)])


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that puts worker-2 before worker-10."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part)


@dataclass(frozen=True)
class TargetScrape:
    """One metrics endpoint's answer (or its failure) in one poll."""

    name: str  # gateway, scheduler, kvstore, worker-i, or the URL of an unnamed --targets entry
    role: str  # one of ROLES, or "unknown"
    url: str
    at: float  # when the answer came (monotonic seconds): rates divide by the difference
    samples: tuple[Sample, ...] | None = None  # None: down
    error: str | None = None

    @property
    def up(self) -> bool:
        """It answered with an exposition."""
        return self.samples is not None


@dataclass(frozen=True)
class Poll:
    """Everything one refresh read: every target's scrape and the gRPC health of gateway and scheduler."""

    targets: tuple[TargetScrape, ...]
    # "gateway"/"scheduler" -> SERVING, NOT_SERVING, down, or another gRPC code's name.
    health: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Pair:
    """A target now and at its previous answer, for rates and interval histograms."""

    current: TargetScrape
    previous: TargetScrape | None

    @property
    def samples(self) -> tuple[Sample, ...]:
        return self.current.samples or ()

    def value(self, name: str, **match: str) -> float | None:
        return total(self.samples, name, **match)

    def rate(self, name: str, **match: str) -> float | None:
        if self.previous is None:
            return None
        before = total(self.previous.samples or (), name, **match)
        return rate(before, self.value(name, **match), self.current.at - self.previous.at)

    def recent_buckets(self, histogram: str) -> tuple[dict[float, float], bool]:
        """The buckets of the last interval, and True; the cumulative ones and False when that interval had
        no observation (or there was no earlier scrape)."""
        now = buckets(self.samples, histogram)
        if self.previous is not None:
            delta = bucket_delta(buckets(self.previous.samples or (), histogram), now)
            if delta.get(math.inf, 0.0) > 0:
                return delta, True
        return now, False

    def recent_mean(self, histogram: str) -> float | None:
        previous = self.previous.samples or () if self.previous is not None else None
        return mean_between(
            None if previous is None else total(previous, histogram + "_sum"),
            None if previous is None else total(previous, histogram + "_count"),
            self.value(histogram + "_sum"),
            self.value(histogram + "_count"),
        )

    def recent_ratio(self, numerator: str, denominator: str) -> float | None:
        """Growth of one counter over another's in the last interval (since the start without one)."""
        num, den = self.value(numerator), self.value(denominator)
        if num is None or den is None:
            return None
        if self.previous is not None:
            prev_num = total(self.previous.samples or (), numerator)
            prev_den = total(self.previous.samples or (), denominator)
            if prev_num is not None and prev_den is not None and grown(prev_den, den) > 0:
                return grown(prev_num, num) / grown(prev_den, den)
        return num / den if den else None


@dataclass(frozen=True)
class WorkerRow:
    """One worker as the scheduler and its own metrics show it."""

    worker: str
    state: str  # serving (running requests or stepping), up, down (its metrics endpoint does not answer)
    running: float | None = None
    waiting: float | None = None
    batch_size: float | None = None  # mean requests per step over the interval
    kv_usage: float | None = None  # 0-1
    steps_per_s: float | None = None
    tokens_per_s: float | None = None  # tokens computed (prompt and generated) per second
    step_seconds: float | None = None  # mean step time over the interval


@dataclass(frozen=True)
class DeviceRow:
    """One card/chip a worker reports."""

    worker: str
    device: str  # platform card/chip
    device_name: str | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    memory_used: float | None = None  # 0-1 of HBM
    utilization: float | None = None  # 0-1
    healthy: bool | None = None


@dataclass(frozen=True)
class View:
    """What one frame shows."""

    model: str | None
    health: Mapping[str, str]
    kvstore: str | None  # up, down; None when no kvstore target is watched
    workers_ready: int | None  # the scheduler's num_workers
    waiting: float | None
    running: float | None
    kv_usage: float | None
    prefix_hit_rate: float | None
    requests_per_s: float | None
    generation_tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    generation_tokens_total: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    # True: that histogram's figures are the last interval's; False: since the services started (the interval
    # had no observation, or there was no earlier scrape).
    ttft_recent: bool
    itl_recent: bool
    workers: tuple[WorkerRow, ...]
    devices: tuple[DeviceRow, ...]
    targets_up: int
    targets_total: int
    down: tuple[str, ...]  # "name (why)" of every target that did not answer


def _pairs(previous: Poll | None, current: Poll) -> list[_Pair]:
    earlier = {t.name: t for t in previous.targets if t.up} if previous is not None else {}
    return [_Pair(t, earlier.get(t.name)) for t in current.targets]


def _first_up(pairs: Sequence[_Pair], role: str) -> _Pair | None:
    return next((p for p in pairs if p.current.role == role and p.current.up), None)


def _model_name(pairs: Sequence[_Pair]) -> str | None:
    for role in ("gateway", "scheduler", "worker"):
        for pair in pairs:
            if pair.current.role == role:
                names = label_values(pair.samples, "model_name")
                if names:
                    return ", ".join(names)
    return None


def _worker_id(pair: _Pair) -> str:
    """The id a worker's series carry (from its last answer while it is down), else the target's name."""
    for scrape in (pair.current, pair.previous):
        if scrape is not None and scrape.samples:
            ids = label_values(scrape.samples, "worker")
            if ids:
                return ids[0]
    return pair.current.name


def _worker_row(worker: str, own: _Pair | None, scheduler: _Pair | None) -> WorkerRow:
    seen = scheduler.samples if scheduler is not None else ()
    # The scheduler's view of the worker first: the router acts on it; the worker's own as a fallback.
    running = total(seen, WORKER_RUNNING, worker=worker)
    kv_usage = total(seen, WORKER_KV_USAGE, worker=worker)
    steps = tokens = batch = step_s = None
    if own is not None and own.current.up:
        if running is None:
            running = own.value(WORKER_BATCH)
        if kv_usage is None:
            used, blocks = own.value(WORKER_KV_BLOCKS_USED), own.value(WORKER_KV_BLOCKS_TOTAL)
            kv_usage = used / blocks if used is not None and blocks else None
        steps = own.rate(WORKER_STEPS)
        tokens = own.rate(WORKER_STEP_TOKENS + "_sum")
        batch = own.recent_mean(WORKER_BATCH_SIZE)
        # An idle interval has no step time (where batch size 0 says what happened: nothing ran).
        step_s = own.recent_mean(WORKER_STEP_DURATION) if steps != 0 else None
    if own is not None and not own.current.up:
        state = "down"
    elif (running or 0) > 0 or (steps or 0) > 0:
        state = "serving"
    else:
        state = "up"
    return WorkerRow(
        worker=worker,
        state=state,
        running=running,
        waiting=total(seen, WORKER_WAITING, worker=worker),
        batch_size=batch,
        kv_usage=kv_usage,
        steps_per_s=steps,
        tokens_per_s=tokens,
        step_seconds=step_s,
    )


_DEVICE_GAUGES = {
    DEVICE_TEMPERATURE: "temperature",
    DEVICE_POWER: "power",
    DEVICE_MEMORY_USED: "used",
    DEVICE_MEMORY_TOTAL: "total",
    DEVICE_UTILIZATION: "utilization",
    DEVICE_HEALTHY: "healthy",
}


def _device_rows(worker: str, own: _Pair) -> list[DeviceRow]:
    """One row per (platform, card, chip) of the worker's device_* gauges."""
    values: dict[tuple[str, str, str], dict[str, float]] = {}
    names: dict[tuple[str, str, str], str] = {}
    for s in own.samples:
        if s.name not in _DEVICE_GAUGES:
            continue
        key = (s.labels.get("platform", ""), s.labels.get("card", ""), s.labels.get("chip", ""))
        values.setdefault(key, {})[_DEVICE_GAUGES[s.name]] = s.value
        if s.labels.get("device_name"):
            names[key] = s.labels["device_name"]
    rows = []
    for key in sorted(values, key=lambda k: tuple(natural_key(part) for part in k)):
        platform, card, chip = key
        got = values[key]
        used, size, healthy = got.get("used"), got.get("total"), got.get("healthy")
        rows.append(
            DeviceRow(
                worker=worker,
                device=" ".join(part for part in (platform, "/".join(p for p in (card, chip) if p)) if part),
                device_name=names.get(key),
                temperature_c=got.get("temperature"),
                power_w=got.get("power"),
                memory_used=used / size if used is not None and size else None,
                utilization=got.get("utilization"),
                healthy=None if healthy is None else healthy >= 1.0,
            )
        )
    return rows


def build_view(previous: Poll | None, current: Poll) -> View:
    """The frame for `current`, with rates and interval latencies against `previous` (the poll before)."""
    pairs = _pairs(previous, current)
    gateway = _first_up(pairs, "gateway")
    scheduler = _first_up(pairs, "scheduler")

    # Latencies are the gateway's (what a client sees); a scheduler exporting the same name stands in.
    ttft_p50 = ttft_p99 = itl_p50 = None
    ttft_recent = itl_recent = False
    for source in (gateway, scheduler):
        if source is None or not buckets(source.samples, TTFT):
            continue
        ttft, ttft_recent = source.recent_buckets(TTFT)
        ttft_p50, ttft_p99 = histogram_quantile(0.5, ttft), histogram_quantile(0.99, ttft)
        itl, itl_recent = source.recent_buckets(ITL)
        itl_p50 = histogram_quantile(0.5, itl)
        break

    own: dict[str, _Pair] = {}
    for pair in pairs:
        if pair.current.role == "worker":
            own.setdefault(_worker_id(pair), pair)
    ids = set(own)
    if scheduler is not None:
        ids.update(label_values(scheduler.samples, "worker", SCHEDULER_WORKER_SERIES))
    workers = tuple(_worker_row(w, own.get(w), scheduler) for w in sorted(ids, key=natural_key))
    devices = tuple(row for w in sorted(own, key=natural_key) if own[w].current.up for row in _device_rows(w, own[w]))

    kvstores = [p.current for p in pairs if p.current.role == "kvstore"]
    down = tuple(f"{p.current.name} ({p.current.error or 'no answer'})" for p in pairs if not p.current.up)
    ready = scheduler.value(NUM_WORKERS) if scheduler is not None else None
    return View(
        model=_model_name(pairs),
        health=dict(current.health),
        kvstore=None if not kvstores else ("up" if any(k.up for k in kvstores) else "down"),
        workers_ready=None if ready is None else int(ready),
        waiting=scheduler.value(NUM_WAITING) if scheduler is not None else None,
        running=scheduler.value(NUM_RUNNING) if scheduler is not None else None,
        kv_usage=scheduler.value(KV_USAGE) if scheduler is not None else None,
        prefix_hit_rate=scheduler.recent_ratio(PREFIX_HITS, PREFIX_QUERIES) if scheduler is not None else None,
        requests_per_s=gateway.rate(REQUEST_SUCCESS) if gateway is not None else None,
        generation_tokens_per_s=gateway.rate(GENERATION_TOKENS) if gateway is not None else None,
        prompt_tokens_per_s=gateway.rate(PROMPT_TOKENS) if gateway is not None else None,
        generation_tokens_total=gateway.value(GENERATION_TOKENS) if gateway is not None else None,
        ttft_p50=ttft_p50,
        ttft_p99=ttft_p99,
        itl_p50=itl_p50,
        ttft_recent=ttft_recent,
        itl_recent=itl_recent,
        workers=workers,
        devices=devices,
        targets_up=sum(p.current.up for p in pairs),
        targets_total=len(pairs),
        down=down,
    )
