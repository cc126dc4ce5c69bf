"""`meshserve up`: the whole suite on this machine with the embedded defaults."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import pydantic

from services.client.exit_codes import INTERRUPTED
from services.client.launcher import Launcher, ServiceProcess, start_suite_processes, wait_all_healthy
from services.common.model_paths import embedded_model_dir, model_cache_dir
from services.common.ports import DEFAULT_METRICS_PORT
from services.gateway.settings import DEFAULT_PORT as GATEWAY_PORT
from services.kvstore.settings import DEFAULT_PORT as KV_STORE_PORT
from services.scheduler.settings import DEFAULT_PORT as SCHEDULER_PORT
from services.scheduler.settings import SchedulerSettings
from services.scheduler.speculation import SpeculativeConfig
from services.worker.engine_config import LOAD_FORMATS, QUANTIZATIONS
from services.worker.settings import DEFAULT_PORT as WORKER_PORT

# The gateway's OpenAI-compatible HTTP front, on vLLM's default port.
HTTP_PORT = 8000

if TYPE_CHECKING:
    from services.client.dev_certs import DevCerts


def _scheduler_choices(field: str) -> tuple[str, ...]:
    """The values a scheduler flag of fixed choices takes, which `up` passes on."""
    return typing.get_args(SchedulerSettings.model_fields[field].annotation)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `meshserve up`."""
    parser.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model directory or .gguf, as `vllm serve MODEL` (default: embedded SmolLM2)",
    )
    parser.add_argument("--model", default=None, help="the same as MODEL")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="Hugging Face directory the gateway takes its tokenizer, chat template and sampling defaults from, "
        "as vLLM's flag (default: MODEL; a .gguf MODEL needs one, the embedded model's is its converted directory)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    parser.add_argument("--port", type=_dialled_port, default=GATEWAY_PORT, help="gateway (public) port")
    parser.add_argument(
        "--http-port",
        type=int,
        default=HTTP_PORT,
        help="gateway's OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions); -1: off, 0: any free",
    )
    parser.add_argument("--scheduler-port", type=_dialled_port, default=SCHEDULER_PORT)
    parser.add_argument("--worker-port", type=_dialled_port, default=WORKER_PORT, help="first worker's health port")
    parser.add_argument(
        "--workers", "--num-workers", dest="workers", type=_positive_int, default=1, help="worker processes to start"
    )
    parser.add_argument(
        "--routing",
        default=None,
        choices=_scheduler_choices("routing"),
        help="how the scheduler picks a worker (scheduler default)",
    )
    parser.add_argument("--device", default=None, help="worker device: auto, cpu, cuda or npu (worker default: auto)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="one dtype")
    parser.add_argument("--precision", default=None, help="WEIGHTS-COMPUTE-ACCUM, e.g. bf16-fp16-fp32 (default: auto)")
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATIONS,
        help="weight-only quantisation of every worker's linears (int8: half of bf16's bytes per decode step; "
        "gguf: a .gguf model's own 4- and 8-bit blocks, the embedded model's Q4_1 file without MODEL)",
    )
    parser.add_argument(
        "--load-format",
        default=None,
        choices=LOAD_FORMATS,
        help="dummy: every worker runs random weights of the model's shape (only config.json needed)",
    )
    parser.add_argument(
        "-tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=None, help="ranks per stage"
    )
    parser.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        dest="pipeline_parallel_size",
        type=int,
        default=None,
        help="pipeline stages per worker (each a TP group)",
    )
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV block (worker default per device)")
    parser.add_argument("--seed", type=int, default=None, help="seed of unseeded sampling on every worker")
    parser.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients give as the model (gateway)"
    )
    parser.add_argument("--api-key", action="append", default=None, help="API key the gateway requires (repeatable)")
    parser.add_argument(
        "--generation-config", default=None, choices=["auto", "vllm"], help="sampling defaults (gateway default auto)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="first Prometheus /metrics port: gateway, scheduler, kvstore, then each worker on the next ones "
        f"(default {DEFAULT_METRICS_PORT}, where `meshserve top` looks; 0: off)",
    )
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    parser.add_argument("--kv-cache-memory", default="2GiB", help="KV cache size per worker on the CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="(cuda, npu; worker default 0.9)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--long-prefill-token-threshold", type=int, default=None, help="most prompt tokens per request per step"
    )
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='prompt-lookup speculative decoding of greedy requests, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "disable_by_batch_size": 4}\' (scheduler default: off)',
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None, help="(scheduler default: on)"
    )
    parser.add_argument(
        "--kv-store",
        default="on",
        choices=["on", "off"],
        help="start a kvstore that every worker shares (on: prefixes computed once load everywhere)",
    )
    parser.add_argument("--kv-store-port", type=_dialled_port, default=KV_STORE_PORT)
    parser.add_argument(
        "--kv-store-backend", default=None, help="memory (kvstore default) or redis://host:port/db (shared by replicas)"
    )
    parser.add_argument("--kv-store-capacity", default=None, help="memory backend's byte budget, e.g. 4GiB")
    parser.add_argument(
        "--preemption-mode",
        default=None,
        choices=_scheduler_choices("preemption_mode"),
        help="(scheduler default: recompute)",
    )
    parser.add_argument(
        "--kv-store-write-policy",
        default=None,
        choices=_scheduler_choices("kv_store_write_policy"),
        help="which blocks the kvstore gets: every computed one, or each the first time it is reused "
        "(scheduler default: write-through)",
    )
    parser.add_argument(
        "--scheduling-policy",
        default=None,
        choices=_scheduler_choices("scheduling_policy"),
        help="which queued request runs next: the shortest prompt first (aged by queue time) or arrival order "
        "(scheduler default: shortest-prefill-first)",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="service logs (default: cache dir)")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument(
        "--tls",
        action="store_true",
        help="mTLS on every internal hop, TLS on the gateway: a throwaway CA and per-service certificates in "
        "LOG_DIR/tls",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _dialled_port(text: str) -> int:
    """A port another service of the suite dials: a fixed one, since `up` tells the others where to connect
    (0, any free port, would leave them nowhere to go and the health wait never ending)."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be a port from 1 to 65535 (the other services connect to it), not {value}"
        )
    return value


def _speculative_config(text: str) -> str:
    """Checked here, so a wrong key fails `up` at once rather than the scheduler it starts."""
    try:
        SpeculativeConfig.model_validate_json(text)
    except pydantic.ValidationError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _optional(flag: str, value: object) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _prefix_caching(enabled: bool | None) -> list[str]:
    if enabled is None:
        return []
    return ["--enable-prefix-caching" if enabled else "--no-enable-prefix-caching"]


def scheduler_args(ns: argparse.Namespace) -> list[str]:
    """The scheduler's flags from `up`'s; unset ones stay absent so the scheduler's defaults apply."""
    return [
        *_optional("--max-model-len", ns.max_model_len),
        *_optional("--max-num-seqs", ns.max_num_seqs),
        *_optional("--max-num-batched-tokens", ns.max_num_batched_tokens),
        *_optional("--long-prefill-token-threshold", ns.long_prefill_token_threshold),
        *_optional("--speculative-config", ns.speculative_config),
        *_prefix_caching(ns.enable_prefix_caching),
        *_optional("--routing", ns.routing),
        *_optional("--preemption-mode", ns.preemption_mode),
        *_optional("--kv-store-write-policy", ns.kv_store_write_policy),
        *_optional("--scheduling-policy", ns.scheduling_policy),
    ]


def kv_store_args(ns: argparse.Namespace) -> list[str]:
    """The kvstore's flags from `up`'s."""
    return [*_optional("--backend", ns.kv_store_backend), *_optional("--capacity", ns.kv_store_capacity)]


def worker_args(ns: argparse.Namespace) -> list[str]:
    """Every worker's flags from `up`'s."""
    return [
        "--kv-cache-memory",
        ns.kv_cache_memory,
        # The worker sizes its KV cache for it; the gateway learns it from the scheduler.
        *_optional("--max-model-len", ns.max_model_len),
        *_optional("--device", ns.device),
        *_optional("--dtype", ns.dtype),
        *_optional("--precision", ns.precision),
        *_optional("--quantization", ns.quantization),
        *_optional("--load-format", ns.load_format),
        *_optional("--tensor-parallel-size", ns.tensor_parallel_size),
        *_optional("--pipeline-parallel-size", ns.pipeline_parallel_size),
        *_optional("--gpu-memory-utilization", ns.gpu_memory_utilization),
        # The worker must be told too: it sizes its step buffers for them, and the scheduler plans within the
        # smaller of its own and the worker's (before, up's values reached only the scheduler).
        *_optional("--max-num-seqs", ns.max_num_seqs),
        *_optional("--max-num-batched-tokens", ns.max_num_batched_tokens),
        *_optional("--block-size", ns.block_size),
        *_optional("--seed", ns.seed),
        # The name every service's metrics carry as model_name (the gateway's first served name).
        *_optional("--served-model-name", ns.served_model_name[0] if ns.served_model_name else None),
    ]


def gateway_args(ns: argparse.Namespace) -> list[str]:
    """The gateway's flags from `up`'s."""
    names = ["--served-model-name", *ns.served_model_name] if ns.served_model_name else []
    keys = [flag for key in ns.api_key or () for flag in ("--api-key", key)]
    return [
        "--http-port",
        str(ns.http_port),
        *names,
        *keys,
        *_optional("--generation-config", ns.generation_config),
    ]


def common_args(ns: argparse.Namespace) -> list[str]:
    """Flags every service gets."""
    return _optional("--log-level", ns.log_level)


def model_argument(ns: argparse.Namespace) -> str | None:
    """MODEL or --model (not both, unless equal)."""
    if ns.model_positional and ns.model and ns.model_positional != ns.model:
        raise ValueError(f"two models given: {ns.model_positional} and --model {ns.model}; give one")
    return ns.model_positional or ns.model


def _http_banner(ns: argparse.Namespace) -> str:
    if ns.http_port <= 0:
        return ""
    return f"  OpenAI-compatible HTTP API: http://{ns.host}:{ns.http_port}/v1 (completions, chat/completions)\n"


def _metrics_banner(ns: argparse.Namespace) -> str:
    if not ns.metrics_port:
        return ""
    top = "" if ns.metrics_port == DEFAULT_METRICS_PORT else f" --metrics-port {ns.metrics_port}"
    return (
        f"  Prometheus metrics: http://{ns.host}:{ns.metrics_port}/metrics (gateway; the others on the next "
        f"ports); watch it with `meshserve top{top}`\n"
    )


def say(text: str, stream: TextIO | None = None) -> None:
    """Print for the user without ever raising.

    Ctrl-C on `meshserve up | tee up.log` kills tee too; a print to its closed pipe would raise
    BrokenPipeError in the middle of shutdown and orphan the services. Once the pipe is gone the
    stream is pointed at /dev/null, so later prints and the interpreter's final flush stay quiet.
    """
    stream = stream or sys.stdout
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError):  # BrokenPipeError (SIGPIPE is ignored in Python), or a closed stream
        _to_devnull(stream)


