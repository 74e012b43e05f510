"""The exception hierarchy: every error raised by celery_redlock derives from `RedlockError`.

Every exception keeps its constructor arguments in ``args`` so it survives pickling and Celery's
result-backend round trip (a worker must never crash on an exception it cannot serialize).
"""

from __future__ import annotations


class RedlockError(Exception):
    """Base class of every error raised by celery_redlock."""


class ConfigurationError(RedlockError, ValueError):
    """A setting or argument is invalid; the message says what is wrong and how to fix it."""


class LockNotAcquired(RedlockError):
    """The lock on ``key`` is held by someone else (``holder`` describes them when known)."""

    def __init__(self, key: str, holder: str | None = None) -> None:
        super().__init__(key, holder)
        self.key = key
        self.holder = holder

    def __str__(self) -> str:
        held_by = f" (held by {self.holder})" if self.holder else ""
        return f"lock {self.key!r} is held by another owner{held_by}"


class DuplicateSkipped(LockNotAcquired):
    """A task run was skipped because another run holds its lock (``on_duplicate="skip"``).

    It is the result a caller's ``AsyncResult.get()`` raises for a skipped run.
    """

    def __str__(self) -> str:
        held_by = f" held by {self.holder}" if self.holder else ""
        return f"skipped: another run holds lock {self.key!r}{held_by}"


class DuplicateCoalesced(DuplicateSkipped):
    """A duplicate merged into the pending run ``into`` (``on_duplicate="coalesce"``): that run
    starts after this one arrived, so it covers this one's work.

    It is the result a caller's ``AsyncResult.get()`` raises for a merged run.
    """

    def __init__(self, key: str, holder: str | None = None, into: str | None = None) -> None:
        RedlockError.__init__(self, key, holder, into)
        self.key = key
        self.holder = holder
        self.into = into

    def __str__(self) -> str:
        return f"coalesced into pending run {self.into} of lock {self.key!r}"


class QuorumUnavailable(RedlockError):
    """Fewer than a majority of lock nodes answered, so nothing can be decided about ``key``."""

    def __init__(self, key: str, answered: int = 0, needed: int = 0) -> None:
        super().__init__(key, answered, needed)
        self.key = key
        self.answered = answered
        self.needed = needed

    def __str__(self) -> str:
        return (
            f"no quorum for lock {self.key!r}: {self.answered} lock node(s) answered, "
            f"{self.needed} needed; check that the redlock_urls servers are up and reachable"
        )


class LockLost(RedlockError):
    """A lock this process held is gone (expired, taken over, or unconfirmable by a majority)."""

    def __init__(self, key: str, reason: str = "") -> None:
        super().__init__(key, reason)
        self.key = key
        self.reason = reason

    def __str__(self) -> str:
        because = f": {self.reason}" if self.reason else ""
        return f"lock {self.key!r} was lost{because}"
