"""`meshserve bench`: a serving benchmark against the gateway or any OpenAI-compatible server, or an in-process
baseline on the same workload.

The flags of `vllm bench serve` that the bench has a counterpart for are accepted with vLLM's meaning, most as
aliases of the bench's own (--dataset-name for --dataset, --served-model-name for --model-name).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.client.bench.datasets import (
    BenchRequest,
    Conversation,
    flatten,
    jsonl_dataset,
    multi_turn_dataset,
    random_dataset,
    ratio_range,
    shared_prefix_dataset,
    single_turns,
    turn_indices,
)
from services.client.bench.metrics import DEFAULT_PERCENTILES, PERCENTILE_METRICS, SLO_METRICS
from services.client.bench.records import RequestRecord
from services.common.model_paths import embedded_model_dir

if TYPE_CHECKING:
    # Only for annotations: the CLI builds its parser from this module, and grpc is slow to import.
    from services.client.bench.cache_stats import CacheReport
    from services.client.bench.runner import Send

DEFAULT_ADDRESS = "127.0.0.1:50051"
# The openai backend's default server, vLLM's default host and port (kept here: openai_backend imports httpx).
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
BACKENDS = ("meshserve", "openai", "transformers", "raw-runner")
# Backends that serve over the network, with arrivals, concurrency and warm-ups; the rest run in-process.
SERVED_BACKENDS = ("meshserve", "openai")
# Other names of a backend: grpc is meshserve's Generation API.
BACKEND_ALIASES = {"grpc": "meshserve"}
DATASETS = ("random", "shared-prefix", "jsonl", "multi-turn")
# vLLM's --dataset-name values that mean one of the bench's datasets: "custom" is JSONL of {"prompt": ...}.
DATASET_ALIASES = {"custom": "jsonl"}
CONNECT_TIMEOUT_S = 10.0


class UsageError(ValueError):
    """A bad flag value; the message names the flag."""


def length_range(text: str) -> tuple[int, int]:
    """ "N" or "LO-HI" (inclusive, 1 <= LO <= HI) as a (lo, hi) pair."""
    lo_text, sep, hi_text = text.strip().partition("-")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI with whole numbers, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def request_rate(text: str) -> float:
    """A positive number of requests per second, or "inf" (all at once)."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'inf', got {text!r}") from None
    if math.isnan(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return rate


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    return _int_at_least(1, text)


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    return _int_at_least(0, text)


def backend_name(text: str) -> str:
    """One of BACKENDS, or an alias of one (grpc)."""
    name = text.strip().lower()
    name = BACKEND_ALIASES.get(name, name)
    if name not in BACKENDS:
        names = ", ".join([*BACKENDS, *BACKEND_ALIASES])
        raise argparse.ArgumentTypeError(f"expected one of {names}, got {text!r}")
    return name


def dataset_name(text: str) -> str:
    """One of DATASETS, or vLLM's name for one; other vLLM datasets are refused saying what to use instead."""
    name = text.strip().lower()
    name = DATASET_ALIASES.get(name, name)
    if name in DATASETS:
        return name
    hint = ""
    if name == "sharegpt":
        hint = (
            "; for ShareGPT, write each conversation's first human turn as a JSONL line "
            '{"prompt": ..., "output_len": N} and pass --dataset jsonl --dataset-path FILE'
        )
    elif name == "prefix_repetition":
        hint = "; --dataset shared-prefix is the bench's nearest (one common prefix, random suffixes)"
    aliases = ", ".join(f"{alias} (= {target})" for alias, target in DATASET_ALIASES.items())
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a dataset of meshserve bench; it has {', '.join(DATASETS)}, and vLLM's {aliases}{hint}"
    )


def range_ratio(text: str) -> float:
    """vLLM's --random-range-ratio: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text!r}")
    return value


def percentile_metrics(text: str) -> tuple[str, ...]:
    """vLLM's --percentile-metrics: comma-separated names among ttft, tpot, itl, e2el."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    bad = [name for name in names if name not in PERCENTILE_METRICS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(PERCENTILE_METRICS)}, got {text!r}"
        )
    return tuple(dict.fromkeys(names))


def metric_percentiles(text: str) -> tuple[float, ...]:
    """vLLM's --metric-percentiles: comma-separated percentiles, each in [0, 100]."""
    values: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        if not 0 <= value <= 100:
            raise argparse.ArgumentTypeError(f"percentiles must lie in [0, 100], got {part!r} in {text!r}")
        values.append(value)
    return tuple(dict.fromkeys(values))


