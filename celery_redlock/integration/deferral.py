"""Deferring a delivery: publishing its very message again to run later, freeing the pool process.

A deferral (or an ``on_duplicate="retry"`` retry) acknowledges the delivery only once its copy is
published; when publishing fails, `DeferralNotPublished` tells the run, which waits for its lock in
its process instead (`run.Run.wait_instead`).
"""

from __future__ import annotations

import random
from typing import Any

DEFERRED_HEADER = "celery_redlock_deferred"
"""Message header of a run published again by this library (never de-duplicated at enqueue)."""


class DeferralNotPublished(Exception):
    """The broker did not take a deferral or a retry; ``error`` says why. Handled by the run
    itself (`Run.wait_instead`): it never reaches Celery or the caller."""

    def __init__(self, why: str, error: BaseException) -> None:
        super().__init__(f"{why}; publishing the deferral failed: {error!r}")
        self.error = error


def publish_again(
    task: Any, request: Any, countdown: float, headers: dict[str, Any] | None = None
) -> float:
    """Publish the message of ``request`` again (same id, same attempt, same message identity,
    every option) to run after about ``countdown`` seconds; returns the countdown used. Raises
    what the producer raises when the broker does not take it."""
    message_headers = {**(request.headers or {}), DEFERRED_HEADER: True, **(headers or {})}
    countdown += random.uniform(0.0, 0.5)  # copies published together come back apart
    again = task.signature_from_request(request, countdown=countdown, headers=message_headers)
    again.apply_async()
    return countdown
