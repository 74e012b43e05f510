"""The app that ``celery -A celery_apps.fleet_app worker`` runs in tests/test_fleet.py.

Configured from the environment variables of `celery_apps.subprocesses.app_environment` (read
at import): broker and result back-end (a harness node, never 6379), where the task bodies and
signal handlers record what happens too (`Recorder` streams below); lock nodes; an optional
``visibility_timeout``.

Streams: ``started`` (a body began), ``runs`` (a body ended: ``outcome`` is ``"done"``, or
``"lock-lost"`` when it stopped early because its lock was about to run out), ``deliveries``
(``task_prerun``: a message reached a pool child, before the lock is tried), ``duplicates`` and
``unavailable`` (the library's ``lock_duplicate`` / ``lock_unavailable`` signals).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Task, signals

from celery_apps.subprocesses import Recorder, subprocess_app
from celery_redlock import signals as lock_signals
from celery_redlock import singleton_task

FLEET_TTL = 3.0
"""Lock ttl of ``fleet.work``: short, so expiry-based recovery fits in the test."""

LONG_TTL = 30.0
"""Lock ttl of ``fleet.long_work``: long, so freeing a killed child's lock early is visible."""

STEP_SECONDS = 0.05
LOCK_MARGIN_SECONDS = 0.5
"""A body stops (and retries) when less than this much of its lock's validity is left."""

app = subprocess_app("celery_apps.fleet_app", task_ignore_result=True, redlock_node_timeout=0.3)
recorder = Recorder(app.conf.broker_url)


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


def _fleet_task(name: str, lock_ttl: float, **options: Any) -> Task:
    """A task running `_guarded_body` under a lock on its ``key``; a duplicate retries until
    the lock is free (``on_duplicate="retry"``, no retry limit)."""

    @singleton_task(
        app=app,
        name=name,
        bind=True,
        lock_args=("key",),
        lock_ttl=lock_ttl,
        on_duplicate="retry",
        max_retries=None,
        **options,
    )
    def guarded(self: Task, key: str, submission: str, seconds: float) -> None:
        _guarded_body(self, key, submission, seconds)

    return guarded


# One piece of work on ``key``; ``submission`` tells the test which call this is.
work = _fleet_task("fleet.work", FLEET_TTL)
# The same with a long lock ttl (the run whose pool child the test kills).
long_work = _fleet_task("fleet.long_work", LONG_TTL)


@signals.task_prerun.connect
def _record_delivery(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    if getattr(sender, "app", None) is not app:  # connected in the test process too
        return
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
    if getattr(sender, "app", None) is not app:  # connected in the test process too
        return
    recorder.add("duplicates", task=sender.name, id=task_id, policy=policy, at=time.time())


@lock_signals.lock_unavailable.connect
def _record_unavailable(
    sender: Any = None, task_id: str | None = None, policy: str = "", **_: Any
) -> None:
    if getattr(sender, "app", None) is not app:  # connected in the test process too
        return
    recorder.add("unavailable", task=sender.name, id=task_id, policy=policy, at=time.time())