def slo(text: str) -> tuple[str, float]:
    """One goodput SLO "metric:ms" (metric one of ttft, tpot, itl, e2el)."""
    name, sep, value = text.partition(":")
    name = name.strip().lower()
    if not sep or name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(
            f"expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}, got {text!r}"
        )
    try:
        limit = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds in {text!r}") from None
    if not math.isfinite(limit) or limit <= 0:
        raise argparse.ArgumentTypeError(f"the limit must be a finite number of ms > 0, got {text!r}")
    return name, limit


def goodput_slos(pairs: list[tuple[str, float]] | None) -> dict[str, float] | None:
    """The SLOs of --goodput as a dict; a metric given twice is an error."""
    if not pairs:
        return None
    slos: dict[str, float] = {}
    for name, limit in pairs:
        if name in slos:
            raise UsageError(f"--goodput: {name} given more than once")
        slos[name] = limit
    return slos


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench verb's flags."""

    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="gateway host:port (meshserve backend)")
    parser.add_argument(
        "--backend",
        type=backend_name,
        default="meshserve",
        metavar="{meshserve,grpc,openai,transformers,raw-runner}",
        help="who serves the workload: meshserve (alias grpc) is the gateway's gRPC Generation API at --address; "
        "openai streams /v1/completions from any OpenAI-compatible server at --base-url (vLLM, llama.cpp, ...); "
        "transformers and raw-runner run it in-process",
    )
    parser.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help=f"openai backend: the server, with or without /v1 (default {DEFAULT_BASE_URL}); requests go to "
        "/v1/completions",
    )
    parser.add_argument(
        "--model-name",
        "--served-model-name",
        dest="model_name",
        default=None,
        metavar="NAME",
        help="openai backend: the request's model field (default: the first id of GET /v1/models)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"model directory: vocabulary and tokenizer for the dataset (for --backend openai, the served "
        f"model's, so that prompt ids fall in its vocabulary), weights for the in-process backends "
        f"(default: the embedded model, {embedded_model_dir()})",
    )
    parser.add_argument(
        "--dataset",
        "--dataset-name",
        dest="dataset",
        type=dataset_name,
        default="random",
        metavar="NAME",
        help=f"the workload: {', '.join(DATASETS)} (default random; vLLM's --dataset-name custom is jsonl, its "
        "other datasets are refused)",
    )
    parser.add_argument("--dataset-path", type=Path, default=None, help="JSONL file for --dataset jsonl")
    parser.add_argument(
        "--num-prompts", type=positive_int, default=100, help="requests (multi-turn: --num-conversations instead)"
    )
    parser.add_argument("--random-input-len", type=length_range, default=(1024, 1024), metavar="N|LO-HI")
    parser.add_argument("--random-output-len", type=length_range, default=(128, 128), metavar="N|LO-HI")
    parser.add_argument(
        "--random-range-ratio",
        type=range_ratio,
        default=0.0,
        metavar="R",
        help="random dataset, as vLLM: lengths uniform in [floor(N*(1-R)), ceil(N*(1+R))] around --random-input-len "
        "and --random-output-len N (0 <= R < 1; not with a LO-HI range)",
    )
    parser.add_argument("--shared-prefix-len", type=positive_int, default=256, help="tokens common to every prompt")
    parser.add_argument("--shared-suffix-len", type=length_range, default=(256, 256), metavar="N|LO-HI")
    parser.add_argument("--shared-output-len", type=length_range, default=(128, 128), metavar="N|LO-HI")
    parser.add_argument(
        "--jsonl-output-len",
        "--custom-output-len",
        dest="jsonl_output_len",
        type=positive_int,
        default=128,
        help="output length of JSONL lines without one",
    )
    parser.add_argument(
        "--num-conversations", type=positive_int, default=8, help="multi-turn: conversations, run concurrently"
    )
    parser.add_argument("--num-turns", type=positive_int, default=6, help="multi-turn: turns per conversation")
    parser.add_argument(
        "--turn-input-len",
        type=length_range,
        default=(200, 200),
        metavar="N|LO-HI",
        help="multi-turn: new user tokens per turn (each prompt also holds the history)",
    )
    parser.add_argument(
        "--first-turn-input-len",
        type=length_range,
        default=None,
        metavar="N|LO-HI",
        help="multi-turn: user tokens of the opening turn (a document, a system prompt); default --turn-input-len",
    )
    parser.add_argument(
        "--turn-output-len",
        type=length_range,
        default=(64, 64),
        metavar="N|LO-HI",
        help="multi-turn: tokens generated per turn (the history's synthetic reply has the same length)",
    )
    parser.add_argument(
        "--request-rate",
        type=request_rate,
        default=math.inf,
        help="requests per second (multi-turn: conversation starts), or inf (all at once)",
    )
    parser.add_argument(
        "--burstiness", type=positive_float, default=1.0, help="gamma shape of the arrivals; 1 = Poisson"
    )
    parser.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="requests in flight at most (multi-turn: conversations; the batch size of the in-process backends, "
        "default 1 there)",
    )
    parser.add_argument(
        "--scheduler-address",
        default=None,
        metavar="HOST:PORT",
        help="the scheduler behind the gateway: report its prefix-cache hit rate and requests per worker over the "
        "run (GetStats before and after; counts all of its traffic)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the dataset and the arrivals (openai backend: also sent)"
    )
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate each request's whole output length past EOS (the bench's workloads fix it, so this is on "
        "by default, unlike vLLM's; openai backend: ignore_eos and min_tokens = max_tokens)",
    )
    parser.add_argument("--num-warmups", type=non_negative_int, default=0, help="untimed requests sent first")
    parser.add_argument(
        "--goodput",
        type=slo,
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, itl, e2el)",
    )
    parser.add_argument(
        "--percentile-metrics",
        type=percentile_metrics,
        default=PERCENTILE_METRICS,
        metavar="METRICS",
        help="comma-separated metrics the table shows, among ttft,tpot,itl,e2el (default all four; vLLM's "
        "default leaves e2el out)",
    )
    parser.add_argument(
        "--metric-percentiles",
        type=metric_percentiles,
        default=DEFAULT_PERCENTILES,
        metavar="PERCENTILES",
        help="comma-separated percentiles of those metrics to show and save, e.g. 50,90,99 (default 99)",
    )
    parser.add_argument("--save-result", type=Path, default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="in-process backends")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _vocab_size(model_dir: Path) -> int:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise UsageError(f"--model {model_dir}: no config.json (a Hugging Face model directory is needed)")
    try:
        vocab = json.loads(config_path.read_text()).get("vocab_size")
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(f"--model {model_dir}: cannot read config.json ({err})") from err
    if not isinstance(vocab, int) or vocab < 1:
        raise UsageError(f"--model {model_dir}: config.json has no usable vocab_size")
    return vocab


