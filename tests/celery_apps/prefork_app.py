"""The app real ``celery -A celery_apps.prefork_app worker -P prefork`` subprocesses load.

Configured by the environment `celery_apps.subprocesses.app_environment` gives them (broker,
lock nodes, an optional ``visibility_timeout`` after which an ``acks_late`` message is
redelivered); runs and ``lock_duplicate`` signals are recorded in a `RunLog` on the broker.
"""

from __future__ import annotations

import time
from typing import Any

from celery_apps.subprocesses import subprocess_app
from celery_apps.support import RunLog
from celery_redlock import SingletonTask, signals

# A 0.5 s node timeout: a busy CI machine must not look like failing nodes.
app = subprocess_app("prefork_app", redlock_node_timeout=0.5)
LOG = RunLog(app.conf.broker_url)


@app.task(base=SingletonTask, bind=True, lock_args=("key",), lock_ttl=30)
def sleeper(self: SingletonTask, key: str, seconds: float) -> dict[str, Any]:
    """Hold the lock on ``key`` for ``seconds``, recording the run (child pid included)."""
    with LOG.run(self.lock.key, label=key, task_id=self.request.id) as entry:
        time.sleep(seconds)
    return entry


@app.task(base=SingletonTask, bind=True, lock_args=("key",), lock_ttl=3, acks_late=True)
def late_sleeper(self: SingletonTask, key: str, seconds: float) -> dict[str, Any]:
    """An ``acks_late`` task that outlives ``visibility_timeout`` (its lock auto-extended)."""
    with LOG.run(self.lock.key, label=key, task_id=self.request.id) as entry:
        time.sleep(seconds)
    return entry


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("key",),
    lock_ttl=30,
    acks_late=True,
    reject_on_worker_lost=True,
)
def requeued_sleeper(self: SingletonTask, key: str, seconds: float) -> dict[str, Any]:
    """``acks_late`` + ``reject_on_worker_lost``: a killed child's message is queued again.
    Only the first delivery sleeps ``seconds``; later ones finish at once."""
    first = LOG.client.incr(f"deliveries:{self.request.id}") == 1
    with LOG.run(self.lock.key, label=key, task_id=self.request.id) as entry:
        time.sleep(seconds if first else 0.05)
    return entry


@signals.lock_duplicate.connect(weak=False)
def _on_duplicate(sender: Any = None, **fields: Any) -> None:
    if getattr(sender, "app", None) is not app:  # connected in the test process too
        return
    LOG.record_signal("lock_duplicate", task=getattr(sender, "name", None), **fields)
