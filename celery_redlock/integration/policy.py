"""What a task run does with the outcome of an attempt at its lock: one pure decision.

`decide` maps a `Situation` (the attempt's outcome, how the lock's holder relates to this
delivery, the task's policies, whether the run may still wait in its process or runs eagerly) to
one `Action`, which `run` carries out. It talks to no node and no broker, so every combination is
tested without Redis. The table, in words:

- acquired: run the body; the record says this very message ran: acknowledge it;
- no quorum: ``on_unavailable`` — "run" unguarded, "raise", or "retry": wait for the nodes
  (eager calls, which cannot wait for a worker, raise);
- no majority names a holder (a split vote): wait briefly for a decision, then defer;
- held by a copy of this delivery (the same attempt of the task id, or an earlier one): defer
  until the holder is gone — it may be a redelivery of a message that is still running;
- held by this run's predecessor (a retry or replacement of the holder's task id, or a task the
  holder sent): wait briefly for its release, then defer;
- held by another call (a true duplicate): ``on_duplicate`` decides — "skip", "raise", "retry",
  "coalesce", or "wait" (once per delivery; after that wait, "retry");
- a plain function call (``task(...)``) has no message to publish again: where a delivery would
  defer, retry, coalesce or wait for the nodes, it waits in its thread once, then raises.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ..lock.outcomes import Outcome
from ..lock.owner import Owner

Step = Outcome | BaseException
"""What carrying out an action gives: the outcome of the next attempt, to decide on again, or
how the delivery ends (`Ignore`, `Retry`, `Reject` or an error), for the run to raise."""


class Action(enum.Enum):
    """What the run does next."""

    RUN = "run"
    RUN_UNGUARDED = "run-unguarded"  # on_unavailable="run"
    ACKNOWLEDGE = "acknowledge"  # this very message ran already
    DEFER = "defer"  # publish this message again to run later, ending this delivery
    WAIT = "wait"  # in this process, for the holder's release (or a decision); then decide again
    WAIT_FOR_NODES = "wait-for-nodes"  # in this process a while, then deferred
    SKIP = "skip"
    COALESCE = "coalesce"  # become the pending run, or merge into it
    RETRY = "retry"  # Celery's retry, backing off
    RAISE = "raise"  # the outcome's error: LockNotAcquired or QuorumUnavailable


OUTCOMES = ("acquired", "covered", "held", "contended", "unavailable")
RELATIONS = ("same", "earlier", "continuation", "other")  # see relation_of

_ON_UNAVAILABLE = {
    "run": Action.RUN_UNGUARDED,
    "raise": Action.RAISE,
    "retry": Action.WAIT_FOR_NODES,
}
_ON_DUPLICATE = {
    "skip": Action.SKIP,
    "raise": Action.RAISE,
    "retry": Action.RETRY,
    "wait": Action.WAIT,
    "coalesce": Action.COALESCE,
}


@dataclass(frozen=True)
class Situation:
    """Everything a decision depends on. ``relation`` matters only when ``outcome`` is
    ``"held"``; ``may_wait`` is False once the run has waited in its process; ``can_publish``
    is False for a plain function call (no message, no worker)."""

    outcome: str
    relation: str
    on_duplicate: str
    on_unavailable: str
    may_wait: bool
    eager: bool
    can_publish: bool = True


_PUBLISHING = frozenset({Action.DEFER, Action.RETRY, Action.COALESCE, Action.WAIT_FOR_NODES})


def decide(situation: Situation) -> Action:
    """The action for ``situation`` (see the module docstring for the table in words)."""
    action = _delivery_action(situation)
    if situation.can_publish or action not in _PUBLISHING:
        return action
    if situation.may_wait and action is not Action.WAIT_FOR_NODES:
        return Action.WAIT
    return Action.RAISE


def _delivery_action(situation: Situation) -> Action:
    outcome = situation.outcome
    if outcome == "acquired":
        return Action.RUN
    if outcome == "covered":
        return Action.ACKNOWLEDGE
    if outcome == "unavailable":
        action = _ON_UNAVAILABLE[situation.on_unavailable]
        if action is Action.WAIT_FOR_NODES and situation.eager:
            return Action.RAISE  # nothing can wait for an eager call
        return action
    if outcome == "contended":
        return Action.WAIT if situation.may_wait else Action.DEFER
    if outcome != "held":
        raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
    relation = situation.relation
    if relation in ("same", "earlier"):
        return Action.DEFER
    if relation == "continuation":
        return Action.WAIT if situation.may_wait else Action.DEFER
    action = _ON_DUPLICATE[situation.on_duplicate]
    if action is Action.WAIT and not situation.may_wait:
        return Action.RETRY  # waited lock_wait seconds already
    return action


def relation_of(holder: Owner | None, request: Any) -> str:
    """How a lock's holder relates to this delivery: ``"same"`` attempt of this task id, an
    ``"earlier"`` one, a ``"continuation"`` (this is a later attempt of the holder's task id, or
    a task the holder sent), or ``"other"``."""
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