def build_workload(ns: argparse.Namespace, model_dir: Path) -> list[BenchRequest]:
    """The requests the flags describe; UsageError for bad combinations."""
    if ns.dataset == "jsonl":
        if ns.dataset_path is None:
            raise UsageError("--dataset-path is required with --dataset jsonl")
        if not ns.dataset_path.is_file():
            raise UsageError(f"--dataset-path {ns.dataset_path} is not a file")
        from services.gateway.tokenizer import TextTokenizer

        try:
            tokenizer = TextTokenizer.from_dir(model_dir)
        except Exception as err:  # any tokenizer load failure is a problem with --model
            raise UsageError(f"--model {model_dir}: cannot load the tokenizer ({err})") from err
        try:
            return jsonl_dataset(ns.dataset_path, tokenizer, ns.jsonl_output_len, ns.num_prompts)
        except (ValueError, KeyError, TypeError) as err:
            raise UsageError(f"--dataset-path: {err}") from err
    vocab = _vocab_size(model_dir)
    if ns.dataset == "shared-prefix":
        return shared_prefix_dataset(
            ns.num_prompts, ns.shared_prefix_len, ns.shared_suffix_len, ns.shared_output_len, vocab, ns.seed
        )
    input_len = _with_ratio("--random-input-len", ns.random_input_len, ns.random_range_ratio)
    output_len = _with_ratio("--random-output-len", ns.random_output_len, ns.random_range_ratio)
    return random_dataset(ns.num_prompts, input_len, output_len, vocab, ns.seed)


def _with_ratio(flag: str, bounds: tuple[int, int], ratio: float) -> tuple[int, int]:
    """The length range of a random-dataset flag once --random-range-ratio has widened it."""
    if not ratio:
        return bounds
    lo, hi = bounds
    if lo != hi:
        raise UsageError(f"--random-range-ratio widens a single length N; {flag} {lo}-{hi} is already a range")
    return ratio_range(lo, ratio)


