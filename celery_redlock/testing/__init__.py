"""Real Redis servers and Celery processes for tests of singleton tasks, and for scripts.

Everything here is a real process on 127.0.0.1, started on free ports and stopped when no longer
needed (and killed at interpreter exit otherwise), so lock code can be tested against the real
thing, failures included. One process manager does the work: `ManagedProcess` (start, stop,
kill, pause and resume, wait, log tail, at-exit clean-up); every server and Celery process here is
a kind of it.

- `RedisServer` (and `ValkeyServer`): one ``redis-server`` (``valkey-server``); optionally with
  a password or ACL users (``acl_lines``). `RedisNodes`: several independent masters, the setup
  Redlock expects; a kind of `ServerGroup`.
- `CeleryWorker`, `CeleryBeat`, `CeleryProcess`: real ``celery`` subprocesses, each in a process
  group of its own; `wait_for_workers`, `celery_processes`, `stop_processes`.

The pytest plugin (`celery_redlock.pytest_plugin`) gives tests these as fixtures. Redis Cluster,
Sentinel and TLS set-ups are in the repository's own tests (``tests/topologies/``), not here.

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
    REDIS_SERVER_ENVIRONMENT_VARIABLE,
    VALKEY_SERVER_ENVIRONMENT_VARIABLE,
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
from .groups import RedisNodes, ServerGroup
from .ports import free_port
from .processes import ManagedProcess, ProcessExitedError, stop_processes
from .redis_servers import RedisServer, ValkeyServer

__all__ = [
    "REDIS_SERVER_ENVIRONMENT_VARIABLE",
    "VALKEY_SERVER_ENVIRONMENT_VARIABLE",
    "CeleryBeat",
    "CeleryProcess",
    "CeleryWorker",
    "ManagedProcess",
    "ProcessExitedError",
    "RedisNodes",
    "RedisServer",
    "ServerGroup",
    "ValkeyServer",
    "WorkerNotReadyError",
    "celery_processes",
    "find_redis_server",
    "find_valkey_server",
    "free_port",
    "stop_processes",
    "wait_for_workers",
]
