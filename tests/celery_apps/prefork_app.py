"""The app real ``celery -A celery_apps.prefork_app worker -P prefork`` subprocesses load.

Configured by environment variables (all harness nodes, never the shared Redis):

- ``CRL_BROKER_URL``: broker and result back-end;
- ``CRL_LOCK_URLS``: comma-separated lock node URLs (``redlock_urls``);
- ``CRL_RECORD_URL``: where runs and lock signals are recorded (a `RunLog`);
- ``CRL_VISIBILITY_TIMEOUT``: optional Redis ``visibility_timeout`` in seconds (restored
  every second, so an ``acks_late`` message is redelivered soon after it).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

from celery_apps.support import LOCK_EVENTS_KEY, RunLog
from celery_redlock import SingletonTask, signals

BROKER_URL = os.environ["CRL_BROKER_URL"]
LOG = RunLog(os.environ.get("CRL_RECORD_URL", BROKER_URL))

app = Celery("prefork_app")
app.conf.update(
    broker_url=BROKER_URL,
    result_backend=BROKER_URL,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    redlock_urls=os.environ["CRL_LOCK_URLS"],
    redlock_node_timeout=0.5,  # a busy CI machine must not look like failing nodes
)
if os.environ.get("CRL_VISIBILITY_TIMEOUT"):
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["CRL_VISIBILITY_TIMEOUT"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }


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


def _record(kind: str, **fields: Any) -> None:
    entry = {"signal": kind, "pid": os.getpid(), "at": time.time()}
    entry.update({name: value for name, value in fields.items() if name != "signal"})
    LOG.client.rpush(LOCK_EVENTS_KEY, json.dumps(entry, default=str))


@signals.lock_duplicate.connect(weak=False)
def _on_duplicate(sender: Any = None, **fields: Any) -> None:
    _record("lock_duplicate", task=getattr(sender, "name", None), **fields)
