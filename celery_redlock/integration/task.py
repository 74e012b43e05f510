"""`SingletonTask` and `singleton_task`: Celery tasks that run at most once at a time per key.
The task class holds the lock options and what users call; one run is `run.Run`."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

from celery import Task, shared_task
from celery.platforms import EX_FAILURE

from .. import signals
from ..errors import ConfigurationError, RedlockError
from ..lock.outcomes import Lock
from . import enqueue
from .keys import LockKey
from .messages import new_message_after_the_end
from .plan import TaskPlan, check_class_options, make_plan
from .process_loss import LockAwareRequest
from .run import Run, current_run

logger = logging.getLogger(__name__)


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task that holds a Redlock, keyed by its name and arguments, while it runs.

    Lock options are class attributes (or ``app.task(base=SingletonTask, ...)`` /
    ``@singleton_task(...)`` keyword arguments); ``None`` means "use the app's setting".
    Options are checked when the task is defined, and against the settings when the worker
    starts (a worker with a bad option or setting refuses to start).
    """

    # Frees the lock from the worker's main process when the process running the task is lost.
    Request = LockAwareRequest

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
        check_class_options(cls)

    @functools.cached_property
    def lock_plan(self) -> TaskPlan:
        """This task's lock options with the app's settings applied (validated on first use)."""
        return make_plan(self)

    def lock_key_for(self, *args: Any, **kwargs: Any) -> str:
        """The Redis key a call with these arguments locks (under the key prefix)."""
        plan = self.lock_plan
        return plan.runtime.redlock.key_for(plan.recipe.resource(args, kwargs))

    @property
    def lock(self) -> Lock | None:
        """The `Lock` held by the current run, or None."""
        run = current_run(self)
        return run.kept.lock if run is not None and run.kept is not None else None

    def extend_lock(self, ttl: float | None = None) -> bool:
        """Extend the current run's lock now (to ``ttl`` seconds, default the lock ttl), never past
        the run's hard time limit. True once a majority extended it, False when no majority
        answered but the lock is still valid; raises `LockLost` when the lock is gone, so a long
        task can stop at its next step."""
        run = current_run(self)
        if run is None or run.kept is None:
            raise RedlockError(
                f"{self.name}.extend_lock() was called outside a run that holds a lock; call it "
                "from the task body (a bound task: bind=True) while the run holds its lock"
            )
        extended = run.runtime.keeper.extend_now(run.kept, ttl)
        if extended:
            run.report(signals.lock_extended, validity=run.kept.lock.validity)
        return extended

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's `Task.retry`. From the body, the run notes first that a later attempt of its
        message may be on its way, so that its end never records the message as ended for good
        (which would take that attempt for a copy of a finished message: `run.LAST_RETRIES`);
        after a body that did end it (from ``on_failure``, say), the retry is a new message."""
        run = current_run(self)
        if run is not None:
            run.may_retry = True
        else:
            new_message_after_the_end(self.request)
        return super().retry(*args, **kwargs)

    def start_strategy(self, app: Any, consumer: Any, **kwargs: Any) -> Any:
        """Check the settings and options when the worker starts: a bad one stops the worker, with
        one log line naming the setting and the fix, instead of failing every run later."""
        try:
            self.lock_plan.runtime.check_nodes()
        except ConfigurationError as error:
            logger.critical("celery_redlock configuration error, the worker stops: %s", error)
            # Celery logs any other exception with a traceback that buries the message.
            raise SystemExit(EX_FAILURE) from None
        return super().start_strategy(app, consumer, **kwargs)

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        task_id: str | None = None,
        **options: Any,
    ) -> Any:
        """Queue the task; with ``lock_on_enqueue``, return the queued or running call's
        ``AsyncResult`` instead of queueing a duplicate (which calls are: `enqueue.needs_claim`)."""
        if not enqueue.needs_claim(self, options):
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        found = enqueue.claim(self, args, kwargs, task_id, options)
        if found.existing_id is not None:
            return self.AsyncResult(found.existing_id)
        try:
            return super().apply_async(args, kwargs, task_id=found.task_id, **options)
        except BaseException:
            if found.lock is not None:  # never queued: later calls must not get this id back
                with contextlib.suppress(RedlockError):
                    self.lock_plan.runtime.redlock.release(found.lock)
            raise

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.lock_plan
        if not self.request.called_directly:
            return Run(self, plan, self.request, plan.recipe.resource(args, kwargs)).execute(
                args, kwargs
            )
        # A plain function call: a request of its own holds the run (Celery's default request
        # is shared by threads), and Celery's own __call__ runs the body, which sees it.
        self.push_request(args=args, kwargs=kwargs)
        try:
            run = Run(self, plan, self.request, plan.recipe.resource(args, kwargs))
            body = super().__call__
            return run.execute(args, kwargs, lambda: body(*args, **kwargs))
        finally:
            self.pop_request()


def singleton_task(*args: Any, app: Any = None, **options: Any) -> Any:
    """Like ``celery.shared_task`` (or ``app.task`` with ``app=``), making a `SingletonTask`.

    Works bare (``@singleton_task``) and with options; every Celery task option passes through,
    and the lock options (``lock_ttl``, ``lock_args``, ``on_duplicate``, ...) are accepted too.
    """
    if args and (len(args) > 1 or not callable(args[0])):
        shown = ", ".join(repr(argument) for argument in args)
        raise ConfigurationError(
            f"singleton_task({shown}): the only positional argument it takes is the task "
            "function (@singleton_task); give the app and the options by name, e.g. "
            "@singleton_task(app=app, lock_ttl=60)"
        )
    base = options.setdefault("base", SingletonTask)
    if not (isinstance(base, type) and issubclass(base, SingletonTask)):
        raise ConfigurationError(
            f"singleton_task(base={base!r}): the base must be SingletonTask or a subclass of it"
        )
    if app is None:
        return shared_task(*args, **options)
    return app.task(*args, **options)
