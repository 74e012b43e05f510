"""Which message a delivery came in: the identity that tells a broker's redelivery of a message
from an application sending the same task id again.

``before_task_publish`` (in every process that imports celery_redlock) gives each new task message
a random identity in the header ``celery_redlock_message``, which the broker redelivers with it
and which a retry or deferral keeps; sending a task id again makes a new message with a new one.
Completion records name the message, so only a redelivery of a message whose body ran is
acknowledged without running.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

MESSAGE_HEADER = "celery_redlock_message"

DEFERRED_HEADER = "celery_redlock_deferred"
"""Message header of a run published again by this library (`run.Run.publish_again`): never
de-duplicated at enqueue."""

ENDED_FIELD = "celery_redlock_ended"
"""The request field set once its run recorded its message as ended for good (`run.LAST_RETRIES`):
a retry asked for after that (from ``on_failure``, say) is published as a new message."""

RECEIVED_FIELD = "celery_redlock_received"
"""The request field holding when the worker's main process received the message (``time.time()``,
set by `process_loss.LockAwareRequest`), read as ``task.request.celery_redlock_received``."""


def name_message(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish`` handler: give a new message its identity (every task message: the
    publisher cannot always tell which task names are singleton tasks, as with ``send_task``;
    the header costs 40 bytes)."""
    if headers is not None and MESSAGE_HEADER not in headers:
        headers[MESSAGE_HEADER] = secrets.token_hex(8)


def new_message_after_the_end(request: Any) -> None:
    """Make the next message published from ``request`` (a retry) a new message, when its run
    recorded it as ended for good: that record would take a copy of it for a copy of the
    finished message."""
    if getattr(request, ENDED_FIELD, False) and request.headers:
        request.headers.pop(MESSAGE_HEADER, None)


def message_field(task_name: str, request: Any) -> str:
    """The completion-record field of the message a request was delivered in: its identity, or,
    for a message published where celery_redlock was not imported, the task's name."""
    identity = (request.headers or {}).get(MESSAGE_HEADER)
    return f"message:{identity}" if isinstance(identity, str) else f"task:{task_name}"


def copy_may_come(acks_late: bool, request: Any, window: float) -> bool:
    """Whether a copy of the message of ``request`` may still come once its body ran, so the run
    must leave a record: it is acknowledged after the body (``acks_late``), or held unacknowledged
    until its ETA or countdown, or is itself a redelivered copy (the first may still wait,
    unacknowledged, in a worker), or it waited in the worker over half the broker's redelivery
    ``window`` (``visibility_timeout``) before its ack on receipt, or its receipt is unknown."""
    if acks_late or request.eta or (request.delivery_info or {}).get("redelivered"):
        return True
    received = getattr(request, RECEIVED_FIELD, None)
    if not isinstance(received, (int, float)) or isinstance(received, bool):
        return True
    return time.time() - received > window / 2
