"""`SingletonTask` and `singleton_task`: Celery tasks that run at most once at a time per key.

The lock is taken in the worker right before the body runs (so ``delay``, ``apply_async``,
``send_task``, beat, canvas and retries are all covered), kept alive while the body runs, and
released by the ``task_postrun`` handler in `celery_redlock.wiring` whatever the outcome.
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
from celery.exceptions import Ignore
from celery.utils import uuid

from . import signals, wiring
from .errors import (
    ConfigurationError,
    DuplicateSkipped,
    LockNotAcquired,
    QuorumUnavailable,
    RedlockError,
)
from .extension import KeptLock
from .keys import LockKey, check_lock_args, resource_for_call
from .redlock import Contention, Lock
from .runtime import (
    AppRuntime,
    HeldLock,
    describe_owner,
    owner_text,
    parse_owner,
    queued_fragment,
)
from .settings import DUPLICATE_POLICIES, UNAVAILABLE_POLICIES, check_policy, check_positive

logger = logging.getLogger(__name__)

HELD_ATTRIBUTE = wiring.HELD_ATTRIBUTE


@dataclass(frozen=True)
class LockPlan:
    """A task's lock options with the app's settings filled in."""

    ttl: float
    auto_extend: bool
    lock_args: tuple[str, ...] | None
    lock_key: LockKey
    on_duplicate: str
    on_unavailable: str
    wait: float
    hold: float
    time_limit: float | None  # the task's (or app's) hard time limit, when the message has none


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task that holds a Redlock, keyed by its name and arguments, while it runs.

    Lock options are class attributes (or ``app.task(base=SingletonTask, ...)`` /
    ``@singleton_task(...)`` keyword arguments); ``None`` means "use the app's setting".
    """

    abstract = True
    # Frees the lock from the worker's main process when the process running the task is lost.
    Request = "celery_redlock.wiring:LockAwareRequest"

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
        name = getattr(cls, "name", None) or cls.__name__
        if cls.lock_ttl is not None:
            check_positive(f"lock_ttl of task {name!r}", cls.lock_ttl)
        if cls.lock_wait is not None:
            check_positive(f"lock_wait of task {name!r}", cls.lock_wait)
        if cls.lock_hold != 0:
            check_positive(f"lock_hold of task {name!r}", cls.lock_hold)
        if cls.on_duplicate is not None:
            check_policy(f"on_duplicate of task {name!r}", cls.on_duplicate, DUPLICATE_POLICIES)
        if cls.on_unavailable is not None:
            check_policy(
                f"on_unavailable of task {name!r}", cls.on_unavailable, UNAVAILABLE_POLICIES
            )
        if cls.lock_on_enqueue not in (True, False):
            raise ConfigurationError(
                f"lock_on_enqueue of task {name!r} must be True or False, "
                f"got {cls.lock_on_enqueue!r}"
            )
        if cls.lock_auto_extend not in (None, True, False):
            raise ConfigurationError(
                f"lock_auto_extend of task {name!r} must be True or False, "
                f"got {cls.lock_auto_extend!r}"
            )
        if cls.lock_key is not None and not (
            isinstance(cls.lock_key, str) or callable(cls.lock_key)
        ):
            raise ConfigurationError(
                f"lock_key of task {name!r} must be a str.format template or a callable "
                f"returning a str, got {cls.lock_key!r}"
            )
        if inspect.isfunction(cls.__dict__.get("lock_key")):
            # A function stored on the class would be bound as a method and get the task as its
            # first argument; lock_key callables take the call's arguments only.
            cls.lock_key = staticmethod(cls.__dict__["lock_key"])
        if cls.lock_args is not None:
            if isinstance(cls.lock_args, str) or not isinstance(cls.lock_args, (list, tuple)):
                raise ConfigurationError(
                    f"lock_args of task {name!r} must be a tuple of parameter names "
                    f"(e.g. lock_args=('account_id',)), got {cls.lock_args!r}"
                )
            if "run" in cls.__dict__:
                check_lock_args(_run_signature(cls), cls.lock_args, name)

    # -- inside a run ------------------------------------------------------------------------

    @property
    def lock(self) -> Lock | None:
        """The `Lock` held by the current run, or None."""
        held = getattr(self.request, HELD_ATTRIBUTE, None)
        return held.lock if held is not None else None

    def extend_lock(self, ttl: float | None = None) -> bool:
        """Extend the current run's lock now (to ``ttl`` seconds, default the lock ttl).

        Returns True once a majority extended it; raises `LockLost` when the lock is gone, so
        a long task can stop at its next step. Never extends past the run's hard time limit.
        """
        held: HeldLock | None = getattr(self.request, HELD_ATTRIBUTE, None)
        if held is None:
            raise RedlockError(
                f"{self.name}.extend_lock() was called outside a run that holds a lock; call it "
                "from the task body (a bound task: bind=True) while the run holds its lock"
            )
        extended = held.runtime.keeper.extend_now(held.kept, ttl)
        if extended:
            signals.lock_extended.send(
                sender=self, task_id=held.task_id, key=held.lock.key, validity=held.lock.validity
            )
        return extended

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

        The enqueue takes the run's lock on behalf of the new task id; the run takes it over.
        Retries (same task id) are always queued; when no quorum answers the call is queued and
        the execution-time lock still guards it.
        """
        if not self.lock_on_enqueue or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        runtime = AppRuntime.for_app(self.app)
        plan = self._lock_plan(runtime)
        resource = resource_for_call(
            self.name, self._signature(), args or (), kwargs or {}, plan.lock_args, plan.lock_key
        )
        new_id = task_id or uuid()
        try:
            lock, contention = runtime.redlock.try_acquire(
                resource, plan.ttl, owner_text(self.name, new_id, 0, queued=True)
            )
        except QuorumUnavailable as error:
            logger.warning(
                "queueing %s[%s] without enqueue de-duplication: %s", self.name, new_id, error
            )
            lock = contention = None
        if lock is None and contention is not None:
            holder_id = parse_owner(contention.holder).get("id")
            if isinstance(holder_id, str) and holder_id != new_id:
                logger.info(
                    "not queueing %s: the same call is already queued or running as %s",
                    self.name,
                    holder_id,
                )
                return self.AsyncResult(holder_id)
        return super().apply_async(args, kwargs, task_id=new_id, **options)

    # -- the hook ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        runtime = AppRuntime.for_app(self.app)
        plan = self._lock_plan(runtime)
        resource = resource_for_call(
            self.name, self._signature(), args, kwargs, plan.lock_args, plan.lock_key
        )
        if request.called_directly:
            return self._call_directly(runtime, plan, resource, args, kwargs)
        started = time.monotonic()
        lock = self._acquire_for_run(runtime, plan, resource)
        if lock is None:  # on_unavailable="run": documented as unguarded
            return self.run(*args, **kwargs)
        held = HeldLock(
            runtime, self._keep(runtime, plan, lock), request.id, plan.hold, time.monotonic()
        )
        setattr(request, HELD_ATTRIBUTE, held)
        signals.lock_acquired.send(
            sender=self,
            task_id=request.id,
            key=lock.key,
            waited=held.started - started,
            fencing_token=lock.fencing_token,
        )
        return self.run(*args, **kwargs)

    def _call_directly(
        self,
        runtime: AppRuntime,
        plan: LockPlan,
        resource: str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> Any:
        """A plain function call (``task(...)``): no retries possible, no postrun to release."""
        owner = owner_text(self.name, None, 0)
        wait = plan.wait if plan.on_duplicate in ("wait", "retry") else 0.0
        lock = runtime.redlock.acquire(
            resource, plan.ttl, blocking=wait > 0, timeout=wait, owner=owner
        )
        if lock is None:
            if plan.on_duplicate == "skip":
                logger.info("skipped direct call of %s: lock %s is held", self.name, resource)
                return None
            raise LockNotAcquired(runtime.redlock.key_for(resource))
        held = HeldLock(runtime, self._keep(runtime, plan, lock), None, 0.0, time.monotonic())
        # What Task.__call__ does, with the held lock in the request (for self.lock and
        # self.extend_lock() in the body).
        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs, **{HELD_ATTRIBUTE: held})
        try:
            return self.run(*args, **kwargs)
        finally:
            self.pop_request()
            _task_stack.pop()
            runtime.release(held, states.SUCCESS)

    def _keep(self, runtime: AppRuntime, plan: LockPlan, lock: Lock) -> KeptLock:
        task_id = self.request.id
        hard_limit = self._hard_time_limit(plan)
        deadline = None if hard_limit is None else time.monotonic() + hard_limit

        def on_lost(kept: KeptLock) -> None:
            signals.lock_lost.send(
                sender=self, task_id=task_id, key=kept.lock.key, reason=kept.lost_reason
            )

        return runtime.keeper.keep(lock, on_lost, deadline, plan.auto_extend)

    def _acquire_for_run(self, runtime: AppRuntime, plan: LockPlan, resource: str) -> Lock | None:
        """The lock for this run, or a policy decision raised as Retry / Ignore / an error."""
        request = self.request
        owner = owner_text(self.name, request.id, request.retries or 0)
        key = runtime.redlock.key_for(resource)
        try:
            take_over = queued_fragment(request.id) if self.lock_on_enqueue and request.id else ""
            lock, contention = runtime.redlock.try_acquire(resource, plan.ttl, owner, take_over)
            if lock is not None:
                return lock
            assert contention is not None
            holder = parse_owner(contention.holder)
            if holder.get("id") == request.id and holder.get("id") is not None:
                lock = self._contend_with_own_attempt(
                    runtime, plan, resource, owner, holder, contention
                )
                if lock is not None:
                    return lock
            return self._on_duplicate(runtime, plan, resource, owner, holder, contention)
        except QuorumUnavailable as error:
            return self._on_unavailable(plan, key, error)

    def _contend_with_own_attempt(
        self,
        runtime: AppRuntime,
        plan: LockPlan,
        resource: str,
        owner: str,
        holder: dict[str, Any],
        contention: Contention,
    ) -> Lock | None:
        """The holder has our task id: a redelivered copy of a running task, or our own retry
        arriving before the previous attempt's release."""
        request = self.request
        key = runtime.redlock.key_for(resource)
        if holder.get("retries") == (request.retries or 0) and not holder.get("queued"):
            # The broker redelivered this message (acks_late past visibility_timeout) while the
            # first copy still runs and holds the lock: this copy must not run the task again.
            logger.warning(
                "task %s[%s] redelivered while its first copy still holds lock %s "
                "(%s); not running it twice",
                self.name,
                request.id,
                key,
                describe_owner(holder),
            )
            signals.lock_duplicate.send(
                sender=self, task_id=request.id, key=key, policy="redelivered", holder=holder
            )
            raise Ignore()
        # Our previous attempt is releasing right now: wait for that release, briefly.
        return runtime.redlock.acquire(
            resource,
            plan.ttl,
            blocking=True,
            timeout=min(contention.holder_ttl, plan.ttl),
            owner=owner,
        )

    def _on_duplicate(
        self,
        runtime: AppRuntime,
        plan: LockPlan,
        resource: str,
        owner: str,
        holder: dict[str, Any],
        contention: Contention,
    ) -> Lock:
        request = self.request
        key = runtime.redlock.key_for(resource)
        holder_text = describe_owner(holder)
        policy = plan.on_duplicate
        signals.lock_duplicate.send(
            sender=self, task_id=request.id, key=key, policy=policy, holder=holder
        )
        if policy == "wait":
            lock = runtime.redlock.acquire(
                resource, plan.ttl, blocking=True, timeout=plan.wait, owner=owner
            )
            if lock is not None:
                return lock
            policy = "retry"
            contention = Contention(contention.holder, plan.ttl)
        if policy == "skip":
            logger.info(
                "task %s[%s] skipped: lock %s is held by %s",
                self.name,
                request.id,
                key,
                holder_text,
            )
            self._record_skip(DuplicateSkipped(key, holder_text))
            raise Ignore()
        if policy == "raise":
            raise LockNotAcquired(key, holder_text)
        # Exponential back-off from one second, never beyond the holder's remaining lock life.
        backoff = min(contention.holder_ttl, 2.0 ** (request.retries or 0))
        countdown = random.uniform(0.5, 1.5) * max(backoff, 0.1)
        logger.info(
            "task %s[%s] retrying in %.1fs: lock %s is held by %s",
            self.name,
            request.id,
            countdown,
            key,
            holder_text,
        )
        raise self.retry(exc=LockNotAcquired(key, holder_text), countdown=countdown)

    def _record_skip(self, skipped: DuplicateSkipped) -> None:
        """Store the skip so a caller waiting on the result gets an answer instead of a hang.

        Celery treats only SUCCESS, FAILURE and REVOKED as finished; REVOKED ("will not run") is
        the one that fits, with `DuplicateSkipped` as the result ``AsyncResult.get()`` raises.
        """
        request = self.request
        if (
            request.id is None
            or request.is_eager
            or self.ignore_result
            or getattr(request, "ignore_result", False)
        ):
            return
        with contextlib.suppress(NotImplementedError):  # no result backend configured
            self.backend.store_result(request.id, skipped, states.REVOKED, request=request)

    def _on_unavailable(self, plan: LockPlan, key: str, error: QuorumUnavailable) -> Lock | None:
        request = self.request
        policy = plan.on_unavailable
        signals.lock_unavailable.send(sender=self, task_id=request.id, key=key, policy=policy)
        if policy == "run":
            logger.warning(
                "task %s[%s] runs WITHOUT its lock (on_unavailable='run'): %s",
                self.name,
                request.id,
                error,
            )
            return None
        if policy == "raise":
            raise error
        countdown = random.uniform(0.5, 1.5) * min(60.0, 2.0 ** (request.retries or 0))
        logger.warning("task %s[%s] retrying in %.1fs: %s", self.name, request.id, countdown, error)
        raise self.retry(exc=error, countdown=countdown)

    # -- options -----------------------------------------------------------------------------

    def _lock_plan(self, runtime: AppRuntime) -> LockPlan:
        plan: LockPlan | None = self.__dict__.get("_celery_redlock_plan")
        if plan is None:
            settings = runtime.settings
            ttl = float(self.lock_ttl if self.lock_ttl is not None else settings.ttl)
            runtime.redlock.check_ttl(ttl)
            plan = LockPlan(
                ttl=ttl,
                auto_extend=(
                    settings.auto_extend if self.lock_auto_extend is None else self.lock_auto_extend
                ),
                lock_args=None if self.lock_args is None else tuple(self.lock_args),
                lock_key=self.lock_key,
                on_duplicate=self.on_duplicate or settings.on_duplicate,
                on_unavailable=self.on_unavailable or settings.on_unavailable,
                wait=float(self.lock_wait if self.lock_wait is not None else ttl),
                hold=float(self.lock_hold or 0.0),
                time_limit=_seconds_or_none(
                    self.time_limit
                    if self.time_limit is not None
                    else self.app.conf.task_time_limit
                ),
            )
            self.__dict__["_celery_redlock_plan"] = plan
        return plan

    def _signature(self) -> inspect.Signature:
        signature: inspect.Signature | None = type(self).__dict__.get("_celery_redlock_signature")
        if signature is None:
            signature = _run_signature(type(self))
            type.__setattr__(type(self), "_celery_redlock_signature", signature)
        return signature

    def _hard_time_limit(self, plan: LockPlan) -> float | None:
        """This run's hard time limit: the message's own, else the task's or the app's."""
        timelimit = getattr(self.request, "timelimit", None)
        hard = timelimit[1] if timelimit else None
        if hard is None:
            return plan.time_limit
        return float(hard) if hard else None


def _seconds_or_none(value: Any) -> float | None:
    return float(value) if value else None


def _run_signature(task_class: type) -> inspect.Signature:
    """The signature callers use: without ``self`` for ``bind=True`` tasks."""
    run = inspect.getattr_static(task_class, "run")
    if isinstance(run, staticmethod):
        return inspect.signature(run.__func__)
    signature = inspect.signature(run)
    parameters = list(signature.parameters.values())[1:]
    return signature.replace(parameters=parameters)


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
