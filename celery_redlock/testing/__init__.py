"""Real Redis servers, Redis topologies and Celery processes for tests, benchmarks and examples.

Everything here is a real process on 127.0.0.1, started on free ports and stopped when no longer
needed (and killed at interpreter exit otherwise), so lock code can be tested against the real
thing, failures included. One process manager does the work: `ManagedProcess` (start, stop,
kill, pause and resume, wait, log tail, at-exit clean-up); every server and Celery process here is
a kind of it.

- `RedisServer` (and `ValkeyServer`): one ``redis-server`` (``valkey-server``); optionally with
  a password, ACL users (``acl_lines``), TLS only (``tls=`` `TLSCertificates`) or as a replica.
  `RedisNodes`: several independent masters, the setup Redlock expects.
- `RedisCluster`: a Redis Cluster (``--cluster-enabled yes`` joined by ``redis-cli --cluster
  create``), with failovers and step-by-step slot migrations (`SlotMigration`).
- `SentinelGroup`: a master, replicas and three sentinels (`SentinelServer`), with failovers.
- `TLSCertificates`: a throw-away authority, server and client certificates, and an unrelated
  authority, made with ``openssl``.
- `CeleryWorker`, `CeleryBeat`, `CeleryProcess`: real ``celery`` subprocesses, each in a process
  group of its own; `wait_for_workers`, `celery_processes`, `stop_processes`.

Example::

    from celery_redlock.testing import RedisNodes

    with RedisNodes(3) as nodes:
        app.conf.redlock_urls = nodes.urls
        nodes[0].pause()      # one node hangs: a quorum of 2 out of 3 remains
        ...

Servers share the caller's process group, so Ctrl-C in a terminal stops them too; Celery
processes each have a group of their own, which a Ctrl-C does not reach (the caller decides how
they end). A caller killed with SIGKILL can still leave processes behind: prefer context managers
or fixtures, which stop them as soon as they are no longer needed.
"""

from __future__ import annotations

from .binaries import (
    REDIS_CLI_ENVIRONMENT_VARIABLE,
    REDIS_SERVER_ENVIRONMENT_VARIABLE,
    VALKEY_SERVER_ENVIRONMENT_VARIABLE,
    find_redis_cli,
    find_redis_server,
    find_valkey_server,
)
from .celery_subprocesses import (
    CeleryBeat,
    CeleryProcess,
    CeleryWorker,
    WorkerNotReadyError,
    celery_processes,
    wait_for_workers,
)
from .cluster import RedisCluster
from .groups import RedisNodes, ServerGroup
from .ports import free_port
from .processes import ManagedProcess, ProcessExitedError, stop_processes
from .redis_servers import RedisServer, ValkeyServer
from .sentinel import SentinelGroup, SentinelServer
from .slot_migration import SlotMigration
from .tls import TLSCertificates

__all__ = [
    "REDIS_CLI_ENVIRONMENT_VARIABLE",
    "REDIS_SERVER_ENVIRONMENT_VARIABLE",
    "VALKEY_SERVER_ENVIRONMENT_VARIABLE",
    "CeleryBeat",
    "CeleryProcess",
    "CeleryWorker",
    "ManagedProcess",
    "ProcessExitedError",
    "RedisCluster",
    "RedisNodes",
    "RedisServer",
    "SentinelGroup",
    "SentinelServer",
    "ServerGroup",
    "SlotMigration",
    "TLSCertificates",
    "ValkeyServer",
    "WorkerNotReadyError",
    "celery_processes",
    "find_redis_cli",
    "find_redis_server",
    "find_valkey_server",
    "free_port",
    "stop_processes",
    "wait_for_workers",
]
