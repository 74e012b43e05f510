"""Where celery_redlock hooks into the worker: release after every run, clean up after lost
processes.

- ``task_postrun`` fires for every outcome (success, failure, retry, ignore, reject), unlike
  ``Task.after_return``; it releases the run's lock (or keeps it ``lock_hold`` seconds).
- When a prefork child is killed, times out hard or is terminated by ``revoke(terminate=True)``,
  its own code never runs again: `LockAwareRequest`, in the worker's main process, frees the
  lock by the task id stored with it.
- ``worker_ready`` checks the settings and warns about lock nodes that do not answer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from billiard.exceptions import Terminated, WorkerLostError
from celery import signals as celery_signals
from celery.worker.request import Request
from redis.exceptions import RedisError as RedisClientError

from . import signals
from .errors import RedlockError
from .keys import resource_for_call
from .runtime import AppRuntime, HeldLock

logger = logging.getLogger(__name__)

# How the main process learns that the process running a task is gone.
PROCESS_LOST_ERRORS = (WorkerLostError, Terminated, SystemExit, KeyboardInterrupt)

HELD_ATTRIBUTE = "celery_redlock_held"


def _is_singleton(task: Any) -> bool:
    return hasattr(task, "_lock_plan") and hasattr(task, "_signature")


def release_after_run(sender: Any = None, task: Any = None, state: str = "", **_: Any) -> None:
    """Release the lock of the run that just ended, whatever its outcome."""
    task = task or sender
    request = getattr(task, "request", None)
    held: HeldLock | None = getattr(request, HELD_ATTRIBUTE, None)
    if held is None:
        return
    setattr(request, HELD_ATTRIBUTE, None)
    released = False
    try:
        released = held.runtime.release(held, state)
    except RedlockError as error:
        logger.warning("releasing lock %s failed (it expires by itself): %s", held.lock.key, error)
    if held.kept.is_lost:
        logger.error(
            "task %s[%s] finished after losing its lock %s (%s)",
            task.name,
            held.task_id,
            held.lock.key,
            held.kept.lost_reason,
        )
    signals.lock_released.send(
        sender=task,
        task_id=held.task_id,
        key=held.lock.key,
        state=state,
        held=time.monotonic() - held.started,
        released=released,
    )


def _release_for_lost_process(task: Any, task_id: str | None, args: Any, kwargs: Any) -> None:
    if not _is_singleton(task) or task_id is None:
        return
    try:
        runtime = AppRuntime.for_app(task.app)
        plan = task._lock_plan(runtime)
        resource = resource_for_call(
            task.name, task._signature(), args or (), kwargs or {}, plan.lock_args, plan.lock_key
        )
        freed = runtime.redlock.release_if_owner_matches(resource, f'"id":"{task_id}"')
    except (RedlockError, TypeError, ValueError) as error:
        logger.warning("could not free the lock of lost task %s[%s]: %s", task.name, task_id, error)
        return
    if freed:
        logger.info("freed the lock of task %s[%s], whose process was lost", task.name, task_id)


class LockAwareRequest(Request):  # type: ignore[misc]
    """The worker's request object for singleton tasks (``SingletonTask.Request``).

    Runs in the worker's main process. When the process running a singleton task is lost — a
    prefork child killed (SIGKILL, OOM), terminated by ``revoke(terminate=True)``, or stopped at
    its hard time limit — it frees that run's lock by task id *before* Celery requeues or
    reports the task, so a requeued copy (``reject_on_worker_lost``) is not mistaken for a
    redelivered duplicate and nothing waits a full ttl. A custom ``Request`` for a singleton task
    must subclass this one.
    """

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exception = getattr(exc_info, "exception", None)
        exception = getattr(exception, "exc", exception)  # unwrap ExceptionWithTraceback
        if isinstance(exception, PROCESS_LOST_ERRORS):
            _release_for_lost_process(self.task, self.id, self.args, self.kwargs)
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if not soft:
            _release_for_lost_process(self.task, self.id, self.args, self.kwargs)
        return super().on_timeout(soft, timeout)


def check_lock_nodes(sender: Any = None, **_: Any) -> None:
    """At worker start: validate the settings and warn about lock nodes that do not answer."""
    app = getattr(sender, "app", None)
    if app is None or not any(_is_singleton(task) for task in app.tasks.values()):
        return
    runtime = AppRuntime.for_app(app)
    for node in runtime.redlock.nodes:
        client = node.client()
        try:
            client.ping()
        except (RedisClientError, OSError) as error:
            logger.warning(
                "lock node %s does not answer at worker start (%s); singleton tasks work while "
                "a majority of the %d lock nodes answer",
                node.name,
                error,
                len(runtime.redlock.nodes),
            )
        finally:
            client.close()


# The only module-level state of the package: these connections.
celery_signals.task_postrun.connect(
    release_after_run, weak=False, dispatch_uid="celery_redlock.release_after_run"
)
celery_signals.worker_ready.connect(
    check_lock_nodes, weak=False, dispatch_uid="celery_redlock.check_lock_nodes"
)
