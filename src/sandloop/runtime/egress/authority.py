"""The egress proxy's certificate authority: made once per install (never shipped in the repo),
kept under sandloop's state with its key readable by root only. A sandbox trusts it only for a run
that has secrets (the launcher adds it to the TLS clients' trust, see launcher.py ``trust``); the
proxy then answers that run's tunnels with a certificate for the tunnel's host, signed here."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import ssl
import threading
import uuid
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sandloop.paths import write_atomically

_DAY = datetime.timedelta(days=1)


def _write_private(path: Path, data: bytes) -> None:
    write_atomically(path, data, 0o600)


class CertificateAuthority:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._leaves: dict[str, tuple[str, str]] = {}
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        key_path, cert_path = directory / "ca.key", directory / "ca.pem"
        if not (key_path.is_file() and cert_path.is_file()):
            self._create(key_path, cert_path)
        self._key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        self.cert_pem = cert_path.read_text()
        self._cert = x509.load_pem_x509_certificate(self.cert_pem.encode())

    @staticmethod
    def _create(key_path: Path, cert_path: Path) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"sandloop egress CA {uuid.uuid4().hex[:8]}")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 3650 * _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
            .sign(key, hashes.SHA256())
        )
        pem_key = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        _write_private(key_path, pem_key)
        _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        cert_path.chmod(0o644)

    def _leaf(self, host: str) -> tuple[str, str]:
        """(certificate file, key file) for ``host``, made on first use."""
        with self._lock:
            found = self._leaves.get(host)
            if found is not None:
                return found
            key = ec.generate_private_key(ec.SECP256R1())
            try:
                alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
            except ValueError:
                alt = x509.DNSName(host)
            now = datetime.datetime.now(datetime.UTC)
            cert = (
                x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
                .issuer_name(self._cert.subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - _DAY)
                .not_valid_after(now + 30 * _DAY)
                .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256())  # type: ignore[arg-type]
            )
            leaves = self.directory / "leaves"
            leaves.mkdir(exist_ok=True, mode=0o700)
            stem = hashlib.sha256(host.encode()).hexdigest()[:24]
            cert_file, key_file = leaves / f"{stem}.pem", leaves / f"{stem}.key"
            _write_private(cert_file, cert.public_bytes(serialization.Encoding.PEM))
            _write_private(
                key_file,
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                ),
            )
            self._leaves[host] = (str(cert_file), str(key_file))
            return self._leaves[host]

    def server_context(self, host: str, seen: dict[str, str]) -> ssl.SSLContext:
        """A server-side context for one tunnel to ``host``; a ClientHello naming another host is
        refused (and its name left in ``seen['sni']``)."""
        cert_file, key_file = self._leaf(host)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert_file, key_file)

        def check(_sock: object, server_name: str | None, _ctx: ssl.SSLContext) -> int | None:
            if server_name is not None and server_name.lower().rstrip(".") != host:
                seen["sni"] = server_name
                return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
            return None

        context.sni_callback = check
        return context
