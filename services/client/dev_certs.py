"""Throwaway certificates for `meshserve up --tls` (and tests): one CA, one certificate per service.

Every certificate is valid for 127.0.0.1, localhost and ::1 (plus any extra hosts), for both server and
client use (a service's certificate is also its client certificate on its own channels). Keys are
ECDSA P-256, written 0600. Never for production: the CA key lies next to the certificates.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.tls import Security, load_files

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Services of a suite, and "client": what the launcher and the CLI present to them.
SUITE_NAMES = ("kvstore", "scheduler", "worker", "gateway", "client")
VALID_DAYS = 30


@dataclass(frozen=True)
class CertPair:
    """One PEM certificate and its private key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class DevCerts:
    """Where make_dev_certs wrote the CA and each name's certificate."""

    directory: Path
    ca: Path
    names: tuple[str, ...]

    def pair(self, name: str) -> CertPair:
        """The certificate and key of one name."""
        if name not in self.names:
            raise KeyError(f"no certificate for {name!r}; made for {list(self.names)}")
        return CertPair(self.directory / f"{name}.pem", self.directory / f"{name}-key.pem")

    def flags(self, name: str) -> list[str]:
        """--tls-cert/--tls-key/--tls-ca for a service (or client) started with this name's certificate."""
        pair = self.pair(name)
        return ["--tls-cert", str(pair.cert), "--tls-key", str(pair.key), "--tls-ca", str(self.ca)]

    def security(self, name: str = "client") -> Security:
        """Channel security of a client presenting this name's certificate (the launcher's health checks)."""
        pair = self.pair(name)
        return load_files(cert=str(pair.cert), key=str(pair.key), ca=str(self.ca))


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # ordered, without duplicates
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_dev_certs(
    directory: Path, names: Sequence[str] = SUITE_NAMES, hosts: Sequence[str] = (), valid_days: int = VALID_DAYS
) -> DevCerts:
    """A fresh CA (ca.pem, ca-key.pem) and NAME.pem/NAME-key.pem for each name, in directory."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=valid_days)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshserve throwaway CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(directory / "ca-key.pem", ca_key)
    _write_cert(directory / "ca.pem", ca)
    aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    for name in names:
        key = _key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshserve {name}")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=True,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(_san([*LOOPBACK_HOSTS, *hosts]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(aki, critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write_key(directory / f"{name}-key.pem", key)
        _write_cert(directory / f"{name}.pem", cert)
    return DevCerts(directory, directory / "ca.pem", tuple(names))
