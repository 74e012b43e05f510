"""One run of a singleton task, top to bottom (`Run.execute`), right before the body: a delivery in
the worker (``delay``, ``apply_async``, ``send_task``, beat, canvas, retries) or a plain function
call (``task(...)``), which has no message to publish again. Its steps, module by module:
docs/how-it-works.md ("One run, through the modules").

Nothing acknowledges a message without running its body unless the body ran (the record says
so), will run from a message published first (a deferral), or a policy the user chose skipped a
true duplicate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from celery import states
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.dispatch import Signal

from .. import signals
from ..errors import AlreadyCompleted, DuplicateSkipped, LockNotAcquired, RedlockError
from ..lock import keyspace
from ..lock.keeper import KeptLock
from ..lock.outcomes import Acquired, Contended, Held, Lock, Outcome, Record, Unavailable
from ..lock.owner import Owner, claim_prefix, describe_holder
from ..lock.redlock import jittered
from ..lock.scripts import RANK_FORMAT
from . import events
from .coalesce import coalesce
from .events import WORKER_ATTRIBUTE, WorkerFacts
from .messages import DEFERRED_HEADER, ENDED_FIELD, copy_may_come, message_field
from .plan import TaskPlan
from .policy import Action, Situation, Step, decide, relation_of

logger = logging.getLogger(__name__)

RUN_ATTRIBUTE = "celery_redlock_run"

IN_PROCESS_WAIT = 5.0
"""Seconds a continuation waits for its predecessor's release, or a split vote for a decision,
before the message is deferred (published again with a countdown) to free the pool process."""

SPLIT_VOTE_DEFERRAL = 1.0
"""The longest countdown of a delivery deferred because no majority agreed on a holder."""

UNAVAILABLE_PATIENCE = 10.0
"""Seconds a run waits in its pool process for a quorum of lock nodes before it is deferred."""

UNAVAILABLE_LONGEST_PAUSE = 0.5
"""The longest pause between two attempts while no quorum answers (jittered up to 0.75 s): with
the nodes' own back-off of at most 0.5 s, runs start within about a second of their return."""

UNPUBLISHED_PAUSE = 5.0
"""Seconds a delivery whose deferral failed waits for its lock before it tries to publish again."""

ACKS_LATE_PATIENCE = 10.0
"""Longest wait of an ``acks_late`` delivery whose deferral failed, before it is requeued."""

UNAVAILABLE_SINCE_HEADER = "celery_redlock_unavailable_since"
"""Message header: when a run first found no quorum (``redlock_unavailable_timeout`` counts
from then, across deferrals)."""


# A body that ended in one of these ran: a redelivered copy of the same message must not run.
# REJECTED is not among them: a rejected message may be queued again, and must then run.
COMPLETED_STATES = frozenset({states.SUCCESS, states.FAILURE, states.RETRY, states.IGNORED})

FINAL_STATES = frozenset({states.SUCCESS, states.FAILURE})
"""A body that ended in one of these without asking for a retry ended its message for good."""

LAST_RETRIES = 2**31 - 1
"""The retry count a record stores for a message that ended for good: it covers every later
attempt of the message at its nesting. Two copies of one attempt (a redelivery) can decide apart
— one runs, the other finds a duplicate's lock and retries — and that retry is then acknowledged
instead of running the message again."""


