"""Deferring a delivery: publishing its very message again to run later, which frees the pool
process — and what the delivery does when the broker does not take that message.

A deferral acknowledges the delivery only once its copy is published, and so does a retry that
``on_duplicate="retry"`` asks of Celery. When publishing fails (the broker is down or refuses, the
producer's connection is lost), the delivery waits for its lock in its process instead, trying to
publish again every `UNPUBLISHED_PAUSE` seconds. A message acknowledged late (``acks_late``) waits
`ACKS_LATE_PATIENCE` seconds at most (or half its tighter time limit), then is rejected and
requeued: the broker still holds it and delivers it again. A message acknowledged on receipt is gone
from the broker: with no time limit it waits as long as it takes, and with one it fails loudly at
half the tighter limit rather than be killed by it unrecorded.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Protocol

from celery.exceptions import Reject

from ..lock.outcomes import Outcome, Unavailable
from .plan import TaskPlan

logger = logging.getLogger(__name__)

DEFERRED_HEADER = "celery_redlock_deferred"
"""Message header of a run published again by this library (never de-duplicated at enqueue)."""

UNPUBLISHED_PAUSE = 5.0
"""Seconds a delivery whose deferral was not published waits for its lock in its process before
it tries to publish again."""

ACKS_LATE_PATIENCE = 10.0
"""Seconds an ``acks_late`` delivery waits in its process after a deferral was not published,
before its message goes back to the broker."""


class DeferralNotPublished(Exception):
    """The broker did not take a deferral or a retry; ``error`` says why. Raised by `Run.defer`
    and `Run.retry` and handled by the run itself (`wait_instead`): it never reaches Celery or
    the caller."""

    def __init__(self, why: str, error: BaseException) -> None:
        super().__init__(f"{why}; publishing the deferral failed: {error!r}")
        self.why = why
        self.error = error


class WaitingRun(Protocol):
    """What waiting instead of a deferral needs of a delivery (`run.Run` is
    one)."""

    task: Any
    task_id: str | None
    request: Any
    plan: TaskPlan
    started: float

    def attempt(self, wait: float = 0.0, rounds: int | None = None) -> Outcome:
        """One attempt at the run's lock, waiting up to ``wait`` seconds."""


def publish_again(
    task: Any, request: Any, countdown: float, headers: dict[str, Any] | None = None
) -> float:
    """Publish the message of ``request`` again (same id, same attempt, same message identity,
    every option) to run after about ``countdown`` seconds; returns the countdown used. Raises
    what the producer raises when the broker does not take it."""
    message_headers = {**(request.headers or {}), DEFERRED_HEADER: True, **(headers or {})}
    countdown += random.uniform(0.0, 0.5)  # copies published together come back apart
    again = task.signature_from_request(request, countdown=countdown, headers=message_headers)
    again.apply_async()
    return countdown


def wait_instead(run: WaitingRun, outcome: Outcome, failure: DeferralNotPublished) -> Outcome:
    """The deferral of ``run`` (whose last attempt ended in ``outcome``) was not published: wait
    for the lock in this process a while and return the next outcome, for the run to decide
    again — or, once it has waited as long as it may, raise: `Reject` (requeue) for an
    ``acks_late`` message, else the publishing error."""
    limits = [limit / 2 for limit in run.plan.time_limits(run.request) if limit]
    acks_late = bool(run.task.acks_late)
    if acks_late:
        limits.append(ACKS_LATE_PATIENCE)
    waited = time.monotonic() - run.started
    left = min(limits) - waited if limits else float("inf")
    if left <= 0:
        if acks_late:
            logger.error(
                "task %s[%s] could not be deferred (%s): its message goes back to the broker",
                run.task.name,
                run.task_id,
                failure,
            )
            raise Reject(failure.error, requeue=True) from failure.error
        logger.error(
            "task %s[%s] failed: it could not be deferred (%s), and it may not wait longer "
            "within its time limits",
            run.task.name,
            run.task_id,
            failure,
        )
        raise failure.error
    logger.warning(
        "task %s[%s] could not be deferred (%s): it waits in its process instead",
        run.task.name,
        run.task_id,
        failure,
    )
    pause = min(UNPUBLISHED_PAUSE, left)
    if isinstance(outcome, Unavailable):
        time.sleep(pause)
        return run.attempt(rounds=1)
    return run.attempt(wait=pause)
