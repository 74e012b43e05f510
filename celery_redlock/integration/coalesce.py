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
from typing import Any

from celery.exceptions import Ignore

from ..errors import DuplicateCoalesced, QuorumUnavailable
from ..lock.outcomes import Acquired, Held, Unavailable
from ..lock.owner import Owner
from ..lock.redlock import reservation_of, reserve
from .policy import relation_of


def coalesce(run: Any, holder_text: str) -> Any:
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
        run.log(
            logging.INFO,
            "lost the race for the reservation of %s; its copy decides later",
            lock.key,
        )
        raise Ignore()
    run.report_duplicate("coalesce", None)
    # A reservation lost while waiting needs no report: the lock itself decides.
    kept = run.runtime.keeper.keep(reservation.lock, lambda kept: None, None, True)
    try:
        return run.attempt(wait=float("inf"))
    finally:
        run.runtime.keeper.stop(kept)
        redlock.release(reservation.lock, confirm=False)


def insure(run: Any, countdown: float) -> bool:
    """Publish the insurance copy (see above); False when the broker did not take it."""
    try:
        run.publish_again(countdown)
    except Exception as error:  # the broker refused it, or could not be reached
        run.log(
            logging.WARNING,
            "goes on without a copy of itself in the broker (publishing it failed: %r): its work "
            "is lost if its process dies before it runs, unless it acks late",
            error,
        )
        return False
    return True


def join_pending(run: Any, pending: Held, holder_text: str) -> Ignore:
    """The reservation is held: merge into that pending run, or defer this delivery when the
    pending run is a copy of it."""
    owner = Owner.parse(pending.holder)
    if relation_of(owner, run.request) == "other" and owner is not None:
        run.report_duplicate("coalesced", owner)
        run.log(
            logging.INFO, "coalesced into the pending run %s of lock %s", owner.id, run.lock.key
        )
        return run.skip(DuplicateCoalesced(run.lock.key, holder_text, into=owner.id))
    return run.defer(pending.expires_in + 0.1, "a copy of it is the pending run")
