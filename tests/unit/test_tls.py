"""TLS files and the internal token: loading errors name the flag, dev certificates chain to their CA, and an
in-process server refuses clients without a certificate (mTLS) or without the token."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client.dev_certs import DevCerts, make_dev_certs
from services.common.channels import open_channel, open_sync_channel
from services.common.grpc_server import GrpcService
from services.common.internal_auth import REFUSED
from services.common.settings import ServiceSettings
from services.common.tls import Security, TLSConfigError, load_files, load_security

TOKEN = "s3cr3t-internal-token-0123456789"
UNARY = "/test.Echo/Unary"
SERVER_STREAM = "/test.Echo/ServerStream"
CLIENT_STREAM = "/test.Echo/ClientStream"
BIDI = "/test.Echo/Bidi"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    return make_dev_certs(tmp_path_factory.mktemp("tls"), names=("server", "client", "gateway"))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> DevCerts:
    """Certificates of another CA: valid, but not ours."""
    return make_dev_certs(tmp_path_factory.mktemp("other-tls"), names=("client",))


def _settings(**fields: Any) -> ServiceSettings:
    return ServiceSettings(**fields)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


# ---- loading ----


def test_missing_files_name_the_flag(tmp_path: Path, certs: DevCerts) -> None:
    pair = certs.pair("server")
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(TLSConfigError, match=r"^--tls-cert .*nope\.pem: no such file"):
        load_files(cert=missing, key=str(pair.key))
    with pytest.raises(TLSConfigError, match=r"^--tls-key .*nope\.pem: no such file"):
        load_files(cert=str(pair.cert), key=missing)
    with pytest.raises(TLSConfigError, match=r"^--tls-ca .*nope\.pem: no such file"):
        load_files(ca=missing)
    with pytest.raises(TLSConfigError, match=r"^--internal-token-file .*nope\.pem: no such file"):
        load_files(token_file=missing)
    with pytest.raises(TLSConfigError, match=r"^--tls-ca .*: is a directory"):
        load_files(ca=str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_names_the_flag(tmp_path: Path, certs: DevCerts) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(certs.ca.read_bytes())
    ca.chmod(0)
    with pytest.raises(TLSConfigError, match=r"^--tls-ca .*: cannot read it"):
        load_files(ca=str(ca))


def test_cert_and_key_go_together(certs: DevCerts) -> None:
    pair = certs.pair("server")
    with pytest.raises(TLSConfigError, match="--tls-cert needs --tls-key"):
        load_files(cert=str(pair.cert))
    with pytest.raises(TLSConfigError, match="--tls-key needs --tls-cert"):
        load_files(key=str(pair.key))


def test_not_pem_names_the_flag(tmp_path: Path, certs: DevCerts) -> None:
    pair = certs.pair("server")
    junk = tmp_path / "junk.pem"
    junk.write_text("hello, not a certificate\n")
    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n")
    with pytest.raises(TLSConfigError, match=r"^--tls-cert .*junk\.pem: not a PEM certificate"):
        load_files(cert=str(junk), key=str(pair.key))
    with pytest.raises(TLSConfigError, match=r"^--tls-cert .*broken\.pem: not a valid PEM certificate"):
        load_files(cert=str(broken), key=str(pair.key))
    with pytest.raises(TLSConfigError, match=r"^--tls-key .*junk\.pem: not a PEM private key"):
        load_files(cert=str(pair.cert), key=str(junk))
    with pytest.raises(TLSConfigError, match=r"^--tls-ca .*junk\.pem: not a PEM certificate"):
        load_files(ca=str(junk))
    # A key where the certificate belongs, and the other way round.
    with pytest.raises(TLSConfigError, match=r"^--tls-cert .*server-key\.pem: not a PEM certificate"):
        load_files(cert=str(pair.key), key=str(pair.cert))


def test_key_of_another_certificate_is_refused(certs: DevCerts) -> None:
    with pytest.raises(TLSConfigError, match=r"--tls-key .*client-key\.pem is not the private key of --tls-cert"):
        load_files(cert=str(certs.pair("server").cert), key=str(certs.pair("client").key))


def test_token_file_checks_never_show_the_token(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(TLSConfigError, match="the file is empty"):
        load_files(token_file=str(empty))
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    with pytest.raises(TLSConfigError, match="printable ASCII without spaces") as err:
        load_files(token_file=str(spaced))
    assert "two words" not in str(err.value)
    good = tmp_path / "good"
    good.write_text(f"{TOKEN}\n")
    security = load_files(token_file=str(good))
    assert security.token == TOKEN
    assert TOKEN not in repr(security)


def test_settings_flags_load_once(tmp_path: Path, certs: DevCerts) -> None:
    pair = certs.pair("server")
    settings = _settings(tls_cert=str(pair.cert), tls_key=str(pair.key), tls_ca=str(certs.ca))
    first = load_security(settings)
    assert first is load_security(settings.model_copy())
    assert first.tls_server and first.tls_client and first.requires_client_cert()
    assert not first.requires_client_cert(public=True)
    assert first.server_credentials() is not None and first.channel_credentials() is not None
    assert b"PRIVATE KEY" not in repr(first).encode()
    plain = load_security(_settings())
    assert plain.server_credentials() is None and plain.channel_credentials() is None
    assert plain.describe() == "off"


# ---- dev certificates ----


def test_dev_certs_chain_verifies(certs: DevCerts, other_certs: DevCerts) -> None:
    ca = _cert(certs.ca)
    store = Store([ca])
    server = _cert(certs.pair("server").cert)
    server_verifier = PolicyBuilder().store(store)
    for name in (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))):
        chain = server_verifier.build_server_verifier(name).verify(server, [])
        assert chain[-1] == ca
    chain = server_verifier.build_server_verifier(x509.IPAddress(ipaddress.ip_address("::1"))).verify(server, [])
    assert chain[-1] == ca
    # Every service's certificate is also a client certificate.
    client = _cert(certs.pair("client").cert)
    verified = PolicyBuilder().store(store).build_client_verifier().verify(client, [])
    assert verified.chain[-1] == ca
    # Not for a name it does not carry, and not under another CA.
    with pytest.raises(VerificationError):
        server_verifier.build_server_verifier(x509.DNSName("example.com")).verify(server, [])
    with pytest.raises(VerificationError):
        PolicyBuilder().store(store).build_client_verifier().verify(_cert(other_certs.pair("client").cert), [])


def test_dev_cert_keys_are_private_and_load(certs: DevCerts) -> None:
    for name in certs.names:
        pair = certs.pair(name)
        assert stat.S_IMODE(pair.key.stat().st_mode) == 0o600
        load_files(cert=str(pair.cert), key=str(pair.key), ca=str(certs.ca))
    assert certs.flags("server") == [
        "--tls-cert", str(certs.pair("server").cert), "--tls-key", str(certs.pair("server").key),
        "--tls-ca", str(certs.ca),
    ]  # fmt: skip
    with pytest.raises(KeyError):
        certs.pair("nobody")


# ---- an in-process server ----


def _echo_handlers() -> grpc.GenericRpcHandler:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def server_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for _ in range(3):
            yield request

    async def client_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        return b"".join([r async for r in requests])

    async def bidi(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request

    return grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
            "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        },
    )


class Running:
    def __init__(self, service: GrpcService) -> None:
        self.service = service

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.service.port}"


async def _start(settings: ServiceSettings, *, public: bool = False) -> Running:
    service = GrpcService("test", settings, ["test.Echo"], public=public)
    service.server.add_generic_rpc_handlers((_echo_handlers(),))
    await service.start()
    await service.set_serving(True)
    return Running(service)


def _server_settings(certs: DevCerts, tmp_path: Path, *, token: bool = False, tls: bool = True) -> ServiceSettings:
    pair = certs.pair("server")
    fields: dict[str, Any] = {"port": 0}
    if tls:
        fields.update(tls_cert=str(pair.cert), tls_key=str(pair.key), tls_ca=str(certs.ca))
    if token:
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        fields["internal_token_file"] = str(token_file)
    return _settings(**fields)


async def _health(address: str, security: Security | None, timeout: float = 5) -> int:
    async with open_channel(address, security) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return int(reply.status)


async def _unary(address: str, security: Security | None) -> bytes:
    async with open_channel(address, security) as channel:
        answer: bytes = await channel.unary_unary(UNARY)(b"ping", timeout=5)
        return answer


async def _refused(address: str, security: Security | None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _health(address, security, timeout=3)
    return err.value


@pytest.fixture
async def mtls_server(certs: DevCerts, tmp_path: Path) -> AsyncIterator[Running]:
    running = await _start(_server_settings(certs, tmp_path))
    yield running
    await running.service.server.stop(0)


async def test_mtls_needs_a_client_certificate_of_the_ca(
    mtls_server: Running, certs: DevCerts, other_certs: DevCerts
) -> None:
    address = mtls_server.address
    assert mtls_server.service.security.describe() == "mtls"
    assert await _health(address, certs.security("client")) == health_pb2.HealthCheckResponse.SERVING
    assert await _unary(address, certs.security("client")) == b"ping"
    # Trusts the CA but presents no certificate: the handshake fails.
    no_cert = load_files(ca=str(certs.ca))
    assert (await _refused(address, no_cert)).code() == grpc.StatusCode.UNAVAILABLE
    # Plaintext against a TLS port.
    assert (await _refused(address, None)).code() == grpc.StatusCode.UNAVAILABLE
    # A certificate of another CA.
    foreign = Security(
        ca=certs.ca.read_bytes(),
        cert=other_certs.pair("client").cert.read_bytes(),
        key=other_certs.pair("client").key.read_bytes(),
    )
    assert (await _refused(address, foreign)).code() == grpc.StatusCode.UNAVAILABLE
    # A client that does not trust the server's CA.
    assert (await _refused(address, other_certs.security("client"))).code() == grpc.StatusCode.UNAVAILABLE


async def test_public_port_serves_tls_without_client_certificates(certs: DevCerts, tmp_path: Path) -> None:
    running = await _start(_server_settings(certs, tmp_path, token=True), public=True)
    try:
        assert running.service.security.describe(public=True) == "tls"
        # No client certificate and no token: the gateway's public API checks neither.
        assert await _unary(running.address, load_files(ca=str(certs.ca))) == b"ping"
        assert (await _refused(running.address, None)).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.service.server.stop(0)


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mtls"])
async def test_internal_token_on_every_call_kind(certs: DevCerts, tmp_path: Path, tls: bool) -> None:
    running = await _start(_server_settings(certs, tmp_path, token=True, tls=tls))
    base = certs.security("client") if tls else Security()
    with_token = Security(ca=base.ca, cert=base.cert, key=base.key, token=TOKEN)
    wrong_token = Security(ca=base.ca, cert=base.cert, key=base.key, token=TOKEN[:-1] + "X")
    address = running.address
    try:
        # Health stays open without the token.
        assert await _health(address, base) == health_pb2.HealthCheckResponse.SERVING
        for security in (base, wrong_token):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _unary(address, security)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert err.value.details() == REFUSED
            assert TOKEN not in (err.value.details() or "") and "X" not in (err.value.details() or "")
        async with open_channel(address, base) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in channel.unary_stream(SERVER_STREAM)(b"x", timeout=5)]
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary("/test.Echo/NoSuchMethod")(b"x", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With the token, all four call kinds on an asyncio channel.
        async with open_channel(address, with_token) as channel:
            assert await channel.unary_unary(UNARY)(b"a", timeout=5) == b"a"
            assert [r async for r in channel.unary_stream(SERVER_STREAM)(b"b", timeout=5)] == [b"b"] * 3

            async def requests() -> AsyncIterator[bytes]:
                for part in (b"c", b"d"):
                    yield part

            assert await channel.stream_unary(CLIENT_STREAM)(requests(), timeout=5) == b"cd"
            assert [r async for r in channel.stream_stream(BIDI)(requests(), timeout=5)] == [b"c", b"d"]
            # Metadata of the caller's own travels on next to the token.
            assert await channel.unary_unary(UNARY)(b"e", metadata=(("x-request-id", "r1"),), timeout=5) == b"e"

        # And on a synchronous channel (the worker's kvstore threads): unary-stream and stream-unary.
        def sync_calls() -> tuple[list[bytes], bytes]:
            with open_sync_channel(address, with_token) as channel:
                streamed = list(channel.unary_stream(SERVER_STREAM)(b"f", timeout=5))
                joined = channel.stream_unary(CLIENT_STREAM)(iter([b"g", b"h"]), timeout=5)
                return streamed, joined

        def sync_refused() -> grpc.StatusCode:
            with open_sync_channel(address, base) as channel, pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(UNARY)(b"x", timeout=5)
            return err.value.code()  # type: ignore[no-any-return, attr-defined]

        assert await asyncio.to_thread(sync_calls) == ([b"f"] * 3, b"gh")
        assert await asyncio.to_thread(sync_refused) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await running.service.server.stop(0)


def test_bad_tls_flag_ends_a_service_with_one_line(tmp_path: Path) -> None:
    settings = _settings(tls_ca=str(tmp_path / "missing-ca.pem"))
    with pytest.raises(SystemExit) as err:
        GrpcService("scheduler", settings, [])
    assert str(err.value).startswith("meshserve scheduler: error: --tls-ca ")
    assert "no such file" in str(err.value)


@pytest.fixture(autouse=True)
def _no_tls_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("TLS_CERT", "TLS_KEY", "TLS_CA", "TLS_SERVER_NAME", "INTERNAL_TOKEN_FILE", "TLS_CLIENT_AUTH"):
        monkeypatch.delenv(f"MESHSERVE_{name}", raising=False)
    yield
