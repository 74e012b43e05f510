"""The app real ``celery -A celery_apps.guarantee_app worker`` subprocesses load in
tests/test_guarantees_prefork.py: tasks for the paths that cross processes (hard time limits,
soft time limits during acquisition, killed hosts, broker redelivery, unusual task ids, a
``lock_key`` the worker's main process cannot compute).

Configured by the environment `celery_apps.subprocesses.app_environment` gives it; runs are
recorded in a `RunLog` on the broker, heartbeats and signals in its streams.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from celery_apps.subprocesses import subprocess_app
from celery_apps.support import RunLog
from celery_redlock import SingletonTask, signals

# A 0.5 s node timeout: a busy CI machine must not look like failing nodes.
app = subprocess_app("guarantee_app", redlock_node_timeout=0.5)
LOG = RunLog(app.conf.broker_url)
IMPORTED_IN = os.getpid()  # the worker's main process (pool children are forked from it)

HEARTBEATS = "heartbeats"


@app.task(base=SingletonTask, bind=True, lock_args=("key",), lock_ttl=30, on_duplicate="wait")
def stubborn(self: SingletonTask, key: str, beat: bool = True) -> dict[str, Any]:
    """With ``beat``: ignore SIGTERM and record a heartbeat every 5 ms until killed (what a task
    with its own SIGTERM handler does at a hard time limit). Without: record one run."""
    if beat:
        signal.signal(signal.SIGTERM, lambda number, frame: None)
    with LOG.run(self.lock.key, label=key, task_id=self.request.id) as entry:
        while beat:
            LOG.add(HEARTBEATS, task_id=self.request.id, at=time.time())
            time.sleep(0.005)
    return entry


@app.task(base=SingletonTask, bind=True, lock_args=("key",), lock_ttl=30)
def quick(self: SingletonTask, key: str) -> str:
    """Record a run and return its lock key (for acquisitions a soft time limit interrupts)."""
    with LOG.run(self.lock.key, label=key, task_id=self.request.id):
        return str(self.lock.key)


@app.task(base=SingletonTask, bind=True, lock_args=("key",), lock_ttl=3)
def brief(self: SingletonTask, key: str) -> str:
    """Record a run. Its short ``lock_ttl`` brings a copy deferred while it ran back in seconds."""
    with LOG.run(self.lock.key, label=key, task_id=self.request.id):
        return str(self.lock.key)


@app.task(base=SingletonTask, bind=True, lock_args=("key",), lock_ttl=6, acks_late=True)
def late(self: SingletonTask, key: str, seconds: float) -> dict[str, Any]:
    """An ``acks_late`` run; only the first delivery of a task id sleeps ``seconds``."""
    first = LOG.client.incr(f"deliveries:{self.request.id}") == 1
    with LOG.run(self.lock.key, label=key, task_id=self.request.id) as entry:
        entry["worker"] = self.request.hostname
        time.sleep(seconds if first else 0.05)
    return entry


@app.task(base=SingletonTask, bind=True, lock_args=("key",), lock_ttl=30)
def sleeper(self: SingletonTask, key: str, seconds: float) -> dict[str, Any]:
    """Hold the lock on ``key`` for ``seconds``."""
    with LOG.run(self.lock.key, label=key, task_id=self.request.id) as entry:
        time.sleep(seconds)
    return entry


@app.task(base=SingletonTask, bind=True, lock_args=("key",), lock_ttl=2, on_duplicate="coalesce")
def coalescing(self: SingletonTask, key: str, until: str | None = None) -> dict[str, Any]:
    """Coalesce on ``key``; with ``until``, hold the lock until that Redis key exists."""
    with LOG.run(self.lock.key, label=key, task_id=self.request.id) as entry:
        entry["worker"] = self.request.hostname
        while until and not LOG.client.exists(until):
            time.sleep(0.01)
    return entry


def _key_outside_the_pool(key: str, seconds: float) -> str:
    if os.getpid() == IMPORTED_IN:
        raise KeyError("this lock_key cannot be computed in the worker's main process")
    return f"stubborn-key:{key}"


@app.task(base=SingletonTask, bind=True, lock_key=_key_outside_the_pool, lock_ttl=30)
def odd_key(self: SingletonTask, key: str, seconds: float) -> None:
    """A task whose lock_key callable raises in the worker's main process."""
    with LOG.run(self.lock.key, label=key, task_id=self.request.id):
        time.sleep(seconds)


@signals.lock_duplicate.connect(weak=False)
def _on_duplicate(sender: Any = None, **fields: Any) -> None:
    if getattr(sender, "app", None) is not app:  # connected in the test process too
        return
    LOG.record_signal("lock_duplicate", task=getattr(sender, "name", None), **fields)
