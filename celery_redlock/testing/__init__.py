"""Real Redis servers and Celery processes for tests of singleton tasks, and for scripts.

Every one is a `ManagedProcess` on 127.0.0.1 (free ports), stopped when no longer needed and
killed at interpreter exit otherwise. The pytest plugin (`celery_redlock.pytest_plugin`) gives
them to tests as fixtures; docs/testing.md has the guide. Example::

    with RedisNodes(3) as nodes:
        app.conf.redlock_urls = nodes.urls
        nodes[0].pause()  # one node hangs: a quorum of 2 out of 3 remains
"""

from __future__ import annotations

from .celery_subprocesses import (
    CeleryBeat,
    CeleryProcess,
    CeleryWorker,
    WorkerNotReadyError,
    celery_processes,
    wait_for_workers,
)
from .processes import ManagedProcess, ProcessExitedError, stop_processes
from .redis_servers import (
    REDIS_SERVER_ENVIRONMENT_VARIABLE,
    RedisNodes,
    RedisServer,
    ServerGroup,
    find_redis_server,
    free_port,
)

__all__ = [
    "REDIS_SERVER_ENVIRONMENT_VARIABLE",
    "CeleryBeat",
    "CeleryProcess",
    "CeleryWorker",
    "ManagedProcess",
    "ProcessExitedError",
    "RedisNodes",
    "RedisServer",
    "ServerGroup",
    "WorkerNotReadyError",
    "celery_processes",
    "find_redis_server",
    "free_port",
    "stop_processes",
    "wait_for_workers",
]
