"""The app real ``celery -A celery_apps.coalesce_app worker -P prefork`` subprocesses load in
tests/test_coalesce.py: a coalescing task whose run the test holds open, so that it can pause
(SIGSTOP) the pool process of the pending run and see who gets the lock next.

Configured by the environment `celery_apps.subprocesses.app_environment` gives it (broker and
result back-end, lock nodes); runs are recorded in a `RunLog` on the broker, with the pool
process's id.
"""

from __future__ import annotations

import time
from typing import Any

from celery_apps.subprocesses import subprocess_app
from celery_apps.support import RunLog
from celery_redlock import SingletonTask, signals

# A 0.5 s node timeout: a busy CI machine must not look like failing nodes.
app = subprocess_app("coalesce_app", redlock_node_timeout=0.5)
LOG = RunLog(app.conf.broker_url)

REFRESH_TTL = 5.0
"""Lock ttl of ``refresh``, and so of its pending run's reservation: the reservation is extended
every third of it, so a pending run's process may stay paused at least two thirds of it
(over 3 s) before its reservation lapses. Short, so the copy a pending run publishes of itself
(due a ttl and a second later) comes back within the test."""


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("key",),
    lock_ttl=REFRESH_TTL,
    on_duplicate="coalesce",
)
def refresh(self: SingletonTask, key: str, gate: str | None = None) -> dict[str, Any]:
    """Coalesce on ``key``; with ``gate``, hold the lock until that Redis key exists."""
    with LOG.run(self.lock.key, label=key, task_id=self.request.id) as entry:
        while gate and not LOG.client.exists(gate):
            time.sleep(0.01)
    return entry


@signals.lock_duplicate.connect(weak=False)
def _on_duplicate(sender: Any = None, **fields: Any) -> None:
    if getattr(sender, "app", None) is not app:  # connected in the test process too
        return
    LOG.record_signal("lock_duplicate", task=getattr(sender, "name", None), **fields)
