"""Deferring a delivery: publishing its very message again to run later (`run.Run.publish_again`),
freeing the pool process; a deferral or retry the broker does not take (`DeferralNotPublished`).
"""

from __future__ import annotations

DEFERRED_HEADER = "celery_redlock_deferred"
"""Message header of a run published again by this library (never de-duplicated at enqueue)."""


class DeferralNotPublished(Exception):
    """The broker did not take a deferral or a retry; ``error`` says why. Handled by the run
    itself (`Run.wait_instead`): it never reaches Celery or the caller."""

    def __init__(self, why: str, error: BaseException) -> None:
        super().__init__(f"{why}; publishing the deferral failed: {error!r}")
        self.error = error
