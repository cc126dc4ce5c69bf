"""`meshserve generate` and `meshserve chat`: stream answers to the terminal."""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.common.tls import Security, TLSConfigError, load_files

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by generate and chat."""
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="gateway host:port")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle: connect with TLS and verify the gateway")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate (a gateway that requires one)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")


def _security(ns: argparse.Namespace) -> Security | None:
    """TLS of the channel to the gateway from --tls-*; None: insecure. Exits with the bad flag named."""
    if ns.tls_ca is None and ns.tls_cert is None and ns.tls_key is None:
        return None
    if ns.tls_ca is None:
        raise SystemExit("error: --tls-cert and --tls-key need --tls-ca (the CA that signed the gateway's certificate)")
    try:
        return load_files(cert=ns.tls_cert, key=ns.tls_key, ca=ns.tls_ca)
    except TLSConfigError as err:
        raise SystemExit(f"error: {err}") from None


def _sampling(ns: argparse.Namespace) -> sampling_pb2.SamplingParams:
    return sampling_params(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos or None,
    )


async def _stream(client: GenerationClient, request: generation_pb2.GenerateRequest) -> str:
    parts: list[str] = []
    async for response in client.generate(request):
        sys.stdout.write(response.text)
        sys.stdout.flush()
        parts.append(response.text)
        if response.finish_reason:
            reason = sampling_pb2.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_")
            u = response.usage
            print()
            print(
                f"[finish={reason.lower()} prompt_tokens={u.prompt_tokens} "
                f"completion_tokens={u.completion_tokens} cached_tokens={u.cached_tokens}]",
                file=sys.stderr,
            )
    return "".join(parts)


def _report(err: grpc.aio.AioRpcError) -> int:
    print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
    return 1


async def generate_main(ns: argparse.Namespace) -> int:
    """One prompt, streamed."""
    async with GenerationClient(ns.address, _security(ns)) as client:
        if ns.raw:
            request = build_request(prompt=ns.prompt, sampling=_sampling(ns))
        else:
            request = build_request(messages=[("user", ns.prompt)], sampling=_sampling(ns))
        try:
            await _stream(client, request)
        except grpc.aio.AioRpcError as err:
            return _report(err)
    return 0


async def chat_main(ns: argparse.Namespace) -> int:
    """An interactive conversation; the history is resent each turn (prefix caching makes that cheap)."""
    history: list[tuple[str, str]] = []
    if ns.system:
        history.append(("system", ns.system))
    async with GenerationClient(ns.address, _security(ns)) as client:
        while True:
            try:
                line = await asyncio.to_thread(input, "you> ")
            except EOFError:
                print()
                return 0
            if not line.strip():
                continue
            history.append(("user", line))
            sys.stdout.write("assistant> ")
            try:
                answer = await _stream(client, build_request(messages=history, sampling=_sampling(ns)))
            except grpc.aio.AioRpcError as err:
                history.pop()
                _report(err)
                continue
            history.append(("assistant", answer))
