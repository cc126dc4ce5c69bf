"""`meshserve worker`: start the TP ranks, load the model, serve health, attach to the scheduler, execute steps."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, NoReturn

import structlog
from prometheus_client import REGISTRY

from services.common.grpc_server import GrpcService
from services.common.logs import configure_logging
from services.common.metrics.names import MODEL_NAME_LABEL
from services.common.model_paths import resolve_model_path
from services.common.proto.meshserve.v1 import worker_pb2
from services.common.tls import load_security
from services.worker.attach import AttachClient, ModelThreadHung, StepExecutor, with_test_faults
from services.worker.engine_config import EngineConfig, KVStoreConnection
from services.worker.metrics import MeteredExecutor, MeteredPipelinedExecutor, WorkerMetrics
from services.worker.settings import WorkerSettings
from services.worker.telemetry.device_telemetry import DeviceTelemetry

if TYPE_CHECKING:
    from services.worker.distributed import DistInit
    from services.worker.model_runner import ModelRunner

log = structlog.get_logger()
# The worker serves only grpc.health.v1 (and reflection); its work arrives over Attach.
HEALTH_ONLY: list[str] = []
# Seconds kept back from the grace period (and given to the scheduler) to close the attach stream.
CLOSE_MARGIN_S = 1.0
# Exit status of a worker whose model thread hung (EX_SOFTWARE): distinct from a startup failure's 1.
HUNG_EXIT_CODE = os.EX_SOFTWARE


def engine_config(settings: WorkerSettings, device: str) -> EngineConfig:
    """The model runner's config from the worker's settings and the resolved device type."""
    return EngineConfig(
        model_path=str(resolve_model_path(settings.model)),
        served_model_name=settings.served_model_name,
        dtype=settings.dtype,
        precision=settings.precision,
        device=device,
        block_size=settings.block_size,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        pp_layer_partition=settings.layer_partition,
        pipeline_micro_batching=settings.pipeline_micro_batching,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        seed=settings.seed,
        cpu_kernels=settings.cpu_kernels,
        quantization=settings.quantization,
        load_format=settings.load_format,
        kv_store=(
            None
            if settings.kv_store is None
            else KVStoreConnection(
                settings.kv_store,
                settings.kv_save_queue_blocks,
                load_security(settings),
                shared_memory=settings.kv_store_shared_memory,
            )
        ),
    )


def rendezvous(settings: WorkerSettings, first_rank: int) -> DistInit:
    """Rank 0's place among the ranks and where all meet: --dist-init-addr, or, on one host, a store
    already listening on a loopback port (see open_local_rendezvous)."""
    from services.worker.distributed import DistInit, open_local_rendezvous

    if settings.dist_init_addr:
        return DistInit(first_rank, settings.world_size, 0, f"tcp://{settings.dist_init_addr}")
    init_method, store = open_local_rendezvous(settings.world_size)
    return DistInit(first_rank, settings.world_size, 0, init_method, store)


def _fail(message: str) -> None:
    """Log a startup error and say it plainly on stderr (no traceback: the message names the fix)."""
    log.error("startup_failed", error=message)
    print(f"meshserve worker: error: {message}", file=sys.stderr, flush=True)


async def serve(settings: WorkerSettings) -> int:
    """Load, attach, and serve steps until SIGTERM; then drain and detach. Returns the exit code."""
    configure_logging("worker", settings.log_level, settings.log_format)
    # torch loads only in the process that runs the model, after logging is set up.
    from services.worker.platforms import resolve_device
    from services.worker.ranks import RankSpec, prepare_rank, spawn_local_ranks
    from services.worker.startup_error import StartupError

    try:
        device = resolve_device(settings.device)
        config = engine_config(settings, device)
    except (StartupError, ValueError) as err:
        _fail(str(err))
        return 1
    first_rank = settings.node_rank * settings.ranks_per_node
    dist = None
    processes: list[BaseProcess] = []
    if settings.world_size > 1:
        dist = rendezvous(settings, first_rank)
        spec = RankSpec(config, dist, settings.ranks_per_node, settings.cpu_binding, settings.log_level,
                        settings.log_format)  # fmt: skip
        processes = spawn_local_ranks(spec, first_rank)
    # Bind before the model thread exists: threads inherit the affinity of the thread that starts them.
    prepare_rank(config, 0, settings.ranks_per_node, settings.cpu_binding)

    # model_name and worker label every series once the model is loaded (the metrics port serves before).
    metric_labels: dict[str, str] = {}
    service = GrpcService("worker", settings, HEALTH_ONLY, metric_labels=lambda: metric_labels)
    service.install_signal_handlers()
    await service.start()
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    try:
        runner = await _load(model_thread, config, dist, processes)
    except (StartupError, ValueError) as err:
        _fail(str(err))
        await _stop_quietly(service, processes)
        return 1
    worker_id = settings.worker_id or f"{socket.gethostname()}:{os.getpid()}:{service.port}"
    metric_labels.update({MODEL_NAME_LABEL: runner.model_name, "worker": worker_id})
    metrics = WorkerMetrics()
    metrics.loaded(runner.num_blocks, runner.rank_memory, runner.device_type)
    telemetry = _device_telemetry(settings, runner.device_type, runner.model_name, worker_id)
    telemetry.start()
    try:
        if first_rank != 0:
            return await _serve_follower(service, model_thread, runner, processes)
        return await _serve_driver(settings, service, model_thread, runner, processes, worker_id, metrics)
    finally:
        telemetry.stop()


def _device_telemetry(settings: WorkerSettings, device_type: str, model_name: str, worker_id: str) -> DeviceTelemetry:
    """npu-smi or NVML gauges on their own thread; nothing on the CPU or with --device-telemetry off."""
    choice = settings.device_telemetry
    platform = device_type if choice == "auto" else choice
    return DeviceTelemetry(
        REGISTRY,
        "cpu" if platform == "off" else platform,
        model_name=model_name,
        worker=worker_id,
        interval=settings.device_telemetry_interval,
    )


async def _load(
    model_thread: ThreadPoolExecutor, config: EngineConfig, dist: DistInit | None, processes: list[BaseProcess]
) -> ModelRunner:
    """Build rank 0's runner on the model thread, failing fast when a local rank dies during startup."""
    from services.worker.model_runner import ModelRunner
    from services.worker.startup_error import StartupError

    loop = asyncio.get_running_loop()
    loading = loop.run_in_executor(model_thread, ModelRunner, config, dist)
    while True:
        done, _ = await asyncio.wait({loading}, timeout=0.5)
        if done:
            return loading.result()
        dead = [p for p in processes if p.exitcode is not None]
        if dead:
            # The rendezvous would wait for the dead rank forever; its own log says why it stopped.
            raise StartupError(f"tensor-parallel rank process {dead[0].name} exited with code {dead[0].exitcode}")


