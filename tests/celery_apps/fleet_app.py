"""The app that ``celery -A celery_apps.fleet_app worker`` runs in tests/test_fleet.py.

Configured from environment variables (read at import):

- ``CRL_FLEET_BROKER_URL``: broker and result back-end (a harness node, never 6379); the task
  bodies and signal handlers record what happens there too (`Recorder` streams below);
- ``CRL_FLEET_REDLOCK_URLS``: comma-separated lock nodes;
- ``CRL_FLEET_VISIBILITY_TIMEOUT``: when set, the Redis transport's ``visibility_timeout`` in
  seconds, with the unacked-message sweep (``restore_visible``) run every second so a message
  past it is redelivered promptly.

Streams: ``started`` (a body began), ``runs`` (a body ended: ``outcome`` is ``"done"``, or
``"lock-lost"`` when it stopped early because its lock was about to run out), ``deliveries``
(``task_prerun``: a message reached a pool child, before the lock is tried), ``duplicates`` and
``unavailable`` (the library's ``lock_duplicate`` / ``lock_unavailable`` signals).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, Task, signals

from celery_apps.subprocesses import Recorder
from celery_redlock import signals as lock_signals
from celery_redlock import singleton_task

FLEET_TTL = 3.0
"""Lock ttl of ``fleet.work``: short, so expiry-based recovery fits in the test."""

LONG_TTL = 30.0
"""Lock ttl of ``fleet.long_work``: long, so freeing a killed child's lock early is visible."""

STEP_SECONDS = 0.05
LOCK_MARGIN_SECONDS = 0.5
"""A body stops (and retries) when less than this much of its lock's validity is left."""

BROKER_URL = os.environ.get("CRL_FLEET_BROKER_URL", "redis://127.0.0.1:1/0")

app = Celery("celery_apps.fleet_app")
app.conf.update(
    broker_url=BROKER_URL,
    result_backend=BROKER_URL,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    redlock_urls=[
        url for url in os.environ.get("CRL_FLEET_REDLOCK_URLS", BROKER_URL).split(",") if url
    ],
    redlock_node_timeout=0.3,
)
if os.environ.get("CRL_FLEET_VISIBILITY_TIMEOUT"):
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["CRL_FLEET_VISIBILITY_TIMEOUT"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }

recorder = Recorder(BROKER_URL)


def _guarded_body(task: Task, key: str, submission: str, seconds: float) -> None:
    """Work for ``seconds`` in short steps, recording the run; stop early (and retry) when the
    lock is about to run out, as a task should when its lock can no longer be extended."""
    request = task.request
    lock = task.lock
    entry: dict[str, Any] = {
        "task": task.name,
        "key": key,
        "submission": submission,
        "id": request.id,
        "retries": request.retries,
        "pid": os.getpid(),
        "host": request.hostname,
        "lock": lock.key if lock is not None else None,
        "start": time.time(),
    }
    recorder.add("started", **entry)
    outcome = "done"
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if lock is None or lock.remaining() < LOCK_MARGIN_SECONDS:
            outcome = "lock-lost"
            break
        time.sleep(min(STEP_SECONDS, left))
    entry.update(
        end=time.time(),
        outcome=outcome,
        remaining=round(lock.remaining(), 3) if lock is not None else None,
    )
    recorder.add("runs", **entry)
    if outcome == "lock-lost":
        raise task.retry(countdown=0.5)


@singleton_task(
    app=app,
    name="fleet.work",
    bind=True,
    lock_args=("key",),
    lock_ttl=FLEET_TTL,
    on_duplicate="retry",
    max_retries=None,
)
def work(self: Task, key: str, submission: str, seconds: float) -> None:
    """One piece of work on ``key``; ``submission`` tells the test which call this is."""
    _guarded_body(self, key, submission, seconds)


@singleton_task(
    app=app,
    name="fleet.long_work",
    bind=True,
    lock_args=("key",),
    lock_ttl=LONG_TTL,
    on_duplicate="retry",
    max_retries=None,
)
def long_work(self: Task, key: str, submission: str, seconds: float) -> None:
    """The same with a long lock ttl (the run whose pool child the test kills)."""
    _guarded_body(self, key, submission, seconds)


@singleton_task(
    app=app,
    name="fleet.slow_acks_late",
    bind=True,
    lock_args=("key",),
    lock_ttl=10,
    acks_late=True,
    on_duplicate="retry",
    max_retries=None,
)
def slow_acks_late(self: Task, key: str, submission: str, seconds: float) -> None:
    """A long ``acks_late`` task: outlives the broker's visibility_timeout."""
    _guarded_body(self, key, submission, seconds)


@signals.task_prerun.connect
def _record_delivery(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    request = sender.request
    delivery_info = getattr(request, "delivery_info", None) or {}
    recorder.add(
        "deliveries",
        task=sender.name,
        id=task_id,
        retries=request.retries,
        pid=os.getpid(),
        redelivered=bool(delivery_info.get("redelivered")),
        at=time.time(),
    )


@lock_signals.lock_duplicate.connect
def _record_duplicate(
    sender: Any = None, task_id: str | None = None, policy: str = "", **_: Any
) -> None:
    recorder.add("duplicates", task=sender.name, id=task_id, policy=policy, at=time.time())


@lock_signals.lock_unavailable.connect
def _record_unavailable(
    sender: Any = None, task_id: str | None = None, policy: str = "", **_: Any
) -> None:
    recorder.add("unavailable", task=sender.name, id=task_id, policy=policy, at=time.time())


@singleton_task(
    app=app,
    name="fleet.requeued_when_lost",
    bind=True,
    lock_args=("key",),
    lock_ttl=10,
    acks_late=True,
    reject_on_worker_lost=True,
    on_duplicate="retry",
    max_retries=None,
)
def requeued_when_lost(self: Task, key: str, submission: str, seconds: float) -> None:
    """``acks_late`` + ``reject_on_worker_lost``: requeued when its pool child is killed."""
    _guarded_body(self, key, submission, seconds)
