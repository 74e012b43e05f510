"""TLS for the nodes layer: one `ssl.SSLContext` per TLS configuration, built once per process
(`TLSContext`) and used by every connection made with that configuration (`TLSConnection`).

redis-py builds a new context for every TLS connection, and ``ssl.create_default_context()``
loads the system's certificate authorities: 50-60 ms of CPU each time, three times over for a
first call to three members. Here the members of one `Redlock` that share their ``ssl_*``
options share one context (`TLSContexts`), and the servers a cluster or the sentinels point to
take their member's.

A context is used, never changed, once built, and any number of threads may connect with it at
once. A forked child builds its own on first use and never frees the parent's: OpenSSL's locks
inside a context (its certificate store's, its session cache's) that a thread of the parent held
at the fork would stay held in the child. OpenSSL's process-wide locks are another matter, for
any TLS client: a fork while another thread is inside a handshake (verifying a certificate
takes the lock of OpenSSL's store loaders) can leave the child stuck in its first handshake or
context build, whichever context it uses.
"""

from __future__ import annotations

import os
import socket
import ssl
from typing import Any

from redis.connection import SSLConnection

from .forks import ProcessLock


class TLSContext:
    """The `ssl.SSLContext` of one TLS configuration, built on first use in each process."""

    def __init__(self) -> None:
        self._built: tuple[int, ssl.SSLContext] | None = None  # (the process, its context)
        self._guard = ProcessLock()
        self._inherited: list[ssl.SSLContext] = []  # a parent's: kept, never freed in a child

    def of(self, connection: SSLConnection) -> ssl.SSLContext:
        """The context for ``connection`` (any connection of this configuration), built by the
        first caller in this process while the others wait for it."""
        pid = os.getpid()
        built = self._built
        if built is not None and built[0] == pid:
            return built[1]
        with self._guard.held():
            built = self._built
            if built is not None and built[0] == pid:
                return built[1]
            context = self.build(connection)
            if built is not None:
                self._inherited.append(built[1])
            self._built = (pid, context)
            return context

    @staticmethod
    def build(connection: SSLConnection) -> ssl.SSLContext:
        """A new context made from ``connection``'s TLS options as redis-py (5.0 to 8.1) makes
        one: the system's authorities, then the options' own. tests/test_redis_py_contract.py
        fails when redis-py takes a TLS option this does not know."""
        options: Any = connection
        context = ssl.create_default_context()
        context.check_hostname = options.check_hostname
        context.verify_mode = options.cert_reqs
        for flag in getattr(options, "ssl_include_verify_flags", None) or ():
            context.verify_flags |= flag
        for flag in getattr(options, "ssl_exclude_verify_flags", None) or ():
            context.verify_flags &= ~flag
        if options.certfile or options.keyfile:
            context.load_cert_chain(
                certfile=options.certfile,
                keyfile=options.keyfile,
                password=options.certificate_password,
            )
        if (
            options.ca_certs is not None
            or options.ca_path is not None
            or options.ca_data is not None
        ):
            context.load_verify_locations(
                cafile=options.ca_certs, capath=options.ca_path, cadata=options.ca_data
            )
        if getattr(options, "ssl_min_version", None) is not None:
            context.minimum_version = options.ssl_min_version
        if getattr(options, "ssl_ciphers", None):
            context.set_ciphers(options.ssl_ciphers)
        return context


class TLSContexts:
    """The contexts of one set of members, one per TLS configuration (their ``ssl_*`` options)."""

    def __init__(self) -> None:
        self._by_options: dict[str, TLSContext] = {}

    def for_options(self, options: dict[str, Any]) -> TLSContext:
        """The context of the connections made with ``options`` (redis-py connection keywords)."""
        tls = sorted(
            (name, repr(value)) for name, value in options.items() if name.startswith("ssl_")
        )
        return self._by_options.setdefault(repr(tls), TLSContext())


class TLSConnection(SSLConnection):
    """redis-py's TLS connection, with the context of its configuration (``tls_context``)
    instead of a new one per connection. With OCSP checks (``ssl_validate_ocsp``,
    ``ssl_validate_ocsp_stapled``) redis-py makes the connection itself."""

    def __init__(self, tls_context: TLSContext, **options: Any) -> None:
        """``options``: redis-py's ``SSLConnection`` keywords."""
        super().__init__(**options)
        self.tls_context = tls_context

    def _connect(self) -> socket.socket:
        # redis-py's connections are not annotated: its methods are reached through Any.
        if getattr(self, "ssl_validate_ocsp", False) or getattr(
            self, "ssl_validate_ocsp_stapled", False
        ):
            with_ocsp: Any = super()
            sock: socket.socket = with_ocsp._connect()
            return sock
        plain: Any = super(SSLConnection, self)
        sock = plain._connect()  # the TCP connection, without TLS
        try:
            return self.tls_context.of(self).wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            # A handshake that failed, or was interrupted (a signal handler raising): the plain
            # socket is closed (the TLS one, if made, is closed by `Endpoint.open_socket`).
            sock.close()
            raise
