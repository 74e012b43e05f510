"""``on_duplicate="coalesce"``: at most one running and one pending run per key.

The first duplicate of a running call reserves the lock (`Redlock.reserve`) and waits, woken by
the release, for the lock itself, which goes to it, never to a newcomer. A duplicate that finds
the reservation held by another call merges into it (that run starts after this one arrived, so
its work covers this one's) and is stored as skipped with `DuplicateCoalesced`. Before reserving,
a run publishes a deferred copy of itself, so that its work and the work merged into it survive
its process dying (once it has run, the copy is acknowledged as completed).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from celery.exceptions import Ignore

from ..errors import DuplicateCoalesced, DuplicateSkipped, QuorumUnavailable
from ..lock.outcomes import Acquired, Held, Lock, Outcome, Record, Unavailable
from ..lock.owner import Owner
from ..lock.redlock import reservation_of, reserve
from .plan import TaskPlan
from .policy import relation_of
from .runtime import AppRuntime

logger = logging.getLogger(__name__)


class CoalescingRun(Protocol):
    """What coalescing needs of a delivery (`run.Run` is one)."""

    task: Any
    task_id: str | None
    request: Any
    plan: TaskPlan
    runtime: AppRuntime
    lock: Lock
    record: Record | None

    def attempt(self, wait: float = 0.0, rounds: int | None = None) -> Outcome: ...
    def publish_again(self, countdown: float, headers: dict[str, Any] | None = None) -> float: ...
    def report_duplicate(self, policy: str, holder: Owner | None) -> None: ...
    def skip(self, skipped: DuplicateSkipped) -> Ignore: ...
    def defer(
        self, countdown: float, why: str, headers: dict[str, Any] | None = None
    ) -> Ignore: ...


def coalesce(run: CoalescingRun, holder_text: str) -> Outcome:
    """Become the pending run and wait for the lock (returning the outcome), or raise what this
    delivery is instead: merged into the pending run, deferred, or lost the race for the
    reservation (its deferred copy decides later)."""
    redlock = run.runtime.redlock
    lock, plan = run.lock, run.plan
    try:
        pending = reservation_of(redlock, lock.resource)
    except QuorumUnavailable as error:
        return Unavailable(error)
    if pending is not None:
        raise join_pending(run, pending, holder_text)
    if run.request.is_eager:
        return run.attempt(wait=plan.wait)
    insured = insure(run, plan.ttl + 1.0)
    reservation = reserve(redlock, lock.resource, plan.ttl, lock.owner, token=lock.token)
    if not isinstance(reservation, Acquired):
        if isinstance(reservation, Held) and run.record is not None:
            # Another duplicate reserved first: merge into it, and record this attempt as
            # completed so that the copy just published is acknowledged when it comes.
            redlock.release(lock, record=run.record)
            raise join_pending(run, reservation, holder_text)
        if not insured:
            return reservation  # no copy of it decides later: this delivery decides now
        logger.info(
            "task %s[%s] lost the race for the reservation of %s; its copy decides later",
            run.task.name,
            run.task_id,
            lock.key,
        )
        raise Ignore()
    run.report_duplicate("coalesce", None)
    kept = run.runtime.keeper.keep(reservation.lock, ignore_loss, None, True)
    try:
        return run.attempt(wait=float("inf"))
    finally:
        run.runtime.keeper.stop(kept)
        redlock.release(reservation.lock, confirm=False)


def insure(run: CoalescingRun, countdown: float) -> bool:
    """Publish a deferred copy of the run about to become pending, so that its work survives
    the death of its process; False when the broker did not take it (the run goes on without)."""
    try:
        run.publish_again(countdown)
    except Exception as error:  # the broker refused it, or could not be reached
        logger.warning(
            "task %s[%s] goes on without a copy of itself in the broker (publishing it failed: "
            "%r): its work is lost if its process dies before it runs, unless it acks late",
            run.task.name,
            run.task_id,
            error,
        )
        return False
    return True


def join_pending(run: CoalescingRun, pending: Held, holder_text: str) -> Ignore:
    """The reservation is held: merge into that pending run, or defer this delivery when the
    pending run is a copy of it."""
    owner = Owner.parse(pending.holder)
    if relation_of(owner, run.request) == "other" and owner is not None:
        run.report_duplicate("coalesced", owner)
        logger.info(
            "task %s[%s] coalesced into the pending run %s of lock %s",
            run.task.name,
            run.task_id,
            owner.id,
            run.lock.key,
        )
        return run.skip(DuplicateCoalesced(run.lock.key, holder_text, into=owner.id))
    return run.defer(pending.expires_in + 0.1, "a copy of it is the pending run")


def ignore_loss(kept: object) -> None:
    """A reservation lost while waiting needs no report: the lock itself decides."""
