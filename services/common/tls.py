"""TLS, mTLS and the internal token of one service: its files, read and checked once at startup.

The flags (every service has them, see ServiceSettings):

- `--tls-cert` and `--tls-key`: the service's own PEM certificate chain and key. Its gRPC port serves
  TLS with them, and its outgoing channels present them as their client certificate (mTLS).
- `--tls-ca`: the PEM CA bundle peers are verified with. Outgoing channels use TLS only when it is given
  (none: insecure, as without any flag). On an internal port (scheduler, kvstore, worker) it also makes
  client certificates required: only peers with a certificate the CA signed get past the handshake.
  The gateway's public port does not ask for one unless `--tls-client-auth require` says so.
- `--tls-server-name`: the name outgoing channels expect in the peer's certificate (unset: the host of
  the address they dial).
- `--internal-token-file`: one line, the mesh's shared secret. Internal servers require it as
  `authorization: Bearer <token>` (services/common/internal_auth.py) and outgoing channels send it.

A mistake in any of them is a TLSConfigError that names the flag, raised before the port is bound.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from services.common.settings import ServiceSettings

if TYPE_CHECKING:
    from cryptography import x509

PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


class TLSConfigError(ValueError):
    """A --tls-* or --internal-token-file flag names a file that is missing, unreadable or malformed."""


@dataclass(frozen=True)
class Security:
    """One service's TLS material and internal token (bytes: picklable, so TP ranks get it across spawn).

    repr shows neither the private key nor the token.
    """

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None
    token: str | None = field(default=None, repr=False)
    client_auth: str = "auto"

    @property
    def tls_server(self) -> bool:
        """The gRPC port serves TLS."""
        return self.cert is not None

    @property
    def tls_client(self) -> bool:
        """Outgoing channels use TLS."""
        return self.ca is not None

    def requires_client_cert(self, *, public: bool = False) -> bool:
        """Whether the port refuses a handshake without a client certificate the CA signed."""
        if not self.tls_server or self.ca is None or self.client_auth == "none":
            return False
        return self.client_auth == "require" or not public

    def describe(self, *, public: bool = False) -> str:
        """For the startup log: "mtls", "tls" or "off"."""
        if not self.tls_server:
            return "off"
        return "mtls" if self.requires_client_cert(public=public) else "tls"

    def server_credentials(self, *, public: bool = False) -> grpc.ServerCredentials | None:
        """Credentials to bind the port with; None: insecure."""
        if self.cert is None or self.key is None:
            return None
        require = self.requires_client_cert(public=public)
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca if require else None, require_client_auth=require
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials of an outgoing channel; None: insecure. The own certificate is the client certificate."""
        if self.ca is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> tuple[tuple[str, str], ...]:
        """Options an outgoing channel adds to its own (the target name override)."""
        if self.ca is None or not self.server_name:
            return ()
        return (("grpc.ssl_target_name_override", self.server_name),)


def load_security(settings: ServiceSettings) -> Security:
    """The service's TLS material and token, read once per set of flags; TLSConfigError names the bad flag."""
    return _load(
        settings.tls_cert,
        settings.tls_key,
        settings.tls_ca,
        settings.tls_server_name,
        settings.internal_token_file,
        settings.tls_client_auth,
    )


def load_files(
    *,
    cert: str | None = None,
    key: str | None = None,
    ca: str | None = None,
    server_name: str | None = None,
    token_file: str | None = None,
) -> Security:
    """The same from paths, for clients that have no ServiceSettings (the CLI, the launcher, tests)."""
    return _load(cert, key, ca, server_name, token_file, "auto")


def server_credentials(settings: ServiceSettings, *, public: bool = False) -> grpc.ServerCredentials | None:
    """Credentials for the service's gRPC port; None: insecure (no --tls-cert)."""
    return load_security(settings).server_credentials(public=public)


def channel_credentials(settings: ServiceSettings) -> grpc.ChannelCredentials | None:
    """Credentials for the service's outgoing channels; None: insecure (no --tls-ca)."""
    return load_security(settings).channel_credentials()


@functools.lru_cache(maxsize=16)
def _load(
    cert_path: str | None,
    key_path: str | None,
    ca_path: str | None,
    server_name: str | None,
    token_path: str | None,
    client_auth: str,
) -> Security:
    if (cert_path is None) != (key_path is None):
        given, missing = ("--tls-cert", "--tls-key") if cert_path is not None else ("--tls-key", "--tls-cert")
        raise TLSConfigError(f"{given} needs {missing} too (a certificate and its private key go together)")
    cert = key = ca = None
    if cert_path is not None and key_path is not None:
        cert = _read("--tls-cert", cert_path)
        key = _read("--tls-key", key_path)
        _check_pair(cert_path, cert, key_path, key)
    if ca_path is not None:
        ca = _read("--tls-ca", ca_path)
        _check_certificates("--tls-ca", ca_path, ca)
    token = _read_token(token_path) if token_path is not None else None
    return Security(ca=ca, cert=cert, key=key, server_name=server_name or None, token=token, client_auth=client_auth)


def _read(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise TLSConfigError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise TLSConfigError(f"{flag} {path}: is a directory, not a file") from None
    except OSError as err:
        raise TLSConfigError(f"{flag} {path}: cannot read it ({err.strerror or err})") from None


def _check_certificates(flag: str, path: str, data: bytes) -> list[x509.Certificate]:
    """The PEM certificates in data; TLSConfigError unless there is at least one and all parse."""
    from cryptography import x509

    if PEM_CERTIFICATE not in data:
        raise TLSConfigError(f"{flag} {path}: not a PEM certificate (no '{PEM_CERTIFICATE.decode()}' line)")
    try:
        return list(x509.load_pem_x509_certificates(data))
    except ValueError as err:
        raise TLSConfigError(f"{flag} {path}: not a valid PEM certificate ({err})") from None


def _check_pair(cert_path: str, cert: bytes, key_path: str, key: bytes) -> None:
    """The key parses, is not encrypted, and belongs to the first certificate of the chain."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    certificates = _check_certificates("--tls-cert", cert_path, cert)
    if b"PRIVATE KEY-----" not in key:
        raise TLSConfigError(f"--tls-key {key_path}: not a PEM private key (no '-----BEGIN ... PRIVATE KEY-----')")
    try:
        private_key = serialization.load_pem_private_key(key, password=None)
    except TypeError:
        raise TLSConfigError(f"--tls-key {key_path}: the key is encrypted; give an unencrypted PEM key") from None
    except (ValueError, UnsupportedAlgorithm) as err:
        raise TLSConfigError(f"--tls-key {key_path}: not a valid PEM private key ({err})") from None
    spki = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    leaf = certificates[0]
    if private_key.public_key().public_bytes(*spki) != leaf.public_key().public_bytes(*spki):
        raise TLSConfigError(f"--tls-key {key_path} is not the private key of --tls-cert {cert_path}")


def _read_token(path: str) -> str:
    token = _read("--internal-token-file", path).decode("utf-8", errors="replace").strip()
    if not token:
        raise TLSConfigError(f"--internal-token-file {path}: the file is empty")
    # It travels as a gRPC metadata value: printable ASCII, no spaces inside (the error never shows it).
    if not all("!" <= c <= "~" for c in token):
        raise TLSConfigError(
            f"--internal-token-file {path}: the token must be one line of printable ASCII without spaces"
        )
    return token
