"""Lock outcomes reported to the world, from one place: the `celery_redlock.signals` (in the
process that runs the task) and, when the worker sends task events (``celery worker -E``), Celery
events of the group ``redlock-`` that monitors such as Flower and celery-exporter receive.

Events carry the task name, the task id and the lock key (a hash of the arguments, never their
values).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from celery.utils.dispatch import Signal

logger = logging.getLogger(__name__)

WORKER_ATTRIBUTE = "_celery_redlock_worker"
EVENT_GROUP = "redlock"


@dataclass(frozen=True)
class WorkerFacts:
    """What the worker consuming in this process told at start: its node name (``name@host``)
    and whether it sends task events. Recorded before prefork pool processes fork."""

    name: str
    task_events: bool


def remember_worker(sender: Any = None, **_: Any) -> None:
    """``worker_init`` handler: record the worker's `WorkerFacts` on its app (Celery gives
    solo and threads tasks the bare host name, and pool processes cannot see ``-E``)."""
    app = getattr(sender, "app", None)
    if app is not None:
        facts = WorkerFacts(str(sender.hostname), bool(getattr(sender, "task_events", False)))
        app.__dict__[WORKER_ATTRIBUTE] = facts


def _sends_events(task: Any) -> WorkerFacts | None:
    facts: WorkerFacts | None = task.app.__dict__.get(WORKER_ATTRIBUTE)
    if facts is None or not facts.task_events or not task.send_events:
        return None
    return facts


def report(task: Any, signal: Signal, task_id: str | None, **fields: Any) -> None:
    """Send ``signal`` (if it has receivers) and the Celery event ``redlock-<outcome>`` (if the
    worker sends task events) for one lock outcome of ``task``'s run ``task_id``."""
    if signal.receivers:
        signal.send(sender=task, task_id=task_id, **fields)
    facts = _sends_events(task)
    if facts is not None:
        outcome = str(signal.name).removeprefix("lock_")
        _send(task, facts, f"{EVENT_GROUP}-{outcome}", task_id, fields)


def announce_revoked(task: Any, task_id: str | None) -> None:
    """Celery's ``task-revoked`` for a run that will not happen (a skipped or coalesced
    duplicate), so that monitors show the task finished."""
    facts = _sends_events(task)
    if facts is not None:
        _send(task, facts, "task-revoked", task_id, {"terminated": False, "expired": False})


def _send(
    task: Any, facts: WorkerFacts, event: str, task_id: str | None, fields: dict[str, Any]
) -> None:
    try:
        with task.app.events.default_dispatcher(hostname=facts.name) as dispatcher:
            dispatcher.send(event, uuid=task_id, task=task.name, **fields)
    except Exception as error:  # monitoring must never fail a run
        logger.warning(
            "could not send the %s event of %s[%s]: %s", event, task.name, task_id, error
        )
