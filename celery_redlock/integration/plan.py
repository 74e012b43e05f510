"""A singleton task's lock options, checked when the task class is defined and filled in from the
app's settings once per task (`TaskPlan`): what does not change from one run to the next."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from ..lock.owner import RunOwnerTexts
from ..lock.redlock import check_ttl
from ..settings import (
    DUPLICATE_POLICIES,
    UNAVAILABLE_POLICIES,
    check_boolean,
    check_policy,
    check_seconds,
    closest_name,
    redelivery_window,
)
from .keys import KeyRecipe, LockKey, check_key_options, run_signature
from .runtime import AppRuntime

LOCK_OPTIONS = (
    "lock_ttl",
    "lock_auto_extend",
    "lock_args",
    "lock_key",
    "on_duplicate",
    "on_unavailable",
    "lock_wait",
    "lock_hold",
    "lock_on_enqueue",
)
MISSPELLING_CUTOFF = 0.8
"""How close (difflib's ratio) a new name must be to a lock option to be refused as its typo:
``lock_tll`` (0.88) and ``on_dupliacte`` (0.92) are; a task's own ``lock`` (0.67) is not."""


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
    replaces_claims: bool
    redelivery_window: float  # the broker's visibility_timeout (`settings.redelivery_window`)


def make_plan(task: Any) -> TaskPlan:
    """``task``'s lock options with its app's settings applied; raises `ConfigurationError`."""
    runtime = AppRuntime.for_app(task.app)
    settings = runtime.settings
    ttl = float(task.lock_ttl if task.lock_ttl is not None else settings.ttl)
    check_ttl(runtime.redlock, ttl, name=f"lock_ttl of task {task.name!r}")
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
        redelivery_window=redelivery_window(conf.get("broker_transport_options")),
        replaces_claims=bool(task.lock_on_enqueue),
    )


def _seconds_or_none(value: Any) -> float | None:
    return float(value) if value else None


def check_class_options(task_class: type) -> None:
    """Raise `ConfigurationError` for a lock option of ``task_class`` that no setting can make
    valid (called when a `SingletonTask` subclass is defined)."""
    options: Any = task_class
    name = getattr(task_class, "name", None) or task_class.__name__
    check_option_names(task_class, name)
    if options.lock_ttl is not None:
        check_seconds(f"lock_ttl of task {name!r}", options.lock_ttl)
    if options.lock_wait is not None:
        check_seconds(f"lock_wait of task {name!r}", options.lock_wait)
    check_seconds(f"lock_hold of task {name!r}", options.lock_hold, allow_zero=True)
    if options.on_duplicate is not None:
        check_policy(f"on_duplicate of task {name!r}", options.on_duplicate, DUPLICATE_POLICIES)
    if options.on_unavailable is not None:
        check_policy(
            f"on_unavailable of task {name!r}", options.on_unavailable, UNAVAILABLE_POLICIES
        )
    check_boolean(f"lock_on_enqueue of task {name!r}", options.lock_on_enqueue)
    if options.lock_auto_extend is not None:
        check_boolean(f"lock_auto_extend of task {name!r}", options.lock_auto_extend)
    lock_key: LockKey = options.lock_key
    if lock_key is not None and not (isinstance(lock_key, str) or callable(lock_key)):
        raise ConfigurationError(
            f"lock_key of task {name!r} must be a str.format template or a callable returning "
            f"a str, got {lock_key!r}"
        )
    if inspect.isfunction(task_class.__dict__.get("lock_key")):
        # A function stored on the class would be bound as a method and get the task as its
        # first argument; lock_key callables take the call's arguments only.
        options.lock_key = staticmethod(task_class.__dict__["lock_key"])
    lock_args = options.lock_args
    if lock_args is not None and not isinstance(lock_args, (list, tuple)):
        raise ConfigurationError(
            f"lock_args of task {name!r} must be a tuple of parameter names "
            f"(e.g. lock_args=('account_id',)), got {lock_args!r}"
        )
    signature = run_signature(task_class) if "run" in task_class.__dict__ else None
    check_key_options(signature, lock_args, options.lock_key, name)


def check_option_names(task_class: type, name: str) -> None:
    """Raise `ConfigurationError` for a name ``task_class`` adds to its bases (a task option or
    class attribute) that is close to a lock option: a typo would silently keep the default."""
    inherited = {attribute for base in task_class.__mro__[1:] for attribute in dir(base)}
    for attribute in task_class.__dict__:
        if attribute in inherited or attribute.startswith("__"):
            continue
        match = closest_name(attribute, LOCK_OPTIONS, MISSPELLING_CUTOFF)
        if match is not None:
            raise ConfigurationError(
                f"task {name!r} got {attribute!r}, which is no lock option (did you mean "
                f"{match!r}?); a misspelled option would leave the default in force"
            )
