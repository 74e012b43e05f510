"""Where celery_redlock hooks into Celery besides the task's own ``__call__``.

- ``before_task_publish``, in every process that publishes task messages and imports
  celery_redlock: each new message gets a random identity in the header ``celery_redlock_message``
  (a message published again as the same message — a retry, a deferral — keeps its own). The
  broker redelivers a message with its headers, and an application that sends a task id again
  sends a new message: completion records name the message, so only a redelivery of a message
  whose body ran is acknowledged without running.
- ``task_postrun`` fires for every outcome; its handler releases whatever a run left registered
  on its request: an acquisition interrupted between sending and deciding (a soft time limit, a
  signal), or a release interrupted itself. Normally a run has released the moment its body ended.
- `LockAwareRequest`, in the worker's main process: when the pool process running a singleton
  task is lost — killed (SIGKILL, OOM), terminated by ``revoke(terminate=True)``, or stopped at
  its hard time limit — its own code never runs again, so the main process frees that process's
  lock, by owner, once the process is gone and never before.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import threading
import time
import weakref
from typing import Any

from billiard.exceptions import Terminated, WorkerLostError
from celery import current_app, states
from celery import signals as celery_signals
from celery.bootsteps import CLOSE, RUN, TERMINATE
from celery.worker.request import Request

from .events import remember_worker
from .owner import run_prefix
from .runtime import RUN_ATTRIBUTE, AppRuntime, RunLock

logger = logging.getLogger(__name__)

# How the main process learns that the process running a task is gone.
PROCESS_LOST_ERRORS = (WorkerLostError, Terminated)

MESSAGE_HEADER = "celery_redlock_message"
"""The message header holding a published message's identity (16 hex digits)."""


def name_message(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish`` handler: give a new message its identity (see the module
    docstring). Messages of tasks this process knows are not singleton tasks are left alone."""
    if headers is None or MESSAGE_HEADER in headers:
        return
    task = current_app.tasks.get(sender) if isinstance(sender, str) else None
    if task is not None and not hasattr(task, "lock_plan"):
        return
    headers[MESSAGE_HEADER] = secrets.token_hex(8)


def message_field(task_name: str, request: Any) -> str:
    """The completion-record field of the message a request was delivered in: its identity, or,
    for a message published where celery_redlock was not imported, the task's name."""
    identity = (request.headers or {}).get(MESSAGE_HEADER)
    return f"message:{identity}" if isinstance(identity, str) else f"task:{task_name}"


def release_leftovers(sender: Any = None, task: Any = None, state: str = "", **_: Any) -> None:
    """Release what the run that just ended left registered (see the module docstring)."""
    task = task or sender
    request = getattr(task, "request", None)
    run: RunLock | None = getattr(request, RUN_ATTRIBUTE, None)
    if run is None:
        return
    setattr(request, RUN_ATTRIBUTE, None)
    run.runtime.finish(task, run, state or states.FAILURE)


def free_lost_run(task: Any, task_id: str | None, args: Any, kwargs: Any, pid: int | None) -> None:
    """Free the lock a run of ``task_id`` held in process ``pid`` of this host, which is gone.

    Only that process's lock is deleted (matched by task id, process and host), never a later
    attempt's of the same task id running elsewhere.
    """
    if task_id is None or pid is None:
        return
    try:
        plan = task.lock_plan
        resource = plan.resource(args or (), kwargs or {})
        freed = plan.runtime.redlock.release_if_owner(
            resource, run_prefix(task_id, pid, socket.gethostname())
        )
    except Exception as error:  # a lock_key callable can raise anything; Celery must go on
        logger.warning("could not free the lock of lost task %s[%s]: %s", task.name, task_id, error)
        return
    if freed:
        logger.info("freed the lock of task %s[%s], whose process was lost", task.name, task_id)


def wait_until_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for process ``pid`` to end; True once it has."""
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
    """The worker's request object for singleton tasks (``SingletonTask.Request``).

    Runs in the worker's main process. When the process running a singleton task is lost, it
    frees that process's lock *before* Celery requeues or reports the task (so a requeued copy
    with ``reject_on_worker_lost`` runs at once) — and, at a hard time limit, only after the pool
    has killed the process (Celery calls ``on_timeout`` before it kills it). A custom ``Request``
    for a singleton task must subclass this one.
    """

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exception = getattr(exc_info, "exception", None)
        exception = getattr(exception, "exc", exception)  # unwrap ExceptionWithTraceback
        if isinstance(exception, PROCESS_LOST_ERRORS):  # reported after the process exited
            free_lost_run(self.task, self.id, self.args, self.kwargs, self.worker_pid)
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if not soft and self.worker_pid is not None:
            task, task_id, args, kwargs, pid = (
                self.task,
                self.id,
                self.args,
                self.kwargs,
                self.worker_pid,
            )

            def free_once_gone() -> None:
                # Past the lock's ttl the lock is gone anyway (the keeper stopped at the limit).
                if wait_until_gone(pid, task.lock_plan.ttl):
                    free_lost_run(task, task_id, args, kwargs, pid)
                task.lock_plan.runtime.redlock.close_thread_connections()

            threading.Thread(
                target=free_once_gone, name=f"celery-redlock free {task_id}", daemon=True
            ).start()
        return super().on_timeout(soft, timeout)


def start_reaper(sender: Any = None, **_: Any) -> None:
    """At worker start (``worker_init``, in the main process): with ``redlock_reap_interval``
    set, run `celery_redlock.admin.reap` every that many seconds from a daemon thread while the
    worker runs. Off by default; nothing is read from an app that does not set it."""
    app = getattr(sender, "app", None)
    if app is None or app.conf.get("redlock_reap_interval") is None:
        return
    interval = AppRuntime.for_app(app).settings.reap_interval
    assert interval is not None
    worker = weakref.ref(sender)

    def reap_now_and_then() -> None:
        from . import admin  # admin imports task, which imports this module

        while True:
            time.sleep(interval)
            # A cold shutdown sends no worker_shutdown: the worker's own state tells.
            state = getattr(getattr(worker(), "blueprint", None), "state", TERMINATE)
            if state in (CLOSE, TERMINATE):
                return
            if state != RUN:
                continue
            try:
                admin.reap(app)
            except Exception as error:  # the timer must outlive nodes and brokers that fail
                logger.warning("reaping locks whose holder is gone failed: %s", error)

    threading.Thread(target=reap_now_and_then, name="celery-redlock reaper", daemon=True).start()


# The only module-level state of the package: these signal connections.
celery_signals.before_task_publish.connect(
    name_message, weak=False, dispatch_uid="celery_redlock.name_message"
)
celery_signals.task_postrun.connect(
    release_leftovers, weak=False, dispatch_uid="celery_redlock.release_leftovers"
)
celery_signals.worker_init.connect(
    remember_worker, weak=False, dispatch_uid="celery_redlock.remember_worker"
)
celery_signals.worker_init.connect(
    start_reaper, weak=False, dispatch_uid="celery_redlock.start_reaper"
)
