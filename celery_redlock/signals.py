"""Signals sent at every lock state change, for metrics and alerting; connect like any Celery
signal (``@lock_duplicate.connect``). ``sender`` is the task; every signal carries ``key`` (the
Redis key) and ``task_id``. Handlers run in the worker process (``lock_lost`` in the lock
keeper's thread) and must be quick.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal


def _signal(name: str, *arguments: str) -> Signal:
    return Signal(name=name, providing_args={"task_id", "key", *arguments})


lock_acquired = _signal("lock_acquired", "waited", "fencing_token")
"""A run took its lock; ``waited`` is the seconds spent acquiring."""

lock_duplicate = _signal("lock_duplicate", "policy", "holder")
"""A run found its lock held by ``holder``; ``policy`` is what it does about it."""

lock_extended = _signal("lock_extended", "validity")
"""A lock was extended by hand (``self.extend_lock()``); ``validity`` is seconds guaranteed."""

lock_lost = _signal("lock_lost", "reason")
"""A running task's lock is gone; its next ``self.extend_lock()`` raises `LockLost`."""

lock_released = _signal("lock_released", "state", "held", "released")
"""A run ended (``state`` is Celery's); ``held`` is seconds held; ``released`` False means it was
already gone or is kept for ``lock_hold``."""

lock_unavailable = _signal("lock_unavailable", "policy")
"""No quorum of lock nodes answered; ``policy`` is the ``on_unavailable`` action taken."""