async def _stop_quietly(service: GrpcService, processes: list[BaseProcess]) -> None:
    for process in processes:
        process.kill()
    await service.server.stop(0)


async def _serve_driver(
    settings: WorkerSettings,
    service: GrpcService,
    model_thread: ThreadPoolExecutor,
    runner: ModelRunner,
    processes: list[BaseProcess],
    worker_id: str,
    metrics: WorkerMetrics,
) -> int:
    """Rank 0: attach to the scheduler and run its steps on every rank."""
    from services.worker.pipeline_driver import PipelineDriver
    from services.worker.ranks import RankDriver, watch_ranks

    stopping = threading.Event()
    executor: StepExecutor = runner
    driver: RankDriver | None = None
    step_slots = 0
    if runner.pipelined:
        pipeline = PipelineDriver(runner, processes, stopping)
        driver, step_slots = pipeline, pipeline.slots
        executor = MeteredPipelinedExecutor(pipeline, metrics, runner)
        watch_ranks(processes, stopping)
    else:
        if runner.ranks.size > 1:
            driver = executor = RankDriver(runner, processes, stopping)
            watch_ranks(processes, stopping)
        executor = MeteredExecutor(executor, metrics, runner)
    hello = worker_pb2.WorkerHello(
        worker_id=worker_id,
        device=runner.device_type,
        tensor_parallel_size=runner.tp.size,
        pipeline_parallel_size=runner.stage.num_stages,
        kv_format=runner.kv_format,
        model_identity=runner.model_identity,
        model_name=runner.model_name,
        block_size=runner.block_size,
        num_blocks=runner.num_blocks,
        max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size,
        health_address=f"{settings.host}:{service.port}",
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=runner.max_num_batched_tokens,
        kv_store_enabled=runner.kv_transfer is not None,
        step_slots=step_slots,
    )
    log.info(
        "model loaded",
        model=runner.model_name,
        num_blocks=runner.num_blocks,
        worker_id=worker_id,
        kv_store=settings.kv_store,
    )
    client = AttachClient(
        settings.scheduler_address,
        hello,
        with_test_faults(executor),
        service.set_serving,
        model_thread,
        reconnect_interval=settings.reconnect_interval,
        hung_step_timeout=settings.hung_step_timeout,
        security=service.security,
    )
    attach_task = asyncio.create_task(client.run())
    # The attach loop ends by itself only when it fails (a hung model thread): shut down as on SIGTERM.
    attach_task.add_done_callback(lambda _: service.request_stop())
    await service.run_until_stopped(functools.partial(_drain, client, attach_task))
    if not await _detach(client, attach_task, settings.hung_step_timeout):
        _exit_hung(processes, stopping)
    loop = asyncio.get_running_loop()
    if driver is not None:
        await loop.run_in_executor(model_thread, driver.close)
    # The kvstore threads and this rank's shared-memory outbox (unlinked: it would outlive the process).
    await loop.run_in_executor(model_thread, runner.close)
    model_thread.shutdown(wait=True)
    return 0 if _failure(attach_task) is None else 1


