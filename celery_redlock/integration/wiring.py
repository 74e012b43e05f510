"""The signal handlers through which celery_redlock hooks into Celery besides the task's own
``__call__`` (each handler says what it does), connected by `connect` when the package is imported:
its only module-level state. Lost pool processes are handled by the request class
(`process_loss.LockAwareRequest`, importable from here too, as in 0.2).
"""

from __future__ import annotations

from typing import Any

from celery import signals as celery_signals

from ..admin.reap import start_reaper_thread
from ..admin.startup import report_lock_nodes
from .events import remember_worker
from .messages import name_message
from .process_loss import LockAwareRequest
from .run import release_leftovers

__all__ = ["LockAwareRequest", "connect", "release_leftovers", "start_reaper"]


def start_reaper(sender: Any = None, **_: Any) -> None:
    """``worker_init`` handler: start the reaper timer of the worker's app, if it has one."""
    app = getattr(sender, "app", None)
    if app is not None:
        start_reaper_thread(app, sender)


def connect() -> None:
    """Connect the handlers (once: Celery's dispatch uids make it idempotent)."""
    for signal, handler in (
        (celery_signals.before_task_publish, name_message),
        (celery_signals.task_postrun, release_leftovers),
        (celery_signals.worker_init, remember_worker),
        (celery_signals.worker_init, start_reaper),
        (celery_signals.worker_ready, report_lock_nodes),
    ):
        signal.connect(handler, weak=False, dispatch_uid=f"celery_redlock.{handler.__name__}")
