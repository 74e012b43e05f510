"""Fenced writes: the storage refuses, atomically with the write, one that carries an older
fencing token than the last it accepted for the same resource (`StaleFence`), so a holder that
outlived its lock (a GC pause, a stopped VM) cannot write after the next holder did.

One module per storage, each importable only where its library is installed:
`celery_redlock.fencing.redis` (SET / HSET), `celery_redlock.fencing.sql` (SQLAlchemy 2 on
PostgreSQL and SQLite), `celery_redlock.fencing.django` (a model field and queryset methods).
Each takes the fence as a `Lock` (a task's ``self.lock``) or its `Lock.fencing_token`.
"""

from __future__ import annotations

from ..errors import ConfigurationError, RedlockError
from ..lock.outcomes import Lock

__all__ = ["Fence", "StaleFence", "fencing_token"]

Fence = Lock | int | None
"""What a fenced write takes: the `Lock` held (a task's ``self.lock``) or its fencing token."""


class StaleFence(RedlockError):
    """A fenced write to ``resource`` was refused: it carries fencing token ``token``, and the
    storage had already accepted a write with token ``stored`` (not smaller): a later holder of
    the lock wrote after this one's lock ran out. ``stored`` is None when it is not known."""

    def __init__(self, resource: str, token: int, stored: int | None = None) -> None:
        super().__init__(resource, token, stored)
        self.resource = resource
        self.token = token
        self.stored = stored

    def __str__(self) -> str:
        stored = f"token {self.stored}" if self.stored is not None else "a token not smaller"
        return (
            f"stale write to {self.resource!r} refused: it carries fencing token {self.token}, "
            f"and the storage already accepted {stored}; this run's lock ran out (a pause or a "
            "stall past its validity) and a later holder wrote: do not retry with this token, "
            "run again under a new lock"
        )


def fencing_token(fence: Fence) -> int:
    """The fencing token of ``fence``: a `Lock`'s ``fencing_token``, or the positive `int` given;
    `ConfigurationError` for None (a run without a lock) and for a token below 1."""
    if fence is None:
        raise ConfigurationError(
            "a fenced write needs the lock of the current run, and there is none: the task is "
            "no singleton task, or it ran without a quorum under on_unavailable='run'; pass "
            "self.lock of a bound singleton task (or a Lock's fencing_token)"
        )
    token = fence.fencing_token if isinstance(fence, Lock) else fence
    if isinstance(token, bool) or not isinstance(token, int) or token < 1:
        raise ConfigurationError(
            f"a fencing token is a positive int, got {token!r}: pass self.lock or "
            "Lock.fencing_token"
        )
    return token
