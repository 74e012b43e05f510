"""When the pool process running a singleton task is lost — killed (SIGKILL, OOM), terminated by
``revoke(terminate=True)``, or stopped at its hard time limit — its own code never runs again:
the worker's main process frees that process's lock, by owner, once the process is gone and
never before (`LockAwareRequest`)."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from typing import Any

from billiard.exceptions import Terminated, WorkerLostError
from celery.worker.request import Request

from ..lock.owner import run_prefix
from ..lock.redlock import release_if_owner
from .messages import RECEIVED_FIELD

logger = logging.getLogger(__name__)


def free_lost_run(task: Any, task_id: str | None, args: Any, kwargs: Any, pid: int | None) -> None:
    """Free the lock a run of ``task_id`` held in process ``pid`` of this host, which is gone:
    matched by task id, process and host, never a later attempt's running elsewhere."""
    if task_id is None or pid is None:
        return
    try:
        plan = task.lock_plan
        resource = plan.recipe.resource(args or (), kwargs or {})
        freed = release_if_owner(
            plan.runtime.redlock, resource, run_prefix(task_id, pid, socket.gethostname())
        )
    except Exception as error:  # a lock_key callable can raise anything; Celery must go on
        logger.warning("could not free the lock of lost task %s[%s]: %s", task.name, task_id, error)
        return
    if freed:
        logger.info("freed the lock of task %s[%s], whose process was lost", task.name, task_id)


def wait_until_gone(pid: int, timeout: float) -> bool:
    try:
        descriptor = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):  # no pidfd (not Linux, old kernel): look every 10 ms
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.01)
        return False
    try:
        poller = select.poll()
        poller.register(descriptor, select.POLLIN)
        return bool(poller.poll(timeout * 1000))  # readable once the process has exited
    finally:
        os.close(descriptor)


class LockAwareRequest(Request):  # type: ignore[misc]
    """The worker's request object for singleton tasks (``SingletonTask.Request``), in the worker's
    main process. When the process running a singleton task is lost, it frees that process's lock
    *before* Celery requeues or reports the task (so a requeued copy with ``reject_on_worker_lost``
    runs at once) — and, at a hard time limit, only after the pool has killed the process (Celery
    calls ``on_timeout`` before it kills it). It also notes when the message was received, which
    tells a run whether a copy may still come. A custom ``Request`` for a singleton task must
    subclass this one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The pool hands request_dict to the task's request (`messages.copy_may_come` reads it).
        self.request_dict[RECEIVED_FIELD] = time.time()

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exception = getattr(exc_info, "exception", None)
        exception = getattr(exception, "exc", exception)  # unwrap ExceptionWithTraceback
        if isinstance(exception, (WorkerLostError, Terminated)):  # the process exited
            free_lost_run(self.task, self.id, self.args, self.kwargs, self.worker_pid)
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if not soft and self.worker_pid is not None:
            task, task_id, pid = self.task, self.id, self.worker_pid
            args, kwargs = self.args, self.kwargs

            def free_once_gone() -> None:
                # Past the lock's ttl the lock is gone anyway (the keeper stopped at the limit).
                if wait_until_gone(pid, task.lock_plan.ttl):
                    free_lost_run(task, task_id, args, kwargs, pid)

            threading.Thread(
                target=free_once_gone, name=f"celery-redlock free {task_id}", daemon=True
            ).start()
        return super().on_timeout(soft, timeout)
