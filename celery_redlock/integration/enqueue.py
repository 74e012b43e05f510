"""Enqueue-time de-duplication (``lock_on_enqueue=True``): ``apply_async`` claims the run's lock
on behalf of the new task id and answers a duplicate call with the queued or running call's
``AsyncResult``; the run of that id takes its claim over (`run`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery.utils import uuid

from ..lock.outcomes import Acquired, Held, Lock, Unavailable
from ..lock.owner import Owner
from .keys import as_delivered
from .messages import DEFERRED_HEADER

logger = logging.getLogger(__name__)

CANVAS_OPTIONS = ("link", "link_error", "chain", "chord", "group_id")
# Options Celery passes when it publishes the continuation of a run already under way.
CONTINUATION_OPTIONS = ("retries", "replaced_task_nesting", "parent_id")


@dataclass(frozen=True)
class Claim:
    """What an enqueue found: the id to queue under with the claim taken for it (``lock``, None
    when none could be taken), or the id of the same call already queued or running."""

    task_id: str
    lock: Lock | None = None
    existing_id: str | None = None


def needs_claim(task: Any, options: dict[str, Any]) -> bool:
    """Whether this ``apply_async`` call is de-duplicated at enqueue: not for continuations and
    our own deferrals (always queued), nor for calls with canvas options (logged)."""
    if (
        not task.lock_on_enqueue
        or task.app.conf.task_always_eager
        or any(options.get(name) for name in CONTINUATION_OPTIONS)
        or DEFERRED_HEADER in (options.get("headers") or {})
    ):
        return False
    if any(options.get(name) for name in CANVAS_OPTIONS):
        logger.info(
            "queueing %s without enqueue de-duplication: the call has callbacks, errbacks or "
            "chord options, which another call's result would not carry",
            task.name,
        )
        return False
    return True


def claim(
    task: Any,
    args: Sequence[Any] | None,
    kwargs: dict[str, Any] | None,
    task_id: str | None,
    options: dict[str, Any],
) -> Claim:
    """Claim the call's lock for a new task id (see the module docstring). When no quorum
    answers, the call is queued without a claim and the run's own lock guards it."""
    plan = task.lock_plan
    serializer = options.get("serializer") or task.serializer or task.app.conf.task_serializer
    delivered_args, delivered_kwargs = as_delivered(args or (), kwargs or {}, serializer)
    resource = plan.recipe.resource(delivered_args, delivered_kwargs)
    new_id = task_id or uuid()
    owner = Owner.here(task.name, new_id, queued=True).to_text()
    outcome = plan.runtime.redlock.attempt(resource, plan.ttl, owner)
    if isinstance(outcome, Held):
        holder = Owner.parse(outcome.holder)
        if holder is not None and holder.id is not None and holder.id != new_id:
            logger.info(
                "not queueing %s: the same call is already queued or running as %s",
                task.name,
                holder.id,
            )
            return Claim(new_id, existing_id=holder.id)
    if isinstance(outcome, Unavailable):
        logger.warning(
            "queueing %s[%s] without enqueue de-duplication: %s", task.name, new_id, outcome.error
        )
    return Claim(new_id, outcome.lock if isinstance(outcome, Acquired) else None)
