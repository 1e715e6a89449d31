"""TLS for tests: a throwaway certificate authority with server and client certificates (made with
``cryptography`` at test time, never checked in), and a ``redis-server`` that speaks only TLS,
asks for client certificates and has an ACL user.

Not a production setup: short-lived keys, loopback only, no persistence.
"""

from __future__ import annotations

import datetime
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from . import LocalRedis


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: the CA, the server's certificate and key (for 127.0.0.1 and localhost), a client
    certificate and key signed by the same CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, cert, key=None) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.with_suffix(".key").chmod(0o600)


def _certificate(
    subject: str, key, issuer=None, issuer_key=None, ca: bool = False, server: bool = False
):
    """A certificate for ``key`` named ``subject``, signed by ``issuer_key`` (itself when None)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
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
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key or key, hashes.SHA256())


def make_tls_files(folder: str | Path, name: str = "kvfuse-test") -> TLSFiles:
    """A new CA and a server and a client certificate signed by it, written into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = _certificate(f"{name} CA", ca_key, ca=True)
    _write(folder / "ca.pem", ca)
    for role in ("server", "client"):
        key = _key()
        _write(
            folder / f"{role}.pem",
            _certificate(f"{name} {role}", key, ca.subject, ca_key, server=role == "server"),
            key,
        )
    return TLSFiles(
        folder / "ca.pem",
        folder / "server.pem",
        folder / "server.key",
        folder / "client.pem",
        folder / "client.key",
    )


class LocalTLSRedis(LocalRedis):
    """A redis-server on a free 127.0.0.1 port that speaks only TLS (``--port 0 --tls-port P``) with
    ``tls`` (``auth_clients``: it asks for a client certificate signed by the CA), the default user
    disabled and one ACL user ``username`` with ``password`` over ``kvfuse:*`` keys. ``url`` is
    ``rediss://127.0.0.1:P/0`` (no credentials: give them as settings)."""

    def __init__(
        self,
        tls: TLSFiles,
        username: str,
        password: str,
        auth_clients: bool = True,
        executable: str | None = None,
        port: int | None = None,
    ) -> None:
        super().__init__(executable, port)
        self.tls, self.username, self.password, self.auth_clients = (
            tls,
            username,
            password,
            auth_clients,
        )

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        return [
            self.executable,
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--tls-cert-file",
            str(self.tls.server_cert),
            "--tls-key-file",
            str(self.tls.server_key),
            "--tls-ca-cert-file",
            str(self.tls.ca),
            "--tls-auth-clients",
            "yes" if self.auth_clients else "no",
            # one argument per word: redis-server joins them into "user NAME RULES..." lines
            "--user",
            "default",
            "off",
            "--user",
            self.username,
            "on",
            f">{self.password}",
            "~kvfuse:*",
            "&*",
            "+@all",
        ]

    def _ready(self) -> bool:
        """The server answers over TLS (-NOAUTH is an answer: the default user is off)."""
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                with context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16)[:1] in (b"+", b"-")
        except (OSError, ssl.SSLError):
            return False