async def _drain(client: AttachClient, attach_task: asyncio.Task[None], grace: float) -> None:
    """SIGTERM (health is NOT_SERVING already): the scheduler sends nothing new, lets our requests
    finish while we keep answering steps and heartbeats, then ends the stream. When the grace runs
    out first we close our side and the scheduler re-queues what is left on other workers."""
    if attach_task.done():
        return
    client.drain("SIGTERM")
    # asyncio.wait, not wait_for: a failed attach loop is _detach's to report, not a drain error.
    _, running = await asyncio.wait({attach_task}, timeout=max(0.0, grace - CLOSE_MARGIN_S))
    if running:
        log.warning("drain grace period ran out; closing the attach stream", grace_period_s=grace)
        client.close()


async def _detach(client: AttachClient, attach_task: asyncio.Task[None], hung_step_timeout: float) -> bool:
    """End the attach loop for good; False when the model thread is hung and cannot be joined."""
    client.close()
    # The scheduler ends the stream as soon as it sees our side closed; the loop then waits for our steps.
    _, running = await asyncio.wait({attach_task}, timeout=CLOSE_MARGIN_S + hung_step_timeout)
    if running:
        attach_task.cancel()
        await asyncio.wait({attach_task})
    failure = _failure(attach_task)
    if isinstance(failure, ModelThreadHung):
        return False
    if failure is not None:
        log.error("attach loop failed", error=f"{type(failure).__name__}: {failure}")
    return await client.wait_steps_done(hung_step_timeout)


def _failure(task: asyncio.Task[None]) -> BaseException | None:
    """What a finished task raised; None when it returned or was cancelled."""
    return None if task.cancelled() else task.exception()


def _exit_hung(processes: list[BaseProcess], stopping: threading.Event) -> NoReturn:
    """Leave now with HUNG_EXIT_CODE so a supervisor restarts the worker, as vLLM does with a dead engine.

    A wedged model thread never frees its device or answers again, and the interpreter's normal exit
    would join it forever; so os._exit, after the gRPC server stopped and the logs are flushed."""
    log.error("exiting: the model thread is hung", exit_code=HUNG_EXIT_CODE)
    stopping.set()  # the rank watcher must not report the ranks we kill as crashed
    for process in processes:
        process.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(HUNG_EXIT_CODE)


async def _serve_follower(
    service: GrpcService, model_thread: ThreadPoolExecutor, runner: ModelRunner, processes: list[BaseProcess]
) -> int:
    """First rank of a non-zero node: follow rank 0's commands until it shuts the group down."""
    from services.worker.distributed import destroy_groups
    from services.worker.ranks import serve_commands

    await service.set_serving(True)
    following = asyncio.get_running_loop().run_in_executor(model_thread, serve_commands, runner)
    stopped = asyncio.create_task(service.run_until_stopped(lambda grace: asyncio.sleep(0)))
    done, _ = await asyncio.wait({following, stopped}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if following in done and following.exception() is not None:
        log.error("tensor_parallel_group_failed", error=str(following.exception()))
        code = 1
    for process in processes:
        process.join(10)
    if not stopped.done():
        await service.server.stop(0)
    destroy_groups(runner.ranks)
    model_thread.shutdown(wait=False)
    return code
