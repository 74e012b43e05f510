"""Waiting that a signal handler raising in the waiting thread cannot break (`Wakeup`, `Flag`).

A handler raising inside ``threading.Event.wait`` or ``Condition.wait`` (Celery's soft time
limit, SIGALRM, Ctrl-C: Python runs handlers in the main thread between any two bytecodes of
those Python-level methods) can leave the event's internal lock held: the next ``set()`` then
blocks its caller for ever (a probe thread, the reactor thread). Here a waiter only ever calls
``acquire`` on a plain lock, which such an exception interrupts whole, and the side that wakes
only ever calls ``release``, which never blocks.
"""

from __future__ import annotations

import threading


class Wakeup:
    """Wakes one sleeping thread; a wake before the sleep is kept (at most one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def wake(self) -> None:
        """Wake the sleeper (or the next one to sleep). Never blocks."""
        try:  # noqa: SIM105 -- every round passes here: no context manager per call
            self._lock.release()
        except RuntimeError:  # woken already
            pass

    def sleep(self, seconds: float | None) -> None:
        """Sleep until woken or ``seconds`` (None: no limit) have passed."""
        self._lock.acquire(timeout=-1 if seconds is None else max(seconds, 0.0))


class Flag:
    """Set once; any number of threads wait for it (as ``threading.Event``, without its lock)."""

    def __init__(self) -> None:
        self._set = False
        self._wakeup = Wakeup()

    def set(self) -> None:
        """Set the flag and wake its waiters. Never blocks."""
        self._set = True
        self._wakeup.wake()

    def is_set(self) -> bool:
        """True once set."""
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the flag is set or ``timeout`` seconds (None: no limit) have passed;
        returns whether it is set."""
        if self._set:
            return True
        self._wakeup.sleep(timeout)
        self._wakeup.wake()  # the next waiter, if any, goes through too
        return self._set
