"""`SingletonTask` and `singleton_task`: Celery tasks that run at most once at a time per key.

One run, top to bottom (`SingletonTask.__call__`, in the worker, right before the body — so
``delay``, ``apply_async``, ``send_task``, beat, canvas and retries are all covered):

1. the call's lock key (`TaskPlan`, computed once per task);
2. one attempt at the lock, carrying the run's attempt number (``replaced_task_nesting``,
   ``retries``) so that the task id's completion marker can answer "this attempt already ran";
3. one place maps the outcome to what the run does (`_decide`): acquired — run; completed —
   acknowledge without running; held — by whom? A redelivered copy of this very attempt is
   deferred until the holder is gone, a continuation (our own retry or replacement, or a task
   the holder sent) waits for its predecessor, anything else follows ``on_duplicate``; no
   quorum — ``on_unavailable``, waiting for the nodes without spending the task's retries;
4. the body runs while the lock keeper extends the lock;
5. the moment the body ends, one round releases the lock (or keeps it ``lock_hold`` seconds)
   and records the attempt as completed — before Celery publishes callbacks, the next chain
   step or a chord's body, which may need the same lock.

Nothing that acknowledges a message without running its body happens unless the body ran
elsewhere, will run from a message published first (a deferral), or a policy the user chose
skipped a true duplicate.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from celery import Task, shared_task, states
from celery._state import _task_stack
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid

from . import events, keyspace, signals, wiring
from .errors import (
    AlreadyCompleted,
    ConfigurationError,
    DuplicateCoalesced,
    DuplicateSkipped,
    LockNotAcquired,
    QuorumUnavailable,
    RedlockError,
)
from .keeper import KeptLock
from .keys import KeyRecipe, LockKey, as_delivered, check_key_options, run_signature
from .owner import Owner, RunOwnerTexts, claim_prefix, describe_holder
from .redlock import (
    Acquired,
    Contended,
    Covered,
    Held,
    Lock,
    Outcome,
    Record,
    Unavailable,
    jittered,
    new_token,
)
from .runtime import RUN_ATTRIBUTE, AppRuntime, RunLock
from .settings import (
    DUPLICATE_POLICIES,
    UNAVAILABLE_POLICIES,
    check_boolean,
    check_policy,
    check_seconds,
)

logger = logging.getLogger(__name__)

IN_PROCESS_WAIT = 5.0
"""Seconds a continuation waits for its predecessor's release, or a split vote for a decision,
before the message is deferred (published again with a countdown) to free the pool process."""

UNAVAILABLE_PATIENCE = 10.0
"""Seconds a run waits in its pool process for a quorum of lock nodes before it is deferred."""

UNAVAILABLE_LONGEST_PAUSE = 0.5
"""The longest pause between two attempts while no quorum answers (jittered up to 0.75 s): with
the nodes' own back-off of at most 0.5 s, runs start within about a second of their return."""

DEFERRED_HEADER = "celery_redlock_deferred"
"""Message header of a run published again by this library (never de-duplicated at enqueue)."""

UNAVAILABLE_SINCE_HEADER = "celery_redlock_unavailable_since"
"""Message header: when a run first found no quorum (``redlock_unavailable_timeout`` counts
from then, across deferrals)."""


# Canvas options whose work would be dropped if the call were answered with another call's
# result: such calls are always queued.
_CANVAS_OPTIONS = ("link", "link_error", "chain", "chord", "group_id")
# Options Celery passes when it publishes the continuation of a run already under way.
_CONTINUATION_OPTIONS = ("retries", "replaced_task_nesting", "parent_id")


