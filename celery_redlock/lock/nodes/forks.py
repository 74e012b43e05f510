"""What a forked child must not inherit: a lock another thread of the parent may have held at
the fork (`ProcessLock`)."""

from __future__ import annotations

import os
import threading


class ProcessLock:
    """A lock of the calling process: a forked child gets a new one (a thread of the parent
    may have held the parent's at the fork, and it would stay held in the child), the same one
    for every thread of the child, however many ask for it at once."""

    def __init__(self) -> None:
        self._locks: dict[int, threading.Lock] = {}  # by process id

    def held(self) -> threading.Lock:
        """This process's lock, for a ``with`` block."""
        pid = os.getpid()
        lock = self._locks.get(pid)
        if lock is None:
            # setdefault is one step under the GIL: threads asking at once all get the first.
            lock = self._locks.setdefault(pid, threading.Lock())
            for other in list(self._locks):  # the parent's, useless here
                if other != pid:
                    self._locks.pop(other, None)
        return lock