class Run:
    """One delivery of a singleton task: its lock from the moment its token exists to its
    release. `claim` is the lock this run asks for (its key, token and owner, no validity);
    until `kept` is set the acquisition is under way, the lock may or may not be held, and
    `finish` releases it by the claim's token. Then `kept` holds the granted lock.

    Every step of `take_lock` returns a `Step`: the outcome to decide on next, or how the
    delivery ends; only `take_lock` raises it."""

    def __init__(self, task: Any, plan: TaskPlan, request: Any, resource: str) -> None:
        self.task = task
        self.plan = plan
        self.request = request
        self.runtime = plan.runtime
        self.task_id: str | None = request.id
        self.can_publish = not request.called_directly  # a plain call has no message
        self.attempt_rank = (request.replaced_task_nesting or 0, request.retries or 0)
        facts: WorkerFacts | None = task.app.__dict__.get(WORKER_ATTRIBUTE)
        worker = facts.name if facts is not None else request.hostname
        # Reports are built only where something receives them: a signal's receiver, or a
        # monitor (the worker sends task events, `events`).
        self.monitored = facts is not None and facts.task_events and bool(task.send_events)
        hard, soft = getattr(request, "timelimit", None) or (None, None)
        self.time_limits = (  # its message's own, else the task's or the app's
            float(hard) if hard else plan.hard_time_limit,
            float(soft) if soft else plan.soft_time_limit,
        )
        nesting, retries = self.attempt_rank
        owner = plan.owner_texts.text(request.id, retries, nesting, worker)
        key = self.runtime.redlock.key_for(resource)
        self.claim = Lock(
            resource, key, self.runtime.tokens.new(), validity=0.0, ttl=plan.ttl, owner=owner
        )
        self.record: Record | None = None  # checked by every attempt
        self.writes_record = False  # written by the release once the body ran
        completed_ttl = self.runtime.settings.completed_ttl
        if request.id and not request.is_eager and completed_ttl > 0:
            field = message_field(task.name, request)
            record_key = keyspace.records_key(key, request.id)
            # A copy redelivered within the window, or one deferred behind its holder (back once
            # the holder's lock expired), finds the record.
            lifetime = completed_ttl + plan.ttl + plan.hold
            self.record = Record(record_key, field, self.attempt_rank, lifetime)
            # The broker's window, not the record's lifetime (a user may keep records longer).
            self.writes_record = copy_may_come(task.acks_late, request, plan.redelivery_window)
        self.may_retry = False  # the body asked Celery for a retry (`SingletonTask.retry`)
        self.created = time.monotonic()
        self.kept: KeptLock | None = None
        self.held_since = 0.0  # when `kept` was set

    def execute(
        self, args: Sequence[Any], kwargs: dict[str, Any], body: Callable[[], Any] | None = None
    ) -> Any:
        """Take the lock, run ``body`` (default: the task's ``run(*args, **kwargs)``), release. A
        plain call that skipped a duplicate returns None."""
        if body is None:
            run, body = self.task.run, lambda: run(*args, **kwargs)
        setattr(self.request, RUN_ATTRIBUTE, self)
        try:
            lock = self.take_lock()
        except Ignore:
            self.forget()  # a decision: every round was released
            if self.can_publish:
                raise
            return None  # a plain call skipped as a duplicate
        except (Reject, Retry, RedlockError):
            self.forget()
            raise
        if lock is None:  # on_unavailable="run": documented as unguarded
            self.forget()
            return body()
        state = states.FAILURE
        try:
            self.hold_while_running(lock)
            result = body()
            state = states.SUCCESS
            return result
        except BaseException as error:
            state = state_after(error)
            raise
        finally:
            self.finish(state)

    def take_lock(self) -> Lock | None:
        """The lock to run with, or None to run unguarded; raises how the delivery ends
        instead: `Ignore` (acknowledged, skipped, merged, deferred), `Retry`, `Reject` (an
        ``acks_late`` message requeued), or an error."""
        step: Step = self.attempt()
        may_wait = True  # one wait per delivery; after it, the fallback applies
        while not isinstance(step, BaseException):
            outcome = step
            holder = Owner.parse(outcome.holder) if isinstance(outcome, Held) else None
            relation = relation_of(holder, self.request)
            action = decide(
                Situation(
                    type(outcome).__name__.lower(),  # policy.OUTCOMES
                    relation,
                    self.plan.on_duplicate,
                    self.plan.on_unavailable,
                    may_wait,
                    bool(self.request.is_eager),
                    self.can_publish,
                )
            )
            if action is Action.RUN:
                assert isinstance(outcome, Acquired)
                return outcome.lock
            if action is Action.RUN_UNGUARDED:
                assert isinstance(outcome, Unavailable)
                self.report(signals.lock_unavailable, policy=self.plan.on_unavailable)
                self.log(
                    logging.WARNING,
                    "runs WITHOUT its lock (on_unavailable='run'): %s",
                    outcome.error,
                )
                return None
            if action is Action.ACKNOWLEDGE:
                step = self.acknowledge()
            elif action is Action.DEFER:
                step = self.defer_past(outcome, relation, holder)
            elif action is Action.RETRY:
                step = self.retry(outcome, holder)
            elif action is Action.RAISE:
                step = self.refusal(outcome, holder)
            elif action is Action.SKIP:
                self.report_duplicate("skip", holder)
                text = self.holder_text(outcome)
                self.log(logging.INFO, "skipped: lock %s is held by %s", self.claim.key, text)
                step = self.skip(DuplicateSkipped(self.claim.key, text))
            elif action is Action.WAIT:
                step = self.wait(outcome, relation, holder)
                may_wait = False
            elif action is Action.WAIT_FOR_NODES:
                assert isinstance(outcome, Unavailable)
                step = self.wait_for_nodes(outcome)
            else:
                assert action is Action.COALESCE and isinstance(outcome, Held)
                step = coalesce(self, outcome)
                may_wait = False
        raise step

    def attempt(self, wait: float = 0.0, rounds: int | None = None) -> Outcome:
        """One attempt, waiting up to ``wait`` seconds for the lock (``inf``: as long as needed)."""
        replaces = claim_prefix(self.task_id) if self.plan.replaces_claims and self.task_id else ""
        return self.runtime.redlock.attempt(
            self.claim.resource,
            self.plan.ttl,
            self.claim.owner,
            wait=wait,
            token=self.claim.token,
            replaces=replaces,
            record=self.record,
            rounds=rounds,
        )

    def hold_while_running(self, lock: Lock) -> None:
        """Keep the lock alive while the body runs (in a worker, never past the hard time limit)."""
        hard_limit = self.time_limits[0] if self.can_publish else None
        deadline = None if hard_limit is None else time.monotonic() + hard_limit
        # The kept lock holds this callback: were it to hold the run, which holds the kept lock,
        # every run would end as a cycle (with its request) that only the cycle collector frees.
        task, task_id, key = self.task, self.task_id, lock.key

        def on_lost(kept: KeptLock) -> None:
            events.report(task, signals.lock_lost, task_id, key=key, reason=kept.lost_reason)

        waited = time.monotonic() - self.created
        self.held_since = time.monotonic()
        # Stored before it is extended, so that `finish` stops whatever was started; were the
        # run to vanish without finishing, the keeper releases the lock (``holder``).
        self.kept = kept = KeptLock(lock, deadline, on_lost, weakref.ref(self))
        if self.plan.auto_extend:
            self.runtime.keeper.start(kept)
        if signals.lock_acquired.receivers or self.monitored:
            self.report(signals.lock_acquired, waited=waited, fencing_token=lock.fencing_token)

    def finish(self, state: str) -> bool:
        """Release the lock (or keep it ``lock_hold`` more seconds, never on RETRY), record the
        completed attempt where a copy may come, report; True once a majority confirmed it was
        still held. Called again after an interruption (``task_postrun``), it finishes the rest."""
        kept = self.kept
        if kept is not None:
            self.runtime.keeper.stop(kept)
        record = self.record if self.writes_record and kept is not None else None
        if record is not None and state not in COMPLETED_STATES:
            record = None
        elif record is not None and state in FINAL_STATES and not self.may_retry:
            record = dataclasses.replace(record, rank=(self.attempt_rank[0], LAST_RETRIES))
            setattr(self.request, ENDED_FIELD, True)  # set first: a retry asked for later sees it
        reported = kept is not None and (bool(signals.lock_released.receivers) or self.monitored)
        released = False
        try:
            # Sent even for a lock known to be lost: copies may still be on some nodes. Only a
            # receiver of lock_released (or a monitor) needs the answer; otherwise the run does
            # not wait for it (the next command this process sends a node runs after it).
            released = self.runtime.redlock.release(
                self.claim if kept is None else kept.lock,
                hold=self.plan.hold if state != states.RETRY else 0.0,
                record=record,
                confirm=reported,
            )
        except RedlockError as error:
            logger.warning(
                "releasing lock %s failed (it expires by itself): %s", self.claim.key, error
            )
        self.forget()
        if kept is None:
            return released
        if kept.is_lost:
            self.log(
                logging.ERROR,
                "finished after losing its lock %s (%s)",
                self.claim.key,
                kept.lost_reason,
            )
        if reported:
            self.report(
                signals.lock_released,
                state=state,
                held=time.monotonic() - self.held_since,
                released=released and not (self.plan.hold and state != states.RETRY),
            )
        return released

    def forget(self) -> None:
        """Take the run off its request: nothing is left for ``task_postrun`` to release."""
        if getattr(self.request, RUN_ATTRIBUTE, None) is self:
            setattr(self.request, RUN_ATTRIBUTE, None)

    def wait(self, outcome: Outcome, relation: str, holder: Owner | None) -> Outcome:
        """Wait in this process for the holder to release (or a split vote to resolve), then
        attempt again: a true duplicate for ``lock_wait`` seconds, anyone else briefly."""
        if isinstance(outcome, Held) and relation == "other":
            self.report_duplicate("wait", holder)
            return self.attempt(wait=self.plan.wait)
        if isinstance(outcome, Held):
            return self.attempt(wait=min(outcome.expires_in, IN_PROCESS_WAIT))
        return self.attempt(wait=min(self.plan.ttl, IN_PROCESS_WAIT))

    def wait_for_nodes(self, outcome: Unavailable) -> Step:
        """Wait for a quorum (``on_unavailable="retry"``), in this process a while, then deferred,
        without spending the task's retries, until ``redlock_unavailable_timeout`` (counted from
        this call's first miss) fails the task. Returns the first outcome not `Unavailable`, or
        the end: deferred, or the error once the timeout is spent."""
        request = self.request
        self.report(signals.lock_unavailable, policy=self.plan.on_unavailable)
        since = float((request.headers or {}).get(UNAVAILABLE_SINCE_HEADER) or time.time())
        timeout = self.runtime.settings.unavailable_timeout
        patience_ends = time.monotonic() + min(
            [UNAVAILABLE_PATIENCE, *(limit / 2 for limit in self.time_limits if limit)]
        )
        self.log(logging.WARNING, "waits for a quorum of lock nodes: %s", outcome.error)
        pause = 0.05
        while True:
            if timeout is not None and time.time() - since >= timeout:
                self.log(
                    logging.ERROR,
                    "failed: no quorum of lock nodes for %.0fs (redlock_unavailable_timeout): %s",
                    time.time() - since,
                    outcome.error,
                )
                return outcome.error
            if time.monotonic() >= patience_ends:
                headers = {UNAVAILABLE_SINCE_HEADER: since}
                why = "no quorum of lock nodes"
                return self.defer(outcome, UNAVAILABLE_LONGEST_PAUSE, why, headers)
            time.sleep(jittered(pause))
            pause = min(pause * 2, UNAVAILABLE_LONGEST_PAUSE)
            # One round per try: this loop is the retry, and each round waits for the probes of
            # nodes that were down (one node timeout), so the first try after their return wins.
            next_outcome = self.attempt(rounds=1)
            if not isinstance(next_outcome, Unavailable):
                return next_outcome
            outcome = next_outcome

    def wait_instead(self, outcome: Outcome, why: str, error: Exception) -> Step:
        """The deferral (or retry) was not published (``error``): wait for the lock here
        `UNPUBLISHED_PAUSE` seconds and return the next outcome, to decide again. Once it may
        wait no longer, the end: `Reject` (requeue) for an ``acks_late`` message, which the
        broker still holds, after `ACKS_LATE_PATIENCE` seconds; else the publishing error at half
        the tighter time limit, rather than be killed by it unrecorded (a message acknowledged on
        receipt is gone from the broker; with no limit it waits as long as it takes)."""
        failure = f"{why}; publishing the deferral failed: {error!r}"
        limits = [limit / 2 for limit in self.time_limits if limit]
        acks_late = bool(self.task.acks_late)
        if acks_late:
            limits.append(ACKS_LATE_PATIENCE)
        left = min(limits) - (time.monotonic() - self.created) if limits else float("inf")
        if left <= 0:
            if acks_late:
                self.log(
                    logging.ERROR,
                    "could not be deferred (%s): its message goes back to the broker",
                    failure,
                )
                requeued: BaseException = Reject(error, requeue=True)
                return requeued
            self.log(
                logging.ERROR,
                "failed: it could not be deferred (%s), and it may not wait longer "
                "within its time limits",
                failure,
            )
            return error
        self.log(
            logging.WARNING, "could not be deferred (%s): it waits in its process instead", failure
        )
        pause = min(UNPUBLISHED_PAUSE, left)
        if isinstance(outcome, Unavailable):
            time.sleep(pause)
            return self.attempt(rounds=1)
        return self.attempt(wait=pause)

    def acknowledge(self) -> Ignore:
        """This very message ran already (the broker delivered it again): acknowledge it without
        running it. The first run's stored result stays; a caller or monitor that knows no final
        state for the id (a forgotten result) gets one: REVOKED, with `AlreadyCompleted`."""
        task, request = self.task, self.request
        self.log(
            logging.INFO,
            "already ran (this message, attempt %s); not running it again",
            RANK_FORMAT.format(*self.attempt_rank),
        )
        self.report_duplicate("completed", None)
        if self.stores_results():
            with contextlib.suppress(NotImplementedError):  # no result backend configured
                if task.backend.get_state(request.id) == states.PENDING:
                    error = AlreadyCompleted(self.claim.key, request.id)
                    task.backend.store_result(request.id, error, states.REVOKED, request=request)
        events.announce_revoked(task, request.id)
        return Ignore()

    def defer_past(self, outcome: Outcome, relation: str, holder: Owner | None) -> Step:
        """Defer this delivery until the holder is gone (or a split vote is over)."""
        if isinstance(outcome, Contended):
            # Racing callers settle in moments and leftovers expire in retry_in: come back soon.
            countdown = min(outcome.retry_in, SPLIT_VOTE_DEFERRAL)
            return self.defer(outcome, countdown, "no majority agreed on a holder")
        assert isinstance(outcome, Held)
        if relation == "continuation":
            why = "its predecessor still holds the lock"
            return self.defer(outcome, outcome.expires_in + 0.1, why)
        # The broker delivered this attempt again while a copy of it holds the lock (a visibility
        # timeout, a lost connection, a dead host), or the application sent the task id again:
        # run it once the holder is gone (or acknowledge it then, if the record says it ran).
        self.report_duplicate("redelivered", holder)
        why = f"a copy of it holds the lock ({self.holder_text(outcome)})"
        return self.defer(outcome, outcome.expires_in + 0.1, why)

    def defer(
        self,
        outcome: Outcome,
        countdown: float,
        why: str,
        headers: dict[str, Any] | None = None,
    ) -> Step:
        """Publish this very message again to run after about ``countdown`` seconds, ending this
        delivery (`Ignore`); where the broker does not take it, wait here instead (`wait_instead`,
        ``outcome`` the one deferred)."""
        if self.request.is_eager:
            return LockNotAcquired(self.claim.key, why)
        error = self.publish_again(countdown, headers)
        if error is not None:
            return self.wait_instead(outcome, why, error)
        self.log(logging.INFO, "deferred by about %.1fs: %s", countdown, why)
        deferred: BaseException = Ignore()
        return deferred

    def publish_again(
        self, countdown: float, headers: dict[str, Any] | None = None
    ) -> Exception | None:
        """Publish this very message again (same id, attempt, message identity and options) to
        run after ``countdown`` seconds and up to half a second more: None once the broker took
        it, else what the producer raised (the broker refused it, or could not be reached)."""
        message_headers = {**(self.request.headers or {}), DEFERRED_HEADER: True, **(headers or {})}
        countdown += random.uniform(0.0, 0.5)  # copies published together come back apart
        try:
            again = self.task.signature_from_request(
                self.request, countdown=countdown, headers=message_headers
            )
            again.apply_async()
        except Exception as error:
            return error
        return None

    def skip(self, skipped: DuplicateSkipped) -> Ignore:
        """Store the skip as REVOKED (Celery's only finished state meaning "will not run"), so a
        caller's ``AsyncResult.get()`` raises ``skipped`` instead of hanging, and count it for the
        run's chord, which would otherwise wait for ever."""
        task, request = self.task, self.request
        if request.is_eager or not self.can_publish:
            return Ignore()
        with contextlib.suppress(NotImplementedError):  # no result backend configured
            if self.stores_results():
                task.backend.store_result(request.id, skipped, states.REVOKED, request=request)
            if request.chord:
                task.backend.on_chord_part_return(request, states.REVOKED, skipped)
        events.announce_revoked(task, request.id)
        return Ignore()

    def retry(self, outcome: Outcome, holder: Owner | None) -> Step:
        """Celery's retry, backing off exponentially from one second, never beyond the holder's
        remaining lock life; where the broker does not take it, wait here instead
        (`wait_instead`); `LockNotAcquired` once the task's retries are spent."""
        assert isinstance(outcome, Held)
        self.report_duplicate("retry", holder)
        holder_text = self.holder_text(outcome)
        backoff = 2.0 ** (self.request.retries or 0)
        countdown = jittered(max(min(outcome.expires_in, backoff), 0.1))
        self.log(
            logging.INFO,
            "retrying in %.1fs: lock %s is held by %s",
            countdown,
            self.claim.key,
            holder_text,
        )
        refused = LockNotAcquired(self.claim.key, holder_text)
        try:
            retried: BaseException = self.task.retry(exc=refused, countdown=countdown, throw=False)
        except Reject as rejected:  # Celery's answer when the broker did not take the retry
            return self.wait_instead(outcome, "retrying", rejected.reason)
        except LockNotAcquired as spent:  # max_retries reached: Celery raises the error given
            return spent
        return retried

    def refusal(self, outcome: Outcome, holder: Owner | None) -> Exception:
        """The error to end with (``"raise"``): no quorum, or held by another call."""
        if isinstance(outcome, Unavailable):
            self.report(signals.lock_unavailable, policy=self.plan.on_unavailable)
            return outcome.error
        self.report_duplicate("raise", holder)
        return LockNotAcquired(self.claim.key, self.holder_text(outcome))

    def log(self, level: int, message: str, *args: object) -> None:
        """Log ``message`` about this run, after ``task <name>[<id>]``."""
        logger.log(level, "task %s[%s] " + message, self.task.name, self.task_id, *args)

    def stores_results(self) -> bool:
        return not (self.task.ignore_result or getattr(self.request, "ignore_result", False))

    def holder_text(self, outcome: Outcome) -> str:
        return describe_holder(outcome.holder if isinstance(outcome, Held) else None)

    def report_duplicate(self, policy: str, holder: Owner | None) -> None:
        holder_json = holder.to_json() if holder is not None else None
        self.report(signals.lock_duplicate, policy=policy, holder=holder_json)

    def report(self, signal: Signal, **fields: Any) -> None:
        events.report(self.task, signal, self.task_id, key=self.claim.key, **fields)


def release_leftovers(sender: Any = None, task: Any = None, state: str = "", **_: Any) -> None:
    """``task_postrun`` handler (connected by `wiring`): finish what the run that just ended
    left registered on its request."""
    task = task or sender
    run: Run | None = getattr(getattr(task, "request", None), RUN_ATTRIBUTE, None)
    if run is not None:
        run.finish(state or states.FAILURE)


def current_run(task: Any) -> Run | None:
    """The run of ``task`` under way in this thread. A plain function call's run sits on the
    request it pushed, below the one Celery's ``Task.__call__`` pushes for the body (which
    older Celery versions do not copy it into)."""
    for request in reversed(task.request_stack.stack or ()):
        run: Run | None = getattr(request, RUN_ATTRIBUTE, None)
        if run is not None:
            return run
    return None


def state_after(error: BaseException) -> str:
    for kind, state in ((Retry, states.RETRY), (Ignore, states.IGNORED), (Reject, states.REJECTED)):
        if isinstance(error, kind):
            return str(state)
    return str(states.FAILURE)
