"""Which message a delivery came in: the identity that tells a broker's redelivery of a message
from an application sending the same task id again.

In every process that publishes task messages and imports celery_redlock, ``before_task_publish``
gives each new task message a random identity in the header ``celery_redlock_message`` (16 hex
digits); a message published again as the same message — a retry, a deferral — keeps its own.
The broker redelivers a message with its headers, and an application that sends a task id again
sends a new message with a new identity. Completion records name the message, so only a
redelivery of a message whose body ran is acknowledged without running.

A record is written only where a copy of the message can still arrive after its body ran
(`copy_may_come`): the broker redelivers only a message it has not seen acknowledged.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

MESSAGE_HEADER = "celery_redlock_message"
"""The message header holding a published message's identity."""

RECEIVED_FIELD = "celery_redlock_received"
"""The request field holding when the worker received the message (``time.time()``): set by the
worker's main process (`stamp_received`), read as ``task.request.celery_redlock_received``."""


def name_message(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish`` handler: give a new message its identity (every task message: the
    publisher cannot always tell which task names are singleton tasks, as with ``send_task``;
    the header costs 40 bytes)."""
    if headers is not None and MESSAGE_HEADER not in headers:
        headers[MESSAGE_HEADER] = secrets.token_hex(8)


def message_field(task_name: str, request: Any) -> str:
    """The completion-record field of the message a request was delivered in: its identity, or,
    for a message published where celery_redlock was not imported, the task's name."""
    identity = (request.headers or {}).get(MESSAGE_HEADER)
    return f"message:{identity}" if isinstance(identity, str) else f"task:{task_name}"


def stamp_received(request_dict: dict[str, Any]) -> None:
    """Note in a request's fields (``Request.request_dict``, which the pool hands to the task's
    ``request``) that its message was received now."""
    request_dict[RECEIVED_FIELD] = time.time()


def copy_may_come(acks_late: bool, request: Any, window: float) -> bool:
    """Whether a copy of the message of ``request`` may still be delivered once its body ran, so
    that the run must leave a record: the message is acknowledged after the body
    (``acks_late``), or held unacknowledged until its ETA or countdown, or is itself a copy the
    broker delivered again (the first delivery may still be waiting, unacknowledged, in a
    worker), or it waited in the worker for more than half the broker's redelivery ``window``
    (``visibility_timeout``) before it was acknowledged on receipt, or when it was received is
    unknown. A message acknowledged on receipt within the window is never delivered again."""
    if acks_late or request.eta or (request.delivery_info or {}).get("redelivered"):
        return True
    received = getattr(request, RECEIVED_FIELD, None)
    if not isinstance(received, (int, float)) or isinstance(received, bool):
        return True
    return time.time() - received > window / 2
