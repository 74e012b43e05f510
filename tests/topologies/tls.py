"""Throw-away TLS certificates for tests, made with the ``openssl`` command: a certificate
authority, a server certificate for 127.0.0.1 and ``localhost``, a client certificate, and a
second, unrelated authority for "wrong CA" tests.

Example::

    from topologies import TLSCertificates, TopologyServer

    with TLSCertificates.create() as certificates, TopologyServer(tls=certificates) as server:
        Redlock([server.url])                        # rediss://...?ssl_ca_certs=...
        server.tls_url(ca_certificate=certificates.unrelated_ca_certificate)  # refused
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

__all__ = ["TLSCertificates"]

_DAYS = "2"
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
# A minimal configuration, so the system's (which may add extensions or ask for fields) plays
# no part. Extensions as strict verifiers (Python 3.13's VERIFY_X509_STRICT) want them.
_CONFIGURATION = """\
[req]
distinguished_name = name
prompt = no
[name]
[authority]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
"""
_SERVER_EXTENSIONS = """\
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
"""
_CLIENT_EXTENSIONS = """\
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
"""


@dataclass(frozen=True)
class TLSCertificates:
    """PEM files in :attr:`directory`: an authority, a server and a client certificate signed by
    it (valid two days), and the certificate of an unrelated authority.

    Make them with :meth:`create`; :meth:`remove` (or leaving a ``with`` block) deletes the
    directory.
    """

    directory: Path
    """Where the files are."""
    ca_certificate: Path
    """The authority that signed the server and client certificates."""
    ca_key: Path
    """The authority's private key."""
    server_certificate: Path
    """For 127.0.0.1 and ``localhost`` (``subjectAltName``), usage ``serverAuth``."""
    server_key: Path
    """The server certificate's private key."""
    client_certificate: Path
    """Common name ``celery-redlock-test-client``, usage ``clientAuth``."""
    client_key: Path
    """The client certificate's private key."""
    unrelated_ca_certificate: Path
    """An authority that signed nothing here: a client trusting only it refuses the server."""

    @classmethod
    def create(cls, directory: str | Path | None = None) -> TLSCertificates:
        """Make the files in ``directory`` (created if missing; by default a new temporary
        directory) with the ``openssl`` command.

        Raises:
            RuntimeError: ``openssl`` is not on ``PATH``, or failed (its output is quoted).
        """
        openssl = shutil.which("openssl")
        if openssl is None:
            raise RuntimeError(
                "the openssl command is needed to make test certificates: install OpenSSL "
                "(for example `apt-get install openssl`)"
            )
        if directory is None:
            folder = Path(tempfile.mkdtemp(prefix="celery-redlock-tls-"))
        else:
            folder = Path(directory)
            folder.mkdir(parents=True, exist_ok=True)
        certificates = cls(
            directory=folder,
            ca_certificate=folder / "ca.crt",
            ca_key=folder / "ca.key",
            server_certificate=folder / "server.crt",
            server_key=folder / "server.key",
            client_certificate=folder / "client.crt",
            client_key=folder / "client.key",
            unrelated_ca_certificate=folder / "unrelated-ca.crt",
        )
        certificates._make(openssl)
        return certificates

    def url_options(self, *, ca_certificate: Path | None = None, client: bool = True) -> str:
        """The query string of a ``rediss://`` URL that trusts the authority (or
        ``ca_certificate``) and, with ``client``, presents the client certificate:
        ``ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...``, as redis-py reads it."""
        options = {"ssl_ca_certs": ca_certificate or self.ca_certificate}
        if client:
            options["ssl_certfile"] = self.client_certificate
            options["ssl_keyfile"] = self.client_key
        return "&".join(f"{name}={quote(str(path))}" for name, path in options.items())

    def client_options(self, *, client: bool = True) -> dict[str, str | bool]:
        """Keyword arguments for :class:`redis.Redis` that connect with TLS, trust the authority
        and, with ``client``, present the client certificate."""
        options: dict[str, str | bool] = {"ssl": True, "ssl_ca_certs": str(self.ca_certificate)}
        if client:
            options["ssl_certfile"] = str(self.client_certificate)
            options["ssl_keyfile"] = str(self.client_key)
        return options

    def remove(self) -> None:
        """Delete :attr:`directory` and everything in it."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> TLSCertificates:
        return self

    def __exit__(self, *exception: object) -> None:
        self.remove()

    def _make(self, openssl: str) -> None:
        folder = self.directory
        self._authority(openssl, self.ca_certificate, self.ca_key, "celery-redlock test CA")
        self._authority(
            openssl,
            self.unrelated_ca_certificate,
            folder / "unrelated-ca.key",
            "celery-redlock unrelated CA",
        )
        self._signed(openssl, "server", "127.0.0.1", _SERVER_EXTENSIONS)
        self._signed(openssl, "client", "celery-redlock-test-client", _CLIENT_EXTENSIONS)
        for leftover in [*folder.glob("*.csr"), *folder.glob("*.ext")]:
            leftover.unlink()

    def _configuration(self) -> Path:
        path = self.directory / "openssl.cnf"
        if not path.exists():
            path.write_text(_CONFIGURATION)
        return path

    def _authority(self, openssl: str, certificate: Path, key: Path, name: str) -> None:
        _run(
            openssl, "req", "-x509", *_KEY, "-days", _DAYS, "-subj", f"/CN={name}",
            "-keyout", key, "-out", certificate,
            "-config", self._configuration(), "-extensions", "authority",
        )  # fmt: skip

    def _signed(self, openssl: str, role: str, name: str, extensions_text: str) -> None:
        folder = self.directory
        key, request = folder / f"{role}.key", folder / f"{role}.csr"
        certificate, extensions = folder / f"{role}.crt", folder / f"{role}.ext"
        extensions.write_text(extensions_text)
        _run(
            openssl, "req", "-new", *_KEY, "-subj", f"/CN={name}", "-keyout", key,
            "-out", request, "-config", self._configuration(),
        )  # fmt: skip
        _run(
            openssl, "x509", "-req", "-in", request, "-CA", self.ca_certificate,
            "-CAkey", self.ca_key, "-CAcreateserial", "-days", _DAYS,
            "-out", certificate, "-extfile", extensions,
        )  # fmt: skip


def _run(*command: str | Path) -> None:
    arguments = [str(part) for part in command]
    result = subprocess.run(arguments, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"openssl failed ({result.returncode}): {' '.join(arguments)}\n"
            f"{result.stdout}{result.stderr}"
        )