@dataclass(frozen=True)
class TaskPlan:
    """A task's lock options with the app's settings filled in, computed once per task."""

    runtime: AppRuntime
    recipe: KeyRecipe
    ttl: float
    auto_extend: bool
    on_duplicate: str
    on_unavailable: str
    wait: float
    hold: float
    hard_time_limit: float | None
    soft_time_limit: float | None
    owner_texts: RunOwnerTexts

    def resource(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        """The lock resource of one call (`LockKeyError` when it cannot be derived)."""
        return self.recipe.resource(args, kwargs)


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task that holds a Redlock, keyed by its name and arguments, while it runs.

    Lock options are class attributes (or ``app.task(base=SingletonTask, ...)`` /
    ``@singleton_task(...)`` keyword arguments); ``None`` means "use the app's setting".
    Options are checked when the task is defined, and against the settings when the worker
    starts (a worker with a bad option or setting refuses to start).
    """

    abstract = True
    # Frees the lock from the worker's main process when the process running the task is lost.
    Request = wiring.LockAwareRequest

    lock_ttl: ClassVar[float | None] = None
    lock_auto_extend: ClassVar[bool | None] = None
    lock_args: ClassVar[Sequence[str] | None] = None
    lock_key: ClassVar[LockKey] = None
    on_duplicate: ClassVar[str | None] = None
    on_unavailable: ClassVar[str | None] = None
    lock_wait: ClassVar[float | None] = None
    lock_hold: ClassVar[float] = 0.0
    lock_on_enqueue: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_class_options(cls)

    # -- what users call ---------------------------------------------------------------------

    @property
    def lock_plan(self) -> TaskPlan:
        """This task's lock options with the app's settings applied (validated on first use)."""
        plan: TaskPlan | None = self.__dict__.get("_celery_redlock_plan")
        if plan is None:
            plan = _make_plan(self)
            self.__dict__["_celery_redlock_plan"] = plan
        return plan

    def lock_key_for(self, *args: Any, **kwargs: Any) -> str:
        """The Redis key a call with these arguments locks (under the key prefix)."""
        plan = self.lock_plan
        return plan.runtime.redlock.key_for(plan.resource(args, kwargs))

    @property
    def lock(self) -> Lock | None:
        """The `Lock` held by the current run, or None."""
        run: RunLock | None = getattr(self.request, RUN_ATTRIBUTE, None)
        return run.lock if run is not None and run.kept is not None else None

    def extend_lock(self, ttl: float | None = None) -> bool:
        """Extend the current run's lock now (to ``ttl`` seconds, default the lock ttl).

        Returns True once a majority extended it, False when no majority answered but the lock
        is still valid; raises `LockLost` when the lock is gone, so a long task can stop at its
        next step. Never extends past the run's hard time limit.
        """
        run: RunLock | None = getattr(self.request, RUN_ATTRIBUTE, None)
        if run is None or run.kept is None:
            raise RedlockError(
                f"{self.name}.extend_lock() was called outside a run that holds a lock; call it "
                "from the task body (a bound task: bind=True) while the run holds its lock"
            )
        extended = run.runtime.keeper.extend_now(run.kept, ttl)
        if extended:
            events.report(
                self,
                signals.lock_extended,
                run.task_id,
                key=run.lock.key,
                validity=run.lock.validity,
            )
        return extended

    def start_strategy(self, app: Any, consumer: Any, **kwargs: Any) -> Any:
        """Check the settings and this task's options when the worker starts (in its main
        process): an error here stops the worker instead of failing every run later."""
        plan = self.lock_plan
        plan.runtime.check_nodes()
        return super().start_strategy(app, consumer, **kwargs)

    # -- enqueue-time de-duplication (lock_on_enqueue=True) ----------------------------------

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        task_id: str | None = None,
        **options: Any,
    ) -> Any:
        """Queue the task; with ``lock_on_enqueue``, return the queued or running call's
        ``AsyncResult`` instead of queueing a duplicate.

        The enqueue claims the run's lock on behalf of the new task id; the run takes it over.
        Retries, replacements and other continuations are always queued, and so are calls with
        callbacks, errbacks or chord options (answering them with another call's result would
        drop those). When no quorum answers, the call is queued and the run lock guards it.
        """
        if (
            not self.lock_on_enqueue
            or self.app.conf.task_always_eager
            or any(options.get(name) for name in _CONTINUATION_OPTIONS)
            or DEFERRED_HEADER in (options.get("headers") or {})
        ):
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        if any(options.get(name) for name in _CANVAS_OPTIONS):
            logger.info(
                "queueing %s without enqueue de-duplication: the call has callbacks, errbacks or "
                "chord options, which another call's result would not carry",
                self.name,
            )
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        plan = self.lock_plan
        redlock = plan.runtime.redlock
        serializer = options.get("serializer") or self.serializer or self.app.conf.task_serializer
        delivered_args, delivered_kwargs = as_delivered(args or (), kwargs or {}, serializer)
        resource = plan.resource(delivered_args, delivered_kwargs)
        new_id = task_id or uuid()
        owner = Owner.here(self.name, new_id, queued=True).to_text()
        outcome = redlock.attempt(resource, plan.ttl, owner)
        if isinstance(outcome, Held):
            holder = Owner.parse(outcome.holder)
            if holder is not None and holder.id is not None and holder.id != new_id:
                logger.info(
                    "not queueing %s: the same call is already queued or running as %s",
                    self.name,
                    holder.id,
                )
                return self.AsyncResult(holder.id)
        if isinstance(outcome, Unavailable):
            logger.warning(
                "queueing %s[%s] without enqueue de-duplication: %s",
                self.name,
                new_id,
                outcome.error,
            )
        claim = outcome.lock if isinstance(outcome, Acquired) else None
        try:
            return super().apply_async(args, kwargs, task_id=new_id, **options)
        except BaseException:
            if claim is not None:  # never queued: later calls must not get this id back
                with contextlib.suppress(RedlockError):
                    redlock.release(claim)
            raise

    # -- one run -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.lock_plan
        request = self.request
        resource = plan.resource(args, kwargs)
        if request.called_directly:
            return self._call_directly(plan, resource, args, kwargs)
        run = self._start_run(plan, resource, request)
        try:
            lock = self._decide(plan, run, self._attempt(plan, run))
        except (Ignore, Retry, RedlockError):
            setattr(request, RUN_ATTRIBUTE, None)  # a decision: every round was released
            raise
        if lock is None:  # on_unavailable="run": documented as unguarded
            setattr(request, RUN_ATTRIBUTE, None)
            return self.run(*args, **kwargs)
        self._hold(plan, run, lock, request)
        state = states.FAILURE
        try:
            result = self.run(*args, **kwargs)
            state = states.SUCCESS
            return result
        except BaseException as error:
            state = _state_after(error)
            raise
        finally:
            plan.runtime.finish(self, run, state)
            setattr(request, RUN_ATTRIBUTE, None)

    def _start_run(self, plan: TaskPlan, resource: str, request: Any) -> RunLock:
        """The run's lock state, registered on the request before any SET is sent: whatever
        interrupts the acquisition, the ``task_postrun`` handler can release by its token."""
        runtime = plan.runtime
        retries, nesting = request.retries or 0, request.replaced_task_nesting or 0
        facts = events.worker_facts(self.app)
        worker = facts.name if facts is not None else request.hostname
        owner = plan.owner_texts.text(request.id, retries, nesting, worker)
        key = runtime.redlock.key_for(resource)
        lock = Lock(resource, key, new_token(), validity=0.0, ttl=plan.ttl, owner=owner)
        record = None
        if request.id and not request.is_eager and runtime.settings.completed_ttl > 0:
            record = Record(
                keyspace.records_key(key, request.id),
                wiring.message_field(self.name, request),
                (nesting, retries),
                runtime.settings.completed_ttl,
            )
        run = RunLock(runtime, lock, request.id, plan.hold, record, time.monotonic())
        setattr(request, RUN_ATTRIBUTE, run)
        return run

    def _attempt(
        self, plan: TaskPlan, run: RunLock, wait: float = 0.0, rounds: int | None = None
    ) -> Outcome:
        """One attempt for this run (waiting up to ``wait`` seconds for the holder to go; an
        infinite ``wait`` waits as long as it takes), of at most ``rounds`` rounds."""
        redlock = plan.runtime.redlock
        options: dict[str, Any] = {
            "token": run.lock.token,
            "record": run.record,
            "rounds": rounds,
        }
        if self.lock_on_enqueue and run.task_id:
            options["replaces"] = claim_prefix(run.task_id)
        if wait > 0:
            timeout = None if wait == float("inf") else wait
            return redlock.wait_for(
                run.lock.resource, plan.ttl, run.lock.owner, timeout=timeout, **options
            )
        return redlock.attempt(run.lock.resource, plan.ttl, run.lock.owner, **options)

    def _decide(self, plan: TaskPlan, run: RunLock, outcome: Outcome) -> Lock | None:
        """The lock to run with, None to run unguarded (``on_unavailable="run"``), or the
        decision raised: `Ignore` (skipped, completed, deferred), `Retry`, or an error."""
        may_wait = True  # one wait for a holder per delivery; after it, the fallback applies
        while True:
            if isinstance(outcome, Acquired):
                return outcome.lock
            if isinstance(outcome, Covered):
                raise self._completed(run)
            if isinstance(outcome, Unavailable):
                waited = self._wait_for_quorum(plan, run, outcome)
                if waited is None:
                    return None
                outcome = waited
                continue
            outcome = self._on_contention(plan, run, outcome, may_wait)
            may_wait = False

    def _on_contention(
        self, plan: TaskPlan, run: RunLock, outcome: Held | Contended, may_wait: bool
    ) -> Outcome:
        """What a run does when it did not get the lock: wait (returning the next outcome),
        or raise its decision."""
        request = self.request
        if isinstance(outcome, Contended):
            # A split vote is no holder: try again until one side has a majority.
            if may_wait:
                return self._attempt(plan, run, wait=min(plan.ttl, IN_PROCESS_WAIT))
            raise self._defer(run, max(outcome.retry_in, 1.0), "no majority agreed on a holder")
        holder = Owner.parse(outcome.holder)
        relation = _relation(holder, request)
        if relation in ("same", "earlier"):
            # The broker delivered this attempt again while its first copy (or a later attempt)
            # holds the lock — a visibility timeout, a lost connection, a dead host — or the
            # application sent the same task id again: run it once the holder is gone, or
            # acknowledge it then, when the record says this very message completed.
            self._report_duplicate(run, "redelivered", holder)
            raise self._defer(
                run, outcome.expires_in + 0.1, f"its first copy holds the lock ({outcome.holder})"
            )
        if relation == "continuation":
            # Our own retry or replacement, or a task the holder sent, arrived before the
            # holder's release: wait for it, briefly.
            if may_wait:
                return self._attempt(plan, run, wait=min(outcome.expires_in, IN_PROCESS_WAIT))
            raise self._defer(run, outcome.expires_in + 0.1, "its predecessor still holds the lock")
        return self._on_duplicate(plan, run, outcome, holder, may_wait)

    def _on_duplicate(
        self, plan: TaskPlan, run: RunLock, outcome: Held, holder: Owner | None, may_wait: bool
    ) -> Outcome:
        """A true duplicate: another call holds the lock. The ``on_duplicate`` policy decides."""
        request = self.request
        key = run.lock.key
        holder_text = describe_holder(outcome.holder)
        policy = plan.on_duplicate
        if policy == "wait" and not may_wait:
            policy = "retry"  # waited lock_wait seconds already
        if policy == "coalesce":
            return self._coalesce(plan, run, holder_text)
        self._report_duplicate(run, policy, holder)
        if policy == "wait":
            return self._attempt(plan, run, wait=plan.wait)
        if policy == "skip":
            logger.info(
                "task %s[%s] skipped: lock %s is held by %s",
                self.name,
                request.id,
                key,
                holder_text,
            )
            raise self._skip(DuplicateSkipped(key, holder_text))
        if policy == "raise":
            raise LockNotAcquired(key, holder_text)
        # Exponential back-off from one second, never beyond the holder's remaining lock life.
        countdown = jittered(max(min(outcome.expires_in, 2.0 ** (request.retries or 0)), 0.1))
        logger.info(
            "task %s[%s] retrying in %.1fs: lock %s is held by %s",
            self.name,
            request.id,
            countdown,
            key,
            holder_text,
        )
        raise self.retry(exc=LockNotAcquired(key, holder_text), countdown=countdown)

    def _coalesce(self, plan: TaskPlan, run: RunLock, holder_text: str) -> Outcome:
        """``on_duplicate="coalesce"``: at most one run and one pending run per key.

        The first duplicate takes the key's pending slot (a second lock) and waits, woken by the
        release, for the lock itself; it gives the slot up only once it holds the lock, before
        its body starts. A duplicate that finds the slot held by another call merges into it:
        that run starts after this one arrived, so its work covers this one's. Before taking the
        slot a run publishes a deferred copy of itself, so that neither its work nor the work
        merged into it is lost if its process dies (once it has run, the copy is acknowledged as
        completed).
        """
        request = self.request
        runtime = plan.runtime
        resource = run.lock.resource
        try:
            pending = runtime.redlock.reservation_of(resource)
        except QuorumUnavailable as error:
            return Unavailable(error)
        if pending is not None:
            self._join_pending(run, pending, holder_text)  # raises its decision
        if request.is_eager:
            return self._attempt(plan, run, wait=plan.wait)
        self._publish_again(run, plan.ttl + 1.0)
        # The reservation carries the run's own token and owner: while it is held, the lock goes
        # to this run when it frees, never to a newcomer (who merges into this run instead).
        slot = runtime.redlock.reserve(resource, plan.ttl, run.lock.owner, token=run.lock.token)
        if not isinstance(slot, Acquired):
            if isinstance(slot, Held) and run.record is not None:
                # Another duplicate took the slot first: merge into it, and record this attempt
                # as completed so that the copy just published is acknowledged when it comes.
                runtime.redlock.release(run.lock, record=run.record)
                self._join_pending(run, slot, holder_text)
            logger.info(
                "task %s[%s] lost the race for the pending slot of %s; its copy decides later",
                self.name,
                request.id,
                run.lock.key,
            )
            raise Ignore()
        self._report_duplicate(run, "coalesce", None)
        kept = runtime.keeper.keep(slot.lock, _ignore_loss, None, True)
        try:
            return self._attempt(plan, run, wait=float("inf"))
        finally:
            runtime.keeper.stop(kept)
            runtime.redlock.release(slot.lock, confirm=False)

    def _join_pending(self, run: RunLock, pending: Held, holder_text: str) -> None:
        """The pending slot is held: merge into that run, or raise what this delivery is."""
        request = self.request
        owner = Owner.parse(pending.holder)
        relation = _relation(owner, request)
        if relation == "other" and owner is not None:
            self._report_duplicate(run, "coalesced", owner)
            logger.info(
                "task %s[%s] coalesced into the pending run %s of lock %s",
                self.name,
                request.id,
                owner.id,
                run.lock.key,
            )
            raise self._skip(DuplicateCoalesced(run.lock.key, holder_text, into=owner.id))
        raise self._defer(run, pending.expires_in + 0.1, "a copy of it is the pending run")

    def _wait_for_quorum(
        self, plan: TaskPlan, run: RunLock, outcome: Unavailable
    ) -> Outcome | None:
        """No quorum answered. ``"retry"``: wait for one — in this process for a while, then
        deferred — without spending the task's retries, until ``redlock_unavailable_timeout``
        (counted from the first time this call found no quorum) fails the task loudly."""
        request = self.request
        policy = plan.on_unavailable
        events.report(self, signals.lock_unavailable, request.id, key=run.lock.key, policy=policy)
        if policy == "run":
            logger.warning(
                "task %s[%s] runs WITHOUT its lock (on_unavailable='run'): %s",
                self.name,
                request.id,
                outcome.error,
            )
            return None
        if policy == "raise" or request.is_eager:
            raise outcome.error
        since = float((request.headers or {}).get(UNAVAILABLE_SINCE_HEADER) or time.time())
        timeout = plan.runtime.settings.unavailable_timeout
        patience_ends = time.monotonic() + _patience(plan, request)
        logger.warning(
            "task %s[%s] waits for a quorum of lock nodes: %s", self.name, request.id, outcome.error
        )
        pause = 0.05
        while True:
            if timeout is not None and time.time() - since >= timeout:
                logger.error(
                    "task %s[%s] failed: no quorum of lock nodes for %.0fs "
                    "(redlock_unavailable_timeout): %s",
                    self.name,
                    request.id,
                    time.time() - since,
                    outcome.error,
                )
                raise outcome.error
            if time.monotonic() >= patience_ends:
                headers = {UNAVAILABLE_SINCE_HEADER: since}
                why = "no quorum of lock nodes"
                raise self._defer(run, UNAVAILABLE_LONGEST_PAUSE, why, headers)
            time.sleep(jittered(pause))
            pause = min(pause * 2, UNAVAILABLE_LONGEST_PAUSE)
            # One round per try: this loop is the retry, and each round waits for the probes of
            # nodes that were down (one node timeout), so the first try after their return wins.
            next_outcome = self._attempt(plan, run, rounds=1)
            if not isinstance(next_outcome, Unavailable):
                return next_outcome
            outcome = next_outcome

    def _hold(self, plan: TaskPlan, run: RunLock, lock: Lock, request: Any) -> None:
        """Keep the acquired lock alive while the body runs (never past its hard time limit)."""
        hard_limit = _time_limits(plan, request)[0]
        deadline = None if hard_limit is None else time.monotonic() + hard_limit
        task_id = run.task_id

        def on_lost(kept: KeptLock) -> None:
            events.report(
                self, signals.lock_lost, task_id, key=kept.lock.key, reason=kept.lost_reason
            )

        waited = time.monotonic() - run.started
        run.lock = lock
        run.started = time.monotonic()
        run.kept = plan.runtime.keeper.keep(lock, on_lost, deadline, plan.auto_extend)
        events.report(
            self,
            signals.lock_acquired,
            task_id,
            key=lock.key,
            waited=waited,
            fencing_token=lock.fencing_token,
        )

    # -- decisions that end a delivery without running it -----------------------------------

    def _completed(self, run: RunLock) -> Ignore:
        """This very message ran already (the broker delivered it again): acknowledge it without
        running it. The first run's stored result stays; a caller or monitor that knows no final
        state for the id (a forgotten result) gets one: REVOKED, with `AlreadyCompleted`."""
        request = self.request
        logger.info(
            "task %s[%s] already ran (this message, attempt %s); not running it again",
            self.name,
            run.task_id,
            run.record.rank_text if run.record else "?",
        )
        self._report_duplicate(run, "completed", None)
        if not (self.ignore_result or getattr(request, "ignore_result", False)):
            with contextlib.suppress(NotImplementedError):  # no result backend configured
                if self.backend.get_state(request.id) == states.PENDING:
                    error = AlreadyCompleted(run.lock.key, request.id)
                    self.backend.store_result(request.id, error, states.REVOKED, request=request)
        events.announce_revoked(self, request.id)
        return Ignore()

    def _defer(
        self, run: RunLock, countdown: float, why: str, headers: dict[str, Any] | None = None
    ) -> Ignore:
        """Publish this very message again to run after ``countdown`` seconds, and end this
        delivery: the work lives on in the new message."""
        if self.request.is_eager:
            raise LockNotAcquired(run.lock.key, why)
        countdown = self._publish_again(run, countdown, headers)
        logger.info("task %s[%s] deferred by %.1fs: %s", self.name, run.task_id, countdown, why)
        return Ignore()

    def _publish_again(
        self, run: RunLock, countdown: float, headers: dict[str, Any] | None = None
    ) -> float:
        """Publish this very message again (same id, same attempt, every option) to run after
        about ``countdown`` seconds; returns the countdown used."""
        request = self.request
        message_headers = {**(request.headers or {}), DEFERRED_HEADER: True, **(headers or {})}
        countdown += random.uniform(0.0, 0.5)  # copies published together come back apart
        again = self.signature_from_request(request, countdown=countdown, headers=message_headers)
        again.apply_async()
        return countdown

    def _skip(self, skipped: DuplicateSkipped) -> Ignore:
        """Store the skip so a caller waiting on the result gets an answer instead of a hang,
        and count it for a chord the run belongs to, so the chord never waits for ever.

        Celery treats only SUCCESS, FAILURE and REVOKED as finished; REVOKED ("will not run") is
        the one that fits, with `DuplicateSkipped` as the result ``AsyncResult.get()`` raises.
        """
        request = self.request
        if request.is_eager:
            return Ignore()
        stores = not (self.ignore_result or getattr(request, "ignore_result", False))
        with contextlib.suppress(NotImplementedError):  # no result backend configured
            if stores:
                self.backend.store_result(request.id, skipped, states.REVOKED, request=request)
            if request.chord:
                self.backend.on_chord_part_return(request, states.REVOKED, skipped)
        events.announce_revoked(self, request.id)
        return Ignore()

    def _report_duplicate(self, run: RunLock, policy: str, holder: Owner | None) -> None:
        events.report(
            self,
            signals.lock_duplicate,
            run.task_id,
            key=run.lock.key,
            policy=policy,
            holder=holder.to_json() if holder is not None else None,
        )

    # -- a plain function call ---------------------------------------------------------------

    def _call_directly(
        self, plan: TaskPlan, resource: str, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        """``task(...)`` outside a worker (or an errback Celery calls in-process): take the
        lock (waiting with ``"wait"``/``"retry"``), run, release; no retries are possible."""
        runtime = plan.runtime
        owner = Owner.here(self.name, None).to_text()
        wait = plan.wait if plan.on_duplicate in ("wait", "retry", "coalesce") else 0.0
        if wait > 0:
            outcome = runtime.redlock.wait_for(resource, plan.ttl, owner, timeout=wait)
        else:
            outcome = runtime.redlock.attempt(resource, plan.ttl, owner)
        if isinstance(outcome, Unavailable):
            if plan.on_unavailable != "run":
                raise outcome.error
            return self.run(*args, **kwargs)
        if not isinstance(outcome, Acquired):
            key = runtime.redlock.key_for(resource)
            if plan.on_duplicate == "skip":
                logger.info("skipped direct call of %s: lock %s is held", self.name, key)
                return None
            raise LockNotAcquired(key, describe_holder(getattr(outcome, "holder", None)))
        run = RunLock(runtime, outcome.lock, None, 0.0, None, time.monotonic())
        run.kept = runtime.keeper.keep(outcome.lock, _ignore_loss, None, plan.auto_extend)
        # What Task.__call__ does, with the lock in the request (for self.lock and
        # self.extend_lock() in the body).
        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs, **{RUN_ATTRIBUTE: run})
        state = states.FAILURE
        try:
            result = self.run(*args, **kwargs)
            state = states.SUCCESS
            return result
        finally:
            self.pop_request()
            _task_stack.pop()
            runtime.finish(self, run, state)


def _ignore_loss(kept: KeptLock) -> None:
    """Direct calls have no task id to report a loss for (it is logged by the keeper)."""


def _relation(holder: Owner | None, request: Any) -> str:
    """How the lock's holder relates to this delivery: ``"same"`` attempt of this task id,
    an ``"earlier"`` one, a ``"continuation"`` (this is a later attempt of the holder's task id,
    or a task the holder sent), or ``"other"``."""
    if holder is None or holder.id is None or holder.queued:
        return "other"
    if holder.id == request.id:
        mine = (request.replaced_task_nesting or 0, request.retries or 0)
        if mine == holder.attempt:
            return "same"
        return "continuation" if mine > holder.attempt else "earlier"
    if holder.id == request.parent_id:
        return "continuation"
    return "other"


def _state_after(error: BaseException) -> str:
    """The Celery state a body that raised ``error`` ends in."""
    if isinstance(error, Retry):
        return str(states.RETRY)
    if isinstance(error, Ignore):
        return str(states.IGNORED)
    if isinstance(error, Reject):
        return str(states.REJECTED)
    return str(states.FAILURE)


def _time_limits(plan: TaskPlan, request: Any) -> tuple[float | None, float | None]:
    """This run's (hard, soft) time limits: the message's own, else the task's or the app's."""
    hard, soft = getattr(request, "timelimit", None) or (None, None)
    return (
        float(hard) if hard else plan.hard_time_limit,
        float(soft) if soft else plan.soft_time_limit,
    )


def _patience(plan: TaskPlan, request: Any) -> float:
    """How long a run may wait in its process for lock nodes: well within its time limits."""
    limits = [limit for limit in _time_limits(plan, request) if limit]
    return min([UNAVAILABLE_PATIENCE, *(limit / 2 for limit in limits)])


def _seconds_or_none(value: Any) -> float | None:
    return float(value) if value else None


def _make_plan(task: SingletonTask) -> TaskPlan:
    """The task's options with the app's settings applied; raises `ConfigurationError`."""
    runtime = AppRuntime.for_app(task.app)
    settings = runtime.settings
    ttl = float(task.lock_ttl if task.lock_ttl is not None else settings.ttl)
    runtime.redlock.check_ttl(ttl, name=f"lock_ttl of task {task.name!r}")
    conf = task.app.conf
    return TaskPlan(
        runtime=runtime,
        recipe=KeyRecipe(
            task_name=task.name,
            signature=run_signature(type(task)),
            lock_args=None if task.lock_args is None else tuple(task.lock_args),
            lock_key=task.lock_key,
        ),
        ttl=ttl,
        auto_extend=(
            settings.auto_extend if task.lock_auto_extend is None else task.lock_auto_extend
        ),
        on_duplicate=task.on_duplicate or settings.on_duplicate,
        on_unavailable=task.on_unavailable or settings.on_unavailable,
        wait=float(task.lock_wait if task.lock_wait is not None else ttl),
        hold=float(task.lock_hold or 0.0),
        hard_time_limit=_seconds_or_none(
            task.time_limit if task.time_limit is not None else conf.task_time_limit
        ),
        soft_time_limit=_seconds_or_none(
            task.soft_time_limit if task.soft_time_limit is not None else conf.task_soft_time_limit
        ),
        owner_texts=RunOwnerTexts(task.name),
    )


def _check_class_options(cls: type[SingletonTask]) -> None:
    """Raise `ConfigurationError` for a lock option that no setting can make valid."""
    name = getattr(cls, "name", None) or cls.__name__
    if cls.lock_ttl is not None:
        check_seconds(f"lock_ttl of task {name!r}", cls.lock_ttl)
    if cls.lock_wait is not None:
        check_seconds(f"lock_wait of task {name!r}", cls.lock_wait)
    check_seconds(f"lock_hold of task {name!r}", cls.lock_hold, allow_zero=True)
    if cls.on_duplicate is not None:
        check_policy(f"on_duplicate of task {name!r}", cls.on_duplicate, DUPLICATE_POLICIES)
    if cls.on_unavailable is not None:
        check_policy(f"on_unavailable of task {name!r}", cls.on_unavailable, UNAVAILABLE_POLICIES)
    check_boolean(f"lock_on_enqueue of task {name!r}", cls.lock_on_enqueue)
    if cls.lock_auto_extend is not None:
        check_boolean(f"lock_auto_extend of task {name!r}", cls.lock_auto_extend)
    if cls.lock_key is not None and not (isinstance(cls.lock_key, str) or callable(cls.lock_key)):
        raise ConfigurationError(
            f"lock_key of task {name!r} must be a str.format template or a callable returning "
            f"a str, got {cls.lock_key!r}"
        )
    if inspect.isfunction(cls.__dict__.get("lock_key")):
        # A function stored on the class would be bound as a method and get the task as its
        # first argument; lock_key callables take the call's arguments only.
        cls.lock_key = staticmethod(cls.__dict__["lock_key"])
    if cls.lock_args is not None and (
        isinstance(cls.lock_args, str) or not isinstance(cls.lock_args, (list, tuple))
    ):
        raise ConfigurationError(
            f"lock_args of task {name!r} must be a tuple of parameter names "
            f"(e.g. lock_args=('account_id',)), got {cls.lock_args!r}"
        )
    signature = run_signature(cls) if "run" in cls.__dict__ else None
    check_key_options(signature, cls.lock_args, cls.lock_key, name)


def singleton_task(*args: Any, app: Any = None, **options: Any) -> Any:
    """Like ``celery.shared_task`` (or ``app.task`` with ``app=``), making a `SingletonTask`.

    Works bare (``@singleton_task``) and with options; every Celery task option passes through,
    and the lock options (``lock_ttl``, ``lock_args``, ``on_duplicate``, ...) are accepted too.
    """
    base = options.setdefault("base", SingletonTask)
    if not (isinstance(base, type) and issubclass(base, SingletonTask)):
        raise ConfigurationError(
            f"singleton_task(base={base!r}): the base must be SingletonTask or a subclass of it"
        )
    if app is None:
        return shared_task(*args, **options)
    return app.task(*args, **options)
