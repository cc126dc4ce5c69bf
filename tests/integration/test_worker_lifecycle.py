"""A worker drains on SIGTERM, and one whose model thread hangs exits for its supervisor to restart it."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from services.client.client import GenerationClient, build_request, sampling_params
from services.client.launcher import Launcher, start_suite_processes, wait_all_healthy
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import sampling_pb2
from services.worker.attach import HANG_AFTER_STEPS_ENV
from services.worker.server import HUNG_EXIT_CODE
from tests.support.calls import stream
from tests.support.suite import STARTUP_TIMEOUT_S, Suite, start_suite

# Bounds against a hang; no test measures time.
WAIT_S = 120.0


def test_sigterm_drains_the_worker_and_its_requests_finish(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A grace period far above the request's run time, so a slow machine cannot cut the drain short.
    suite = start_suite(
        tiny_model_dir, tmp_path, worker_args=["--kv-cache-memory", "64MiB", "--shutdown-grace-period", "120"]
    )
    worker = suite.workers[0].process
    try:

        async def run() -> tuple[int, int]:
            params = sampling_params(max_tokens=300, temperature=0.0, ignore_eos=True)
            tokens, finish = 0, 0
            async with GenerationClient(suite.address) as client:
                async for response in client.generate(build_request(token_ids=[5, 6, 7], sampling=params)):
                    if tokens < 3 <= tokens + len(response.token_ids):
                        worker.send_signal(signal.SIGTERM)
                    tokens += len(response.token_ids)
                    finish = response.finish_reason
            return tokens, finish

        assert asyncio.run(run()) == (300, sampling_pb2.FINISH_REASON_LENGTH)
        assert worker.wait(WAIT_S) == 0, suite.workers[0].log_tail()
    finally:
        suite.stop()
    assert any(str(r["event"]).startswith("draining: the scheduler finishes") for r in suite.log_records("worker-0"))


def _wait_for_event(suite: Suite, name: str, prefix: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not any(str(r["event"]).startswith(prefix) for r in suite.log_records(name)):
        assert time.monotonic() < deadline, f"{name} never logged {prefix!r}"
        time.sleep(0.1)


def test_a_hung_model_thread_stops_the_worker_with_an_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {"MESHSERVE_LOG_FORMAT": "json", HANG_AFTER_STEPS_ENV: "2", "MESHSERVE_HUNG_STEP_TIMEOUT": "1"}
    launcher = Launcher(tmp_path, env=env)
    procs = start_suite_processes(
        launcher,
        model=str(tiny_model_dir),
        host="127.0.0.1",
        scheduler_port=free_port(),
        worker_ports=[free_port()],
        gateway_port=free_port(),
        worker_args=["--kv-cache-memory", "64MiB"],
    )
    suite = Suite(launcher, procs.scheduler, procs.workers, procs.gateway, tmp_path)
    worker = procs.workers[0].process
    try:
        asyncio.run(wait_all_healthy(launcher, procs.all, STARTUP_TIMEOUT_S))

        async def run() -> int:
            params = sampling_params(max_tokens=50, temperature=0.0, ignore_eos=True)
            async with GenerationClient(suite.address) as client:
                request = asyncio.create_task(stream(client, build_request(token_ids=[5, 6, 7], sampling=params)))
                await asyncio.to_thread(_wait_for_event, suite, "worker-0", "test fault: the model thread hangs now")
                # The stream ends as when the scheduler's step timeout gives up on the worker.
                procs.scheduler.process.kill()
                code = await asyncio.to_thread(worker.wait, WAIT_S)
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
                return code

        assert asyncio.run(run()) == HUNG_EXIT_CODE, procs.workers[0].log_tail()
    finally:
        launcher.stop_all(timeout=10)
    hung = [r for r in suite.log_records("worker-0") if str(r["event"]).startswith("model thread hung")]
    assert len(hung) == 1
    assert hung[0]["step_id"] is not None
    assert "in execute" in str(hung[0]["model_thread_stack"])