def build_conversations(ns: argparse.Namespace, model_dir: Path) -> list[Conversation]:
    """The workload as conversations: multi-turn ones, or each request of a single-turn dataset on its own."""
    if ns.dataset != "multi-turn":
        return single_turns(build_workload(ns, model_dir))
    if ns.backend not in SERVED_BACKENDS:
        # Static batches cannot hold turn k+1 back until turn k has finished, which is the point of the dataset.
        raise UsageError(f"--dataset multi-turn needs --backend meshserve or openai (not {ns.backend})")
    return multi_turn_dataset(
        ns.num_conversations,
        ns.num_turns,
        ns.turn_input_len,
        ns.turn_output_len,
        _vocab_size(model_dir),
        ns.seed,
        first_turn_input_len=ns.first_turn_input_len,
    )


async def _check_reachable(address: str) -> None:
    from services.common.channels import insecure_channel

    async with insecure_channel(address) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise ConnectionError(f"--address {address}: no gateway answered within {CONNECT_TIMEOUT_S:g} s") from None


@dataclass
class RunResult:
    """What a backend's run gives back."""

    records: list[RequestRecord]
    duration: float
    cache: CacheReport | None = None
    # Settings only known once connected (the openai backend's model name), for the saved JSON.
    settings: dict[str, Any] = field(default_factory=dict)


@asynccontextmanager
async def _sender(ns: argparse.Namespace, connections: int) -> AsyncIterator[tuple[Send, dict[str, Any]]]:
    """The served backend's Send, open for the block, with what it learned on connecting."""
    if ns.backend == "openai":
        from services.client.bench.openai_backend import openai_target

        async with openai_target(
            ns.base_url or DEFAULT_BASE_URL,
            connections=connections,
            model=ns.model_name,
            ignore_eos=ns.ignore_eos,
            seed=ns.seed,
        ) as target:
            yield target.send, {"model_name": target.model, "url": target.url}
        return
    from services.client.bench.runner import grpc_sender

    await _check_reachable(ns.address)
    async with grpc_sender(ns.address, ignore_eos=ns.ignore_eos) as send:
        yield send, {}


async def _serve(ns: argparse.Namespace, conversations: list[Conversation]) -> RunResult:
    """Run the workload through the server; with --scheduler-address, the scheduler's counters over the run."""
    from services.client.bench.cache_stats import fetch_stats, stats_delta
    from services.client.bench.runner import connections_needed, drive, warm_up

    connections = connections_needed(ns.max_concurrency, len(conversations), ns.num_warmups)
    async with _sender(ns, connections) as (send, settings):
        # Warm-ups go first, on their own, so that the counters read next leave them out.
        await warm_up(send, conversations, ns.num_warmups, max_concurrency=ns.max_concurrency)
        before = await fetch_stats(ns.scheduler_address) if ns.scheduler_address else None
        records, duration = await drive(
            send,
            conversations,
            request_rate=ns.request_rate,
            burstiness=ns.burstiness,
            max_concurrency=ns.max_concurrency,
            seed=ns.seed,
            progress=not ns.no_progress,
        )
    if before is None:
        return RunResult(records, duration, None, settings)
    return RunResult(records, duration, stats_delta(before, await fetch_stats(ns.scheduler_address)), settings)


async def _run_backend(ns: argparse.Namespace, model_dir: Path, conversations: list[Conversation]) -> RunResult:
    if ns.backend in SERVED_BACKENDS:
        return await _serve(ns, conversations)
    progress = not ns.no_progress
    # Single-turn datasets only (build_conversations refuses multi-turn here), so flattening loses nothing.
    requests = flatten(conversations)
    # In-process backends run the workload in batches; arrival times do not apply to them.
    if not math.isinf(ns.request_rate):
        print(f"note: --request-rate is ignored by the {ns.backend} backend", file=sys.stderr)
    if not ns.ignore_eos:
        print(f"note: --no-ignore-eos is ignored by the {ns.backend} backend", file=sys.stderr)
    batch_size = ns.max_concurrency or 1
    if ns.backend == "transformers":
        from services.worker.benchmarks.transformers_baseline import run_transformers_baseline

        return RunResult(*run_transformers_baseline(model_dir, requests, batch_size, ns.dtype, progress))
    from services.worker.benchmarks.raw_runner import run_raw_runner

    return RunResult(*run_raw_runner(model_dir, requests, batch_size, ns.dtype, progress))