def _to_devnull(stream: TextIO) -> None:
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def _dev_certs(directory: Path, host: str) -> DevCerts:
    """A fresh throwaway CA and one certificate per service (valid for loopback and --host)."""
    from services.client.dev_certs import make_dev_certs

    certs = make_dev_certs(directory, hosts=[host])
    say(f"meshserve: TLS on every hop; throwaway CA and certificates in {directory}")
    return certs


def _model_dir(model: str | None) -> str:
    if model:
        return model
    # Imported here: converting the GGUF needs torch, which only `up` and the worker load.
    from services.worker.model_fetch import ensure_embedded_model

    if not (embedded_model_dir() / "config.json").exists():
        say("meshserve: fetching and converting the embedded model SmolLM2-135M-Instruct (once)...")
    return str(ensure_embedded_model())


def suite_models(ns: argparse.Namespace) -> tuple[str, str]:
    """(the gateway's model directory, the workers' --model). Without MODEL both are the embedded model's
    directory, except that --quantization gguf gives the workers its GGUF file (the Q4_1 blocks it ships);
    a .gguf MODEL needs --tokenizer, since the gateway reads tokenizer.json from a directory."""
    given = model_argument(ns)
    if given is None:
        gateway = ns.tokenizer or _model_dir(None)
        if ns.quantization != "gguf":
            return gateway, _model_dir(None)
        from services.worker.model_fetch import ensure_embedded_gguf

        return gateway, str(ensure_embedded_gguf())
    if ns.tokenizer is None and given.endswith(".gguf"):
        raise ValueError(
            f"MODEL {given} is a .gguf file: give --tokenizer DIR, the Hugging Face directory with its tokenizer.json "
            "(the gateway tokenizes; the workers serve the file)"
        )
    return ns.tokenizer or given, given


