"""celery_redlock: Redlock-guarded singleton tasks for Celery.

``@singleton_task`` / ``SingletonTask`` make a task run at most once at a time per key across a
whole worker fleet; `Redlock` is the lock itself, usable without Celery.
"""

from .errors import (
    AlreadyCompleted,
    ConfigurationError,
    DuplicateCoalesced,
    DuplicateSkipped,
    LockLost,
    LockNotAcquired,
    QuorumUnavailable,
    RedlockError,
)
from .fencing import StaleFence
from .integration.keys import LockKeyError
from .integration.process_loss import LockAwareRequest
from .integration.task import SingletonTask, singleton_task
from .integration.wiring import connect as _connect_signal_handlers
from .lock.outcomes import Lock
from .lock.redlock import Redlock
from .settings import RedlockSettings

_connect_signal_handlers()

__all__ = [
    "AlreadyCompleted",
    "ConfigurationError",
    "DuplicateCoalesced",
    "DuplicateSkipped",
    "Lock",
    "LockAwareRequest",
    "LockKeyError",
    "LockLost",
    "LockNotAcquired",
    "QuorumUnavailable",
    "Redlock",
    "RedlockError",
    "RedlockSettings",
    "SingletonTask",
    "StaleFence",
    "singleton_task",
]
