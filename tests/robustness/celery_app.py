"""The Celery workload's app (``--mode celery``): singleton tasks, one per duplicate policy, whose
bodies record when they ran, and signal handlers that record locks taken and released, skips and
lost locks, each worker process (pool children included) and thread to a history file of its own
under ``$ROBUSTNESS_HISTORY``. The runner gives the workers their broker and lock nodes as settings.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_redlock import singleton_task
from celery_redlock.signals import lock_acquired, lock_duplicate, lock_lost, lock_released

from . import checker
from .history import HistoryFile, Record

app = Celery("robustness")
app.conf.update(
    task_default_queue="robustness",
    worker_prefetch_multiplier=1,
    # A copy of an acks_late task whose worker died comes back within seconds, not an hour.
    broker_transport_options={"visibility_timeout": 20},
    worker_hijack_root_logger=False,
)

LOCK_TTL = checker.LOCK_TTL
"""Seconds: short, so that a lock a killed worker left behind expires during the run."""


class Histories:
    """A history file per process and thread, opened on first use (after a fork too)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def add(self, record: Record) -> None:
        directory = os.environ.get("ROBUSTNESS_HISTORY")
        if not directory:
            return
        history: HistoryFile | None = getattr(self.local, "history", None)
        if history is None or getattr(self.local, "pid", None) != os.getpid():
            name = f"worker-{os.getpid()}-{threading.get_ident()}.jsonl"
            history = HistoryFile(Path(directory) / name)
            self.local.history, self.local.pid = history, os.getpid()
        history.add(record)


histories = Histories()


def body(policy: str, key: str, task_id: str, hold: float) -> None:
    """A run of a task: recorded with its start and end."""
    record: Record = {"op": "task", "event": "ran", "owner": f"pid {os.getpid()}"}
    record.update(key=f"{policy}:{key}", task_id=task_id, start=time.monotonic())
    time.sleep(hold)
    record["end"] = time.monotonic()
    histories.add(record)


@singleton_task(app=app, name="robustness.skip", bind=True, lock_args=("key",), lock_ttl=LOCK_TTL)
def skip(self: Any, key: str, hold: float) -> None:
    body("skip", key, self.request.id, hold)


@singleton_task(
    app=app,
    name="robustness.retry",
    bind=True,
    lock_args=("key",),
    lock_ttl=LOCK_TTL,
    on_duplicate="retry",
    acks_late=True,
    max_retries=None,
)
def retry(self: Any, key: str, hold: float) -> None:
    body("retry", key, self.request.id, hold)


@singleton_task(
    app=app,
    name="robustness.wait",
    bind=True,
    lock_args=("key",),
    lock_ttl=LOCK_TTL,
    on_duplicate="wait",
    lock_wait=30,
    acks_late=True,
)
def wait(self: Any, key: str, hold: float) -> None:
    body("wait", key, self.request.id, hold)


POLICIES = {"skip": skip, "retry": retry, "wait": wait}


@lock_duplicate.connect
def record_skip(sender: Any, task_id: str, policy: str, holder: Any = None, **_: Any) -> None:
    if policy == "skip":
        now = time.monotonic()
        record: Record = {"op": "task", "event": "skipped", "owner": f"pid {os.getpid()}"}
        record.update(key=f"skip:{sender.request.args[0]}", task_id=task_id, start=now, end=now)
        # The run a majority of nodes named: it may still be acquiring (its round not returned).
        record["holder"] = holder.get("id") if isinstance(holder, dict) else None
        histories.add(record)


@lock_acquired.connect
def record_acquired(sender: Any, task_id: str, **_: Any) -> None:
    record_event("acquired", task_id)


@lock_released.connect
def record_released(sender: Any, task_id: str, released: bool, **_: Any) -> None:
    # Unconfirmed by a majority (a node paused, a connection cut): the lock may stay on the
    # nodes until it expires, and a later run is refused as a duplicate meanwhile.
    record_event("released" if released else "released-unconfirmed", task_id)


@lock_lost.connect
def record_lost(sender: Any, task_id: str, **_: Any) -> None:
    record_event("lost", task_id)


def record_event(event: str, task_id: str) -> None:
    now = time.monotonic()
    record: Record = {"op": "task", "event": event, "owner": f"pid {os.getpid()}"}
    record.update(key="-", task_id=task_id, start=now, end=now)
    histories.add(record)
