"""`TopologyServer`: a `RedisServer` that can also serve TLS only, run as a Redis Cluster node or
start as a replica, the kinds of node the topology, TLS and replication tests need; and
`TopologyGroup`, a `ServerGroup` that runs more processes than its servers and settles."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from celery_redlock.testing import RedisServer, ServerGroup, stop_processes
from celery_redlock.testing.redis_servers import HOST

from .tls import TLSCertificates

__all__ = ["CLUSTER_BUS_PORT_OFFSET", "TopologyGroup", "TopologyServer", "free_port", "role"]

CLUSTER_BUS_PORT_OFFSET = 10000
"""A cluster node listens for the other nodes on its port plus this."""

_HIGHEST_PORT = 65535
_ATTEMPTS = 50

_GroupT = TypeVar("_GroupT", bound="TopologyGroup")


def free_port(*, also_free_at_offset: int | None = None) -> int:
    """Return a TCP port of 127.0.0.1 that was free a moment ago; with ``also_free_at_offset``,
    the port that many above was free too (a Redis Cluster node listens on its port plus 10000
    for the cluster bus).

    Raises:
        RuntimeError: no such pair of ports was found in a few dozen tries.
    """
    for _ in range(_ATTEMPTS):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((HOST, 0))
            port: int = probe.getsockname()[1]
            if also_free_at_offset is None:
                return port
            other = port + also_free_at_offset
            if other > _HIGHEST_PORT:
                continue
            with (
                contextlib.suppress(OSError),
                socket.socket(socket.AF_INET, socket.SOCK_STREAM) as second,
            ):
                second.bind((HOST, other))
                return port
    raise RuntimeError(f"found no free port of {HOST} with port+{also_free_at_offset} free too")


def role(server: RedisServer) -> str:
    """What ``ROLE`` says ``server`` is: ``master``, ``slave`` or ``sentinel``."""
    with server.client(socket_timeout=5) as client:
        answer = client.execute_command("ROLE")[0]
    return answer.decode() if isinstance(answer, bytes) else str(answer)


class TopologyServer(RedisServer):
    """A `RedisServer` with the options of the repository's topology tests; its own options go
    before ``extra_args``, which still come last and can override them.

    Args:
        port: as for `RedisServer`.
        tls: certificates (`TLSCertificates`) to serve TLS only: ``--tls-port`` on
            :attr:`port` and ``--port 0``; :attr:`url` is then a ``rediss://`` URL.
        tls_auth_clients: with ``tls``, whether clients must present a certificate signed by
            the authority (``--tls-auth-clients yes|no``); ``None``: the server's default (yes).
        cluster_enabled: run as a Redis Cluster node (``--cluster-enabled yes``), on a port
            whose cluster bus port (plus 10000) is free too. `RedisCluster` joins such nodes.
        replica_of: start as a replica of that (started) server (``--replicaof``, with
            ``--masterauth`` its password), at every start.
        extra_args: more ``redis-server`` arguments, last.
        **options: the other `RedisServer` options.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        tls: TLSCertificates | None = None,
        tls_auth_clients: bool | None = None,
        cluster_enabled: bool = False,
        replica_of: RedisServer | None = None,
        extra_args: Sequence[str] = (),
        **options: Any,
    ) -> None:
        if isinstance(extra_args, str):
            raise TypeError("extra_args must be a sequence, not one string")
        super().__init__(port, **options)
        self._tls = tls
        self._tls_auth_clients = tls_auth_clients
        self._cluster_enabled = cluster_enabled
        self._replica_of = replica_of
        self._last_arguments = tuple(extra_args)

    @property
    def tls(self) -> TLSCertificates | None:
        """The certificates of a TLS server, ``None`` for a plain one."""
        return self._tls

    @property
    def url(self) -> str:
        """As `RedisServer`'s; for a TLS server the ``rediss://`` URL of :meth:`tls_url`."""
        if self._tls is not None:
            return self.tls_url()
        return super().url

    def user_url(self, username: str | None, password: str | None) -> str:
        """As `RedisServer`'s; ``rediss://`` with the certificate options for a TLS server."""
        url = super().user_url(username, password)
        if self._tls is None:
            return url
        return f"rediss://{url.removeprefix('redis://')}?{self._tls.url_options()}"

    def tls_url(self, *, ca_certificate: Path | None = None, client: bool = True) -> str:
        """The ``rediss://`` URL of a TLS server: ``ssl_ca_certs`` the authority (or
        ``ca_certificate``, say `TLSCertificates.unrelated_ca_certificate`) and, with
        ``client``, ``ssl_certfile`` and ``ssl_keyfile`` the client certificate.

        Raises:
            RuntimeError: the server does not serve TLS.
        """
        if self._tls is None:
            raise RuntimeError(f"{self!r} serves no TLS: give it tls=TLSCertificates.create()")
        url = super().user_url(None, self.password).removeprefix("redis://")
        options = self._tls.url_options(ca_certificate=ca_certificate, client=client)
        return f"rediss://{url}?{options}"

    def connection_options(self) -> dict[str, Any]:
        """As `RedisServer`'s; to a TLS server, TLS with the harness certificates."""
        options = super().connection_options()
        if self._tls is not None:
            options.update(self._tls.client_options())
        return options

    def pick_port(self) -> int:
        """A free port; for a cluster node one whose cluster bus port is free too."""
        if self._cluster_enabled:
            return free_port(also_free_at_offset=CLUSTER_BUS_PORT_OFFSET)
        return super().pick_port()

    def server_arguments(self, port: int, directory: Path) -> list[str]:
        """`RedisServer`'s, then the TLS, cluster and replica options, then ``extra_args``."""
        arguments = super().server_arguments(port, directory)
        if self._tls is not None:
            arguments += ["--port", "0", "--tls-port", str(port)]
            arguments += ["--tls-cert-file", str(self._tls.server_certificate)]
            arguments += ["--tls-key-file", str(self._tls.server_key)]
            arguments += ["--tls-ca-cert-file", str(self._tls.ca_certificate)]
            # What the server presents when it connects out (as a replica, a cluster node).
            arguments += ["--tls-client-cert-file", str(self._tls.client_certificate)]
            arguments += ["--tls-client-key-file", str(self._tls.client_key)]
            if self._tls_auth_clients is not None:
                arguments += ["--tls-auth-clients", "yes" if self._tls_auth_clients else "no"]
        if self._cluster_enabled:
            arguments += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        master = self._replica_of
        if master is not None:
            arguments += ["--replicaof", HOST, str(master.port)]
            if master.password is not None:
                arguments += ["--masterauth", master.password]
            if isinstance(master, TopologyServer) and master.tls is not None:
                arguments += ["--tls-replication", "yes"]
        return [*arguments, *self._last_arguments]


class TopologyGroup(ServerGroup):
    """A `ServerGroup` whose :meth:`start` starts every one of its :attr:`processes` (its
    servers, and for some kinds more: sentinels), then :meth:`settle`; :meth:`stop_all` stops
    them all."""

    @property
    def processes(self) -> tuple[RedisServer, ...]:
        """Every process of the group, in start order (kinds of group add sentinels, say)."""
        return self.servers

    def start(self: _GroupT) -> _GroupT:
        """Start every process not running, then :meth:`settle`; return ``self``. On failure
        every process is stopped before the error propagates."""
        try:
            for process in self.processes:
                if not process.is_running:
                    process.start()
            self.settle()
        except BaseException:
            with contextlib.suppress(BaseException):
                self.stop_all()
            raise
        return self

    def settle(self) -> None:
        """What :meth:`start` does once every process runs (a cluster joins its nodes)."""

    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop every process, paused ones included (`stop_processes`: SIGTERM, then SIGKILL
        for what is left after ``timeout`` seconds in all)."""
        stop_processes(self.processes, timeout)
