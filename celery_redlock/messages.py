"""Which message a delivery came in: the identity that tells a broker's redelivery of a message
from an application sending the same task id again.

In every process that publishes task messages and imports celery_redlock, ``before_task_publish``
gives each new task message a random identity in the header ``celery_redlock_message`` (16 hex
digits); a message published again as the same message — a retry, a deferral — keeps its own.
The broker redelivers a message with its headers, and an application that sends a task id again
sends a new message with a new identity. Completion records name the message, so only a
redelivery of a message whose body ran is acknowledged without running.
"""

from __future__ import annotations

import secrets
from typing import Any

MESSAGE_HEADER = "celery_redlock_message"
"""The message header holding a published message's identity."""


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