def _settings(ns: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    # What was run, saved next to the results so that a JSON file explains itself.
    multi_turn = ns.dataset == "multi-turn"
    openai = ns.backend == "openai"
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "address": ns.address if ns.backend == "meshserve" else None,
        "base_url": (ns.base_url or DEFAULT_BASE_URL) if openai else None,
        "model_name": ns.model_name if openai else None,
        "model": str(model_dir),
        "dataset": ns.dataset,
        "dataset_path": str(ns.dataset_path) if ns.dataset_path else None,
        "num_prompts": None if multi_turn else ns.num_prompts,
        "random_range_ratio": ns.random_range_ratio if ns.dataset == "random" else None,
        "num_conversations": ns.num_conversations if multi_turn else None,
        "num_turns": ns.num_turns if multi_turn else None,
        "scheduler_address": ns.scheduler_address,
        "seed": ns.seed,
        "num_warmups": ns.num_warmups,
        "ignore_eos": ns.ignore_eos if ns.backend in SERVED_BACKENDS else None,
        "dtype": ns.dtype if ns.backend not in SERVED_BACKENDS else None,
    }


def prepare(ns: argparse.Namespace) -> tuple[Path, dict[str, float] | None, list[Conversation]]:
    """Model directory, goodput SLOs and workload from the flags; UsageError naming the flag when one is bad."""
    model_dir: Path = ns.model.expanduser() if ns.model else embedded_model_dir()
    slos = goodput_slos(ns.goodput)
    if ns.scheduler_address and ns.backend not in SERVED_BACKENDS:
        raise UsageError(f"--scheduler-address needs --backend meshserve or openai (not {ns.backend})")
    if ns.backend != "openai":
        for flag, value in (("--base-url", ns.base_url), ("--model-name", ns.model_name)):
            if value is not None:
                raise UsageError(f"{flag} needs --backend openai (not {ns.backend})")
    elif ns.base_url is not None:
        from services.client.bench.openai_backend import api_root

        try:
            api_root(ns.base_url)
        except ValueError as err:
            raise UsageError(f"--base-url: {err}") from None
    if ns.random_range_ratio and ns.dataset != "random":
        raise UsageError(f"--random-range-ratio applies to --dataset random (not {ns.dataset})")
    if not model_dir.is_dir():
        hint = "" if ns.model else " (run `meshserve up` once to fetch the embedded model, or pass --model)"
        raise UsageError(f"--model {model_dir} is not a directory{hint}")
    return model_dir, slos, build_conversations(ns, model_dir)


def _report_extras(
    ns: argparse.Namespace, conversations: list[Conversation], records: list[RequestRecord], cache: CacheReport | None
) -> dict[str, Any]:
    """Print what the vLLM table lacks (TTFT by turn, the scheduler's counters); return it for the JSON."""
    from services.client.bench.metrics import mean_ttft_by_turn
    from services.client.bench.report import format_cache_report, format_ttft_by_turn

    extras: dict[str, Any] = {}
    if ns.dataset == "multi-turn":
        turns = turn_indices(conversations)
        extras["turn_indices"] = turns
        extras["mean_ttft_ms_by_turn"] = mean_ttft_by_turn(records, turns)
        print(format_ttft_by_turn(extras["mean_ttft_ms_by_turn"]))
    if cache is not None:
        extras["scheduler_stats"] = cache.to_dict()
        print(format_cache_report(cache))
    return extras


async def main(ns: argparse.Namespace) -> int:
    """Run the benchmark the flags describe; 2 for bad flags, 1 when nothing completed or it could not run."""
    from services.client.bench.metrics import summarize
    from services.client.bench.report import per_request_details, print_summary, save_result

    try:
        model_dir, slos, conversations = prepare(ns)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        result = await _run_backend(ns, model_dir, conversations)
    except ImportError as err:
        print(f"error: --backend {ns.backend} is not available here: {err}", file=sys.stderr)
        return 1
    except (ConnectionError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    served = ns.backend in SERVED_BACKENDS
    records = result.records
    summary = summarize(
        records,
        result.duration,
        goodput_slos=slos,
        backend=ns.backend,
        # The in-process backends run batch_size requests at a time, which is their concurrency.
        max_concurrency=ns.max_concurrency if served else ns.max_concurrency or 1,
        request_rate=ns.request_rate if served else math.inf,
        burstiness=ns.burstiness,
        percentile_metrics=ns.percentile_metrics,
        metric_percentiles=ns.metric_percentiles,
    )
    print_summary(summary)
    extras = _report_extras(ns, conversations, records, result.cache)
    if ns.save_result is not None:
        settings = {**_settings(ns, model_dir), **result.settings}
        save_result(ns.save_result, summary, {**settings, **per_request_details(records), **extras})
        print(f"results saved to {ns.save_result}")
    return 0 if summary.completed else 1
