"""celery_redlock: Redlock-guarded singleton tasks for Celery."""

from .errors import (
    ConfigurationError,
    DuplicateSkipped,
    LockLost,
    LockNotAcquired,
    QuorumUnavailable,
    RedlockError,
)
from .redlock import Lock, Redlock

__all__ = [
    "ConfigurationError",
    "DuplicateSkipped",
    "Lock",
    "LockLost",
    "LockNotAcquired",
    "QuorumUnavailable",
    "Redlock",
    "RedlockError",
]