async def run(ns: argparse.Namespace) -> int:
    """Start scheduler, workers and gateway; wait for health; stop them all on Ctrl-C."""
    try:
        model, worker_model = suite_models(ns)
    except ValueError as err:
        say(f"meshserve: {err}", sys.stderr)
        return 2
    log_dir = ns.log_dir or model_cache_dir().parent / "logs"
    certs = _dev_certs(log_dir / "tls", ns.host) if ns.tls else None
    launcher = Launcher(
        log_dir, env={"MESHSERVE_LOG_FORMAT": "json"}, security=None if certs is None else certs.security()
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        suite = start_suite_processes(
            launcher,
            model=model,
            host=ns.host,
            scheduler_port=ns.scheduler_port,
            worker_ports=[ns.worker_port + i for i in range(ns.workers)],
            gateway_port=ns.port,
            scheduler_args=scheduler_args(ns),
            worker_args=worker_args(ns),
            kv_store_port=ns.kv_store_port if ns.kv_store == "on" else None,
            kv_store_args=kv_store_args(ns),
            gateway_args=gateway_args(ns),
            common_args=common_args(ns),
            certs=certs,
            metrics_port=ns.metrics_port or None,
            worker_model=worker_model,
        )
        gateway = suite.gateway
        tls_hint = "" if certs is None else f" --tls-ca {certs.ca}"
        store = "a kvstore, " if suite.kv_store is not None else ""
        say(f"meshserve: starting {store}scheduler, {ns.workers} worker(s) and gateway; logs in {log_dir}")
        if not await _healthy_unless_stopped(launcher, suite.all, ns.startup_timeout, stop):
            say("meshserve: interrupted before every service was serving", sys.stderr)
            return INTERRUPTED
        say(
            f"meshserve: serving {Path(worker_model).name} on {gateway.address} (gRPC, meshserve.v1.Generation)\n"
            f'  try:  meshserve generate --address {gateway.address}{tls_hint} "What is the capital of France?"\n'
            f"        meshserve chat --address {gateway.address}{tls_hint}\n"
            f"{_http_banner(ns)}"
            f"{_metrics_banner(ns)}"
            "  Ctrl-C stops every service."
        )
        await _wait_for_stop_or_exit(launcher, stop)
    except (RuntimeError, TimeoutError) as err:
        say(f"meshserve: {err}", sys.stderr)
        return 1
    finally:
        say("meshserve: stopping...")
        launcher.stop_all()
    return 0


async def _healthy_unless_stopped(
    launcher: Launcher, services: Sequence[ServiceProcess], timeout: float, stop: asyncio.Event
) -> bool:
    """Wait for every service to be SERVING; False as soon as Ctrl-C (or SIGTERM) comes first, so a user
    need not wait out a model's loading (or --startup-timeout) to stop the suite."""
    healthy = asyncio.ensure_future(wait_all_healthy(launcher, services, timeout))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({healthy, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (healthy, stopped):
            task.cancel()
        await asyncio.gather(healthy, stopped, return_exceptions=True)
    if healthy.cancelled():
        return False
    healthy.result()  # raises what wait_all_healthy raised (a service exited, or the timeout)
    return True


async def _wait_for_stop_or_exit(launcher: Launcher, stop: asyncio.Event) -> None:
    """Until Ctrl-C. A worker that exits is reported and the suite serves on with the others (the scheduler
    moves its requests); so does a kvstore that exits (loads become misses and requests recompute). The
    scheduler, the gateway or the last worker exiting ends the suite."""
    reported: set[str] = set()
    while not stop.is_set():
        for service in launcher.services:
            if service.process.poll() is None or service.name in reported:
                continue
            workers_left = [s for s in launcher.services if s.name.startswith("worker-") and s.process.poll() is None]
            survivable = (service.name.startswith("worker-") and workers_left) or service.name == "kvstore"
            if not survivable:
                raise RuntimeError(
                    f"{service.name} exited with code {service.process.returncode}; log:\n{service.log_tail()}"
                )
            reported.add(service.name)
            what = "without a kvstore" if service.name == "kvstore" else f"with {len(workers_left)} worker(s)"
            say(
                f"meshserve: {service.name} exited with code {service.process.returncode}; serving on {what} "
                f"(its log: {service.log_path})",
                sys.stderr,
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
