"""``on_duplicate="coalesce"``: at most one running and one pending run per key.

The first duplicate of a running call reserves the lock (`Redlock.reserve`) and waits, woken by
the release, for the lock itself, which goes to it, never to a newcomer. A duplicate that finds
the reservation held by another call merges into it (that run starts after this one arrived, so
its work covers this one's) and is stored as skipped with `DuplicateCoalesced`. Before reserving,
a run publishes deferred copies of itself (`INSURANCE_COPIES`), so that its work and the work
merged into it survive its process dying (once it has run, the copies are acknowledged as
completed).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Protocol

from celery.exceptions import Ignore

from ..errors import DuplicateCoalesced, DuplicateSkipped, QuorumUnavailable
from ..lock.keeper import KeptLock
from ..lock.outcomes import Acquired, Held, Lock, Outcome, Record, Unavailable
from ..lock.owner import Owner
from ..lock.redlock import reservation_of, reserve
from .plan import TaskPlan
from .policy import Step, relation_of
from .runtime import AppRuntime


class CoalescingRun(Protocol):
    """What coalescing uses of a run (`celery_redlock.integration.run.Run`)."""

    runtime: AppRuntime
    plan: TaskPlan
    request: Any
    claim: Lock
    record: Record | None
    writes_record: bool

    def attempt(self, wait: float = 0.0, rounds: int | None = None) -> Outcome: ...

    def publish_again(
        self, countdown: float, headers: dict[str, Any] | None = None
    ) -> Exception | None: ...

    def defer(
        self, outcome: Outcome, countdown: float, why: str, headers: dict[str, Any] | None = None
    ) -> Step: ...

    def skip(self, skipped: DuplicateSkipped) -> BaseException: ...

    def holder_text(self, outcome: Outcome) -> str: ...

    def report_duplicate(self, policy: str, holder: Owner | None) -> None: ...

    def log(self, level: int, message: str, *args: object) -> None: ...


def coalesce(run: CoalescingRun, outcome: Held) -> Step:
    """Become the pending run and wait for the lock (returning the outcome), or how this
    delivery ends instead: merged into the pending run, deferred, or lost the race for the
    reservation (its deferred copy decides later). ``outcome``: the attempt that found the lock
    held."""
    redlock = run.runtime.redlock
    claim, plan = run.claim, run.plan
    try:
        pending = reservation_of(redlock, claim.resource)
    except QuorumUnavailable as error:
        return Unavailable(error)
    if pending is not None:
        return join_pending(run, pending, outcome)
    if run.request.is_eager:
        return run.attempt(wait=plan.wait)
    insured = insure(run, plan.ttl + 1.0)
    reservation = reserve(redlock, claim.resource, plan.ttl, claim.owner, token=claim.token)
    if not isinstance(reservation, Acquired):
        if isinstance(reservation, Held) and run.record is not None:
            # Another duplicate reserved first: merge into it, and record this attempt as
            # completed so that the copy just published is acknowledged when it comes.
            redlock.release(claim, record=run.record)
            return join_pending(run, reservation, outcome)
        if not insured:
            return reservation  # no copy of it decides later: this delivery decides now
        run.log(
            logging.INFO,
            "lost the race for the reservation of %s; its copy decides later",
            claim.key,
        )
        later: BaseException = Ignore()
        return later
    run.report_duplicate("coalesce", None)
    # A reservation lost while waiting needs no report: the lock itself decides.
    kept = KeptLock(reservation.lock, None, lambda kept: None, weakref.ref(run))
    try:
        run.runtime.keeper.start(kept)
        return run.attempt(wait=float("inf"))
    finally:
        run.runtime.keeper.stop(kept)
        redlock.release(reservation.lock, confirm=False)


INSURANCE_COPIES = 2
"""Copies of a pending run published as its insurance. The Redis transport takes a message off
its queue before it records it as unacknowledged: a worker killed in between loses the one
message it was fetching — often this very worker, fetching its own copy as it dies. It fetches
one message at a time, so one of two copies survives; the other is acknowledged as completed
(`Record`), like any redelivered copy of a message that ran."""


def insure(run: CoalescingRun, countdown: float) -> bool:
    """Publish the insurance copies (see above); False when the broker took none. Once one is
    published, the run records itself when its body ran, so that the copies are acknowledged."""
    errors = [run.publish_again(countdown) for _ in range(INSURANCE_COPIES)]
    if all(error is not None for error in errors):
        run.log(
            logging.WARNING,
            "goes on without a copy of itself in the broker (publishing it failed: %r): its work "
            "is lost if its process dies before it runs, unless it acks late",
            errors[0],
        )
        return False
    run.writes_record = True
    return True


def join_pending(run: CoalescingRun, pending: Held, outcome: Held) -> Step:
    """The reservation is held: merge into that pending run, or defer this delivery (found
    ``outcome``) when the pending run is a copy of it."""
    owner = Owner.parse(pending.holder)
    if relation_of(owner, run.request) == "other" and owner is not None:
        run.report_duplicate("coalesced", owner)
        key = run.claim.key
        run.log(logging.INFO, "coalesced into the pending run %s of lock %s", owner.id, key)
        holder_text = run.holder_text(outcome)
        return run.skip(DuplicateCoalesced(key, holder_text, into=owner.id))
    return run.defer(outcome, pending.expires_in + 0.1, "a copy of it is the pending run")
