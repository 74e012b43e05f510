"""A plain function call of a singleton task — ``task(...)`` outside a worker, or an errback that
Celery calls in-process — under its lock: take it (waiting with "wait", "retry" and "coalesce"),
run, release. There is no message to defer or retry, and no task id to record."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery import states

from . import events, signals
from .errors import LockNotAcquired, RedlockError
from .keeper import KeptLock
from .outcomes import Acquired, Held, Lock, Unavailable
from .owner import Owner, describe_holder
from .plan import TaskPlan
from .run import RUN_ATTRIBUTE, Run

logger = logging.getLogger(__name__)


class DirectRun:
    """One plain call of a singleton task. While its body runs it is the task's `current_run`
    in this thread (Celery's request of a plain call has no room for it)."""

    def __init__(self, task: Any, plan: TaskPlan) -> None:
        self.task = task
        self.plan = plan
        self.runtime = plan.runtime
        self.task_id: str | None = None
        self.lock: Lock | None = None
        self.kept: KeptLock | None = None

    def execute(self, args: Sequence[Any], kwargs: dict[str, Any], body: Callable[[], Any]) -> Any:
        """Run ``body`` (Celery's own ``Task.__call__``) under the call's lock."""
        plan, redlock = self.plan, self.runtime.redlock
        resource = plan.resource(args, kwargs)
        owner = Owner.here(self.task.name, None).to_text()
        wait = plan.wait if plan.on_duplicate in ("wait", "retry", "coalesce") else 0.0
        outcome = redlock.attempt(resource, plan.ttl, owner, wait=wait)
        if isinstance(outcome, Unavailable):
            if plan.on_unavailable != "run":
                raise outcome.error
            return body()
        if not isinstance(outcome, Acquired):
            key = redlock.key_for(resource)
            if plan.on_duplicate == "skip":
                logger.info("skipped direct call of %s: lock %s is held", self.task.name, key)
                return None
            holder = outcome.holder if isinstance(outcome, Held) else None
            raise LockNotAcquired(key, describe_holder(holder))
        lock = self.lock = outcome.lock
        self.kept = self.runtime.keeper.keep(lock, ignore_loss, None, plan.auto_extend)
        started = time.monotonic()
        previous = getattr(plan.direct_runs, "run", None)
        plan.direct_runs.run = self
        state = states.FAILURE
        try:
            result = body()
            state = states.SUCCESS
            return result
        finally:
            plan.direct_runs.run = previous
            self.finish(lock, state, time.monotonic() - started)

    def finish(self, lock: Lock, state: str, held: float) -> None:
        """Stop extending and release the lock; report it to whoever listens."""
        assert self.kept is not None
        self.runtime.keeper.stop(self.kept)
        reported = events.listening(self.task, signals.lock_released)
        try:
            released = self.runtime.redlock.release(lock, confirm=reported)
        except RedlockError as error:
            logger.warning("releasing lock %s failed (it expires by itself): %s", lock.key, error)
            released = False
        if reported:
            events.report(
                self.task,
                signals.lock_released,
                None,
                key=lock.key,
                state=state,
                held=held,
                released=released,
            )


def current_run(task: Any, plan: TaskPlan) -> Run | DirectRun | None:
    """The run of ``task`` under way in this thread: a worker's delivery, or a plain call."""
    run: Run | None = getattr(task.request, RUN_ATTRIBUTE, None)
    if run is not None:
        return run
    direct: DirectRun | None = getattr(plan.direct_runs, "run", None)
    return direct


def ignore_loss(kept: KeptLock) -> None:
    """Direct calls have no task id to report a loss for (the keeper logs it)."""
