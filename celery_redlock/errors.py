"""The exception hierarchy: every error raised by celery_redlock derives from `RedlockError`.

Each keeps its constructor arguments in ``args``, so it survives pickling and the result backend.
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
    """A task run was skipped because another run holds its lock (``on_duplicate="skip"``): what
    a caller's ``AsyncResult.get()`` raises for a skipped run."""

    def __str__(self) -> str:
        held_by = f" held by {self.holder}" if self.holder else ""
        return f"skipped: another run holds lock {self.key!r}{held_by}"


class DuplicateCoalesced(DuplicateSkipped):
    """A duplicate merged into the pending run ``into`` (``on_duplicate="coalesce"``), which
    starts after this one arrived and so covers its work: what ``AsyncResult.get()`` raises."""

    def __init__(self, key: str, holder: str | None = None, into: str | None = None) -> None:
        super().__init__(key, holder)
        self.args = (key, holder, into)
        self.into = into

    def __str__(self) -> str:
        return f"coalesced into pending run {self.into} of lock {self.key!r}"


class AlreadyCompleted(RedlockError):
    """A message was delivered again after its body had run (``task_id`` under lock ``key``), and
    was acknowledged without running. It is the result stored for that task id only when the
    result back-end knew none (the first run's result was forgotten or never stored)."""

    def __init__(self, key: str, task_id: str | None = None) -> None:
        super().__init__(key, task_id)
        self.key = key
        self.task_id = task_id

    def __str__(self) -> str:
        return (
            f"task {self.task_id} was delivered again after it ran (lock {self.key!r}); "
            "it did not run again, and its first result is not known here"
        )


class QuorumUnavailable(RedlockError):
    """Fewer than a majority of lock nodes answered, so nothing can be decided about ``key``;
    ``reasons`` says why, per node that gave no usable answer."""

    def __init__(
        self, key: str, answered: int = 0, needed: int = 0, reasons: tuple[str, ...] = ()
    ) -> None:
        super().__init__(key, answered, needed, reasons)
        self.key = key
        self.answered = answered
        self.needed = needed
        self.reasons = tuple(reasons)

    def __str__(self) -> str:
        why = f" ({'; '.join(self.reasons)})" if self.reasons else ""
        # A denied command names its own fix (the ACL), and is no network failure.
        if "NOPERM" in why:
            hint = ""
        elif "certificate" in why or "SSL" in why:
            hint = "; check the TLS options of redlock_urls (ssl_ca_certs, ssl_certfile, ...)"
        else:
            hint = "; check that the redlock_urls servers are up and reachable"
        return (
            f"no quorum for lock {self.key!r}: {self.answered} lock node(s) answered, "
            f"{self.needed} needed{why}{hint}"
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
