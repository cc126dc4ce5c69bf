"""`meshserve health`: one grpc.health.v1 Check, for container HEALTHCHECKs, exec probes and scripts.

Exit status 0 only when the service answers SERVING; 1 otherwise, with the status (or why there was none)
printed. With `--alive` any answer counts (SERVING or NOT_SERVING, even "no such service"): it tells a
process whose gRPC server answers from one that is gone or wedged, which is what a liveness probe needs.
Our health means "can serve now" (a scheduler without a ready worker, a worker that is loading or not
attached, any service draining: NOT_SERVING), so a liveness probe on SERVING would restart healthy
processes that are waiting for a peer.

The address defaults to this container's own service: `$MESHSERVE_HOST:$MESHSERVE_PORT` (the host is
127.0.0.1 when the service listens on every address), else the service and `--port` that PID 1 runs
(`meshserve gateway --port 6000`, as a container's entrypoint does), so one HEALTHCHECK line fits an
image that runs any of the services. TLS and the internal token come from the same `--tls-*` flags and
`MESHSERVE_TLS_*` / `MESHSERVE_INTERNAL_TOKEN_FILE` variables the service itself reads: inside its
container the probe presents the service's own certificate, which internal ports require under mTLS.

Kept light on purpose (grpc and the health stubs; the TLS module only when TLS is used): a probe runs
every few seconds beside the model, so `services.cli` hands `health` here before building the other verbs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

if TYPE_CHECKING:
    from services.common.tls import Security

ENV_PREFIX = "MESHSERVE_"
# Each service's default gRPC port (its settings class), for an address taken from PID 1's command line.
DEFAULT_PORTS = {"gateway": 50051, "scheduler": 50052, "worker": 50053, "kvstore": 50054}
DEFAULT_TIMEOUT_S = 3.0
# Listening on every address: dial the loopback, which is always one of them.
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
# The flags of ServiceSettings the probe shares with the service (flag name, settings field).
TLS_FLAGS = (
    ("--tls-cert", "tls_cert"),
    ("--tls-key", "tls_key"),
    ("--tls-ca", "tls_ca"),
    ("--tls-server-name", "tls_server_name"),
    ("--internal-token-file", "internal_token_file"),
)


class ProbeError(Exception):
    """The probe could not be made (no address, bad TLS files); the message says why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `meshserve health` (also used by the top-level parser, for --help)."""
    parser.add_argument(
        "address",
        nargs="?",
        default=None,
        help="host:port to check (default: $MESHSERVE_HOST:$MESHSERVE_PORT, else the service PID 1 runs)",
    )
    parser.add_argument(
        "--service",
        default="",
        help='grpc.health.v1 service name, e.g. meshserve.v1.KVBlockStore (default "": the server as a whole)',
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=f"seconds to wait (default {DEFAULT_TIMEOUT_S})"
    )
    parser.add_argument(
        "--alive",
        action="store_true",
        help="exit 0 on any answer, NOT_SERVING too (liveness: the server answers), not only on SERVING",
    )
    for flag, field in TLS_FLAGS:
        env = f"{ENV_PREFIX}{field.upper()}"
        parser.add_argument(flag, dest=field, default=None, help=f"as the service's {flag} [env {env}]")


def _setting(ns: argparse.Namespace, field: str) -> str | None:
    """A flag, else its MESHSERVE_* variable (an empty variable counts as unset)."""
    value: str | None = getattr(ns, field)
    if value is None:
        value = os.environ.get(f"{ENV_PREFIX}{field.upper()}") or None
    return value


def _pid1_service(cmdline_path: Path = Path("/proc/1/cmdline")) -> tuple[str, int] | None:
    """(verb, port) of a `meshserve <service>` running as PID 1, or None when PID 1 is something else."""
    try:
        argv = cmdline_path.read_bytes().split(b"\0")
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in argv if a]
    verbs = [i for i, a in enumerate(args) if a in DEFAULT_PORTS]
    if not verbs:
        return None
    verb = args[verbs[0]]
    port = DEFAULT_PORTS[verb]
    rest = args[verbs[0] + 1 :]
    for i, arg in enumerate(rest):
        value = rest[i + 1] if arg == "--port" and i + 1 < len(rest) else None
        if arg.startswith("--port="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit():
            port = int(value)
    return verb, port


def resolve_address(address: str | None, cmdline_path: Path = Path("/proc/1/cmdline")) -> str:
    """The host:port to dial; ProbeError when neither the argument, the variables nor PID 1 say."""
    if address:
        return address
    host = os.environ.get(f"{ENV_PREFIX}HOST", "")
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    port = os.environ.get(f"{ENV_PREFIX}PORT")
    if not port:
        found = _pid1_service(cmdline_path)
        if found is None:
            raise ProbeError("no address: give HOST:PORT, or set MESHSERVE_PORT to the service's gRPC port")
        port = str(found[1])
    # A bare IPv6 host needs brackets before the port.
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _security(ns: argparse.Namespace) -> Security | None:
    """The TLS material and token from the flags and variables; None when none is set (plain channel)."""
    paths = {field: _setting(ns, field) for _, field in TLS_FLAGS}
    if not any(paths.values()):
        return None
    # Imported only here: it pulls in pydantic, which a plaintext probe does not need.
    from services.common.tls import TLSConfigError, load_files

    try:
        return load_files(
            cert=paths["tls_cert"],
            key=paths["tls_key"],
            ca=paths["tls_ca"],
            server_name=paths["tls_server_name"],
            token_file=paths["internal_token_file"],
        )
    except TLSConfigError as err:
        raise ProbeError(str(err)) from None


def _channel(target: str, security: Security | None) -> grpc.Channel:
    credentials = security.channel_credentials() if security is not None else None
    if security is None or credentials is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, credentials, options=list(security.channel_options()))


def check(
    target: str, service: str = "", timeout: float = DEFAULT_TIMEOUT_S, security: Security | None = None
) -> tuple[int | None, str]:
    """One Check: (the HealthCheckResponse status or None without an answer, a line saying what happened)."""
    # Health needs no token, but the interceptor of a meshserve service accepts it, and another server
    # behind the same flags might want it.
    metadata = (("authorization", f"Bearer {security.token}"),) if security and security.token else None
    with _channel(target, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=metadata)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            details = err.details() if isinstance(err, grpc.Call) else str(err)
            if code == grpc.StatusCode.NOT_FOUND:
                # The server answered: it has no such service name (grpc's own servicer says NOT_FOUND).
                return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN, f"SERVICE_UNKNOWN ({service!r} at {target})"
            name = code.name if code is not None else "ERROR"
            return None, f"no answer from {target}: {name}: {details}"
    status = int(reply.status)
    return status, health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def run(ns: argparse.Namespace, cmdline_path: Path = Path("/proc/1/cmdline")) -> int:
    """Probe as the parsed flags say; prints the outcome and returns the exit status."""
    try:
        target = resolve_address(ns.address, cmdline_path)
        security = _security(ns)
    except ProbeError as err:
        print(f"meshserve health: error: {err}", file=sys.stderr)
        return 1
    status, line = check(target, ns.service, ns.timeout, security)
    healthy = status == health_pb2.HealthCheckResponse.SERVING or (ns.alive and status is not None)
    # A status is the answer (stdout, for scripts); no answer at all is an error (stderr).
    print(line, file=sys.stdout if status is not None else sys.stderr)
    return 0 if healthy else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`meshserve health ARGS` (argv without the verb); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="meshserve health", description="grpc.health.v1 Check: exit 0 only when SERVING"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
