"""The `meshserve` command: one verb per service, plus up, generate and chat."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pydantic import ValidationError

from services.client.exit_codes import INTERRUPTED
from services.common.settings import (
    ServiceSettings,
    add_settings_arguments,
    describe_settings_error,
    settings_from_args,
)

S = TypeVar("S", bound=ServiceSettings)


def _build_parser() -> argparse.ArgumentParser:
    # Settings classes import only pydantic; heavy modules load inside the chosen verb.
    from services.client import commands, up
    from services.client.bench import command
    from services.gateway.settings import GatewaySettings
    from services.kvstore.settings import KVStoreSettings
    from services.scheduler.settings import SchedulerSettings
    from services.worker.settings import WorkerSettings

    parser = argparse.ArgumentParser(prog="meshserve", description="LLM serving as gRPC microservices")
    verbs = parser.add_subparsers(dest="verb", required=True)
    for name, cls, text in (
        ("gateway", GatewaySettings, "public Generation API"),
        ("scheduler", SchedulerSettings, "continuous batching and KV block accounting"),
        ("worker", WorkerSettings, "model forward and sampling on one device group"),
        ("kvstore", KVStoreSettings, "KV-cache blocks shared by every worker, in memory or Redis"),
    ):
        add_settings_arguments(verbs.add_parser(name, help=text, description=text), cls)
    from services.client import health_probe

    health_probe.add_arguments(verbs.add_parser("health", help="grpc.health.v1 check: exit 0 only when SERVING"))
    up.add_arguments(verbs.add_parser("up", help="run the whole suite here (embedded defaults)"))
    gen = verbs.add_parser("generate", help="stream an answer to one prompt")
    gen.add_argument("prompt")
    gen.add_argument(
        "--raw", action="store_true", help="send the prompt as plain text (default: one user chat message)"
    )
    commands.add_sampling_arguments(gen)
    chat = verbs.add_parser("chat", help="interactive chat")
    chat.add_argument("--system", default=None, help="system message")
    commands.add_sampling_arguments(chat)
    command.add_arguments(verbs.add_parser("bench", help="serving benchmark (vllm bench serve semantics)"))
    from services.client import top

    top.add_arguments(verbs.add_parser("top", help="live terminal view of a running suite (metrics and health)"))
    return parser


def _settings(cls: type[S], ns: argparse.Namespace) -> S:
    """A service's settings, or argparse's usage-error exit (status 2) naming the flag and what is wrong."""
    try:
        return settings_from_args(cls, ns)
    except ValidationError as err:
        print(f"meshserve {ns.verb}: error: {describe_settings_error(err)}", file=sys.stderr)
        sys.exit(2)


def _run(coro: Coroutine[Any, Any, int | None]) -> int:
    try:
        return asyncio.run(coro) or 0
    except KeyboardInterrupt:
        return INTERRUPTED


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `meshserve` console script."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["health"]:
        # Container probes run it every few seconds: skip importing every other verb's modules.
        from services.client import health_probe

        sys.exit(health_probe.main(args[1:]))
    ns = _build_parser().parse_args(argv)
    runners: dict[str, Callable[[], Coroutine[Any, Any, int | None]]] = {}
    if ns.verb == "gateway":
        from services.gateway.server import serve as serve_gateway
        from services.gateway.settings import GatewaySettings

        runners["gateway"] = lambda: serve_gateway(_settings(GatewaySettings, ns))
    elif ns.verb == "scheduler":
        from services.scheduler.server import serve as serve_scheduler
        from services.scheduler.settings import SchedulerSettings

        runners["scheduler"] = lambda: serve_scheduler(_settings(SchedulerSettings, ns))
    elif ns.verb == "worker":
        from services.worker.server import serve as serve_worker
        from services.worker.settings import WorkerSettings

        runners["worker"] = lambda: serve_worker(_settings(WorkerSettings, ns))
    elif ns.verb == "kvstore":
        from services.kvstore.server import serve as serve_kvstore
        from services.kvstore.settings import KVStoreSettings

        runners["kvstore"] = lambda: serve_kvstore(_settings(KVStoreSettings, ns))
    else:
        from services.client import commands, up
        from services.client.bench import command

        runners["bench"] = lambda: command.main(ns)
        from services.client import top

        runners["top"] = lambda: top.run(ns)
        runners.update(
            up=lambda: up.run(ns),
            generate=lambda: commands.generate_main(ns),
            chat=lambda: commands.chat_main(ns),
        )
    sys.exit(_run(runners[ns.verb]()))


if __name__ == "__main__":
    main()
