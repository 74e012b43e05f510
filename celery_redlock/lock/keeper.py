"""The lock keeper: extends running tasks' locks from one thread per process and app.

A lock is extended when a third of its validity has passed, never past the run's hard time
limit. When that fails for good (a majority says the token is gone, or no quorum answers before
the validity runs out) it is marked lost and ``on_lost`` runs, so the task is told instead of
working on unlocked. A killed prefork child stops extending; the ttl then frees the lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import LockLost, RedlockError
from .nodes.threads import start_thread
from .nodes.wakeups import Wakeup
from .outcomes import Lock
from .redlock import Redlock, drift

logger = logging.getLogger(__name__)

IDLE_SECONDS = 2.0  # how long the thread waits with nothing to extend before it ends


@dataclass(eq=False, slots=True)
class KeptLock:
    """A lock under the keeper's care, with why it was lost if it was. With a ``holder`` (a
    weak reference to what holds the lock, such as a task's run), the lock is kept only while
    the holder lives: one gone without `LockKeeper.stop` (a signal handler's exception cut its
    end short) has its lock released by the keeper, never extended for ever."""

    lock: Lock
    hard_deadline: float | None
    on_lost: Callable[[KeptLock], None]
    holder: weakref.ReferenceType[Any] | None = None
    lost_reason: str = ""
    stopped: bool = False
    next_at: float = 0.0
    guard: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def is_lost(self) -> bool:
        """True once the lock is known to be gone."""
        return bool(self.lost_reason)


class LockKeeper:
    """Extends the locks of running tasks from a background thread (started lazily per process)."""

    def __init__(self, redlock: Redlock) -> None:
        self.redlock = redlock
        self._order = itertools.count()
        self._pid = -1
        self._this_process()

    def _this_process(self) -> None:
        # Start afresh in a forked child: the parent's thread is not there, and its lock may
        # have been held by that thread at the fork. A plain lock and a `Wakeup`, not a
        # condition: a soft time limit raising in `stop` must not leave anything held.
        if self._pid != os.getpid():
            self._guard = threading.Lock()
            self._wakeup = Wakeup()
            self._queue: list[tuple[float, int, KeptLock]] = []
            # The extending thread, as `start_thread` returned it: one that was interrupted
            # while starting is not recorded (it may run anyway, until it is idle).
            self._thread: threading.Thread | None = None
            self._stopped_in_queue = 0
            self._sleeping_until = 0.0  # until when the thread sleeps (0: none sleeps)
            self._pid = os.getpid()

    def keep(
        self,
        lock: Lock,
        on_lost: Callable[[KeptLock], None],
        hard_deadline: float | None = None,
        auto_extend: bool = True,
    ) -> KeptLock:
        """Start caring for ``lock``; with ``auto_extend`` it is extended until `stop`."""
        kept = KeptLock(lock, hard_deadline, on_lost)
        if auto_extend:
            self.start(kept)
        return kept

    def start(self, kept: KeptLock) -> None:
        """Extend ``kept`` until `stop`. A caller that must be able to stop it whatever
        interrupts it stores ``kept`` where its clean-up finds it before calling this."""
        self._schedule(kept, time.monotonic() + kept.lock.validity / 3)

    def stop(self, kept: KeptLock) -> None:
        """Stop extending; returns after any extension in flight has finished."""
        with kept.guard:
            kept.stopped = True
        self._this_process()
        with self._guard:
            # Short runs stop long before their first extension is due: drop their entries in
            # bulk, or the thread wakes up once per finished run, a third of a ttl later. The
            # count is an estimate (locks kept without extension have no entry; the thread pops
            # stopped ones unannounced): it only decides when to look. At the queue's length the
            # queue may hold nothing live; the thread finds it empty when it wakes and ends.
            self._stopped_in_queue += 1
            queued = len(self._queue)
            if self._stopped_in_queue >= queued or self._stopped_in_queue > max(16, queued // 2):
                self._queue = [entry for entry in self._queue if not entry[2].stopped]
                heapq.heapify(self._queue)
                self._stopped_in_queue = 0

    def extend_now(self, kept: KeptLock, ttl: float | None = None) -> bool:
        """Extend now: True if a majority extended it, False if no quorum answered but the lock is
        still valid; raises `LockLost` (reported like the thread's) when the lock is gone."""
        with kept.guard:
            if kept.is_lost:
                raise LockLost(kept.lock.key, kept.lost_reason)
            extended = self._extend(kept, ttl)
            if kept.is_lost:
                self._report_lost(kept)
                raise LockLost(kept.lock.key, kept.lost_reason)
            return extended

    def _schedule(self, kept: KeptLock, when: float) -> None:
        kept.next_at = when
        self._this_process()
        with self._guard:
            thread = self._thread  # none yet, idle and ended, or left in the parent (above)
            if thread is None or not thread.is_alive():
                self._thread = start_thread(self._run, name="celery-redlock-keeper")
            heapq.heappush(self._queue, (when, next(self._order), kept))
            if when < self._sleeping_until:  # wake the thread only if it would sleep past this
                self._wakeup.wake()

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            with self._guard:
                now = time.monotonic()
                queue = self._queue
                if queue and queue[0][0] <= now:
                    self._sleeping_until = 0.0  # awake: whoever schedules need not wake it
                    _, _, kept = heapq.heappop(queue)
                    idle_since = None
                elif queue:
                    self._sleeping_until = queue[0][0]
                    idle_since = None
                    kept = None
                elif idle_since is not None and now - idle_since >= IDLE_SECONDS:
                    # Nothing to extend for a while: the thread ends (the next lock kept starts
                    # another), so that it does not keep a dropped lock manager and its
                    # connections alive for ever.
                    if self._thread is threading.current_thread():
                        self._thread = None
                        self._sleeping_until = 0.0
                    else:  # an unrecorded thread (see `_this_process`): the recorded one may sleep
                        self._sleeping_until = float("inf")
                    return
                else:
                    idle_since = now if idle_since is None else idle_since
                    self._sleeping_until = idle_since + IDLE_SECONDS
                    kept = None
                sleep_for = self._sleeping_until - now
            if kept is None:
                self._wakeup.sleep(sleep_for)
                continue
            with kept.guard:
                if kept.stopped or kept.is_lost:
                    continue
                if kept.holder is not None and kept.holder() is None:
                    kept.stopped = True
                    self._release_orphan(kept)
                    continue
                if kept.next_at > time.monotonic():
                    # Extended by hand meanwhile: come back when that extension is a third old.
                    self._schedule(kept, kept.next_at)
                    continue
                try:
                    self._extend(kept, None)
                except Exception:  # the keeper must never die silently
                    logger.exception("extending lock %s failed", kept.lock.key)
                    kept.lost_reason = "the extension raised an unexpected error"
                if kept.is_lost:
                    self._report_lost(kept)
                    continue
                if kept.next_at != float("inf"):  # inf: the run's hard time limit is reached
                    self._schedule(kept, kept.next_at)

    def _extend(self, kept: KeptLock, ttl: float | None) -> bool:
        # One extension attempt: sets next_at or lost_reason. The caller holds the guard.
        lock = kept.lock
        ttl = lock.ttl if ttl is None else ttl
        now = time.monotonic()
        if kept.hard_deadline is not None:
            ttl = min(ttl, kept.hard_deadline - now)
            if ttl - drift(self.redlock, ttl) - self.redlock._settings.node_timeout <= 0:
                # The run's hard time limit is reached: the lock expires with it.
                kept.next_at = float("inf")
                return False
        try:
            extended = self.redlock.extend(lock, ttl)
        except RedlockError as error:
            extended = False
            logger.warning("extending lock %s failed: %s", lock.key, error)
        if extended:
            kept.next_at = time.monotonic() + lock.validity / 3
            return True
        remaining = lock.remaining()
        if remaining <= 0:
            kept.lost_reason = (
                "a majority of lock nodes no longer hold its token"
                if lock.valid_until == 0.0
                else "no quorum of lock nodes confirmed an extension before its validity ran out"
            )
            return False
        # No quorum answered yet: try again soon, while the lock is still valid.
        kept.next_at = time.monotonic() + min(self.redlock._settings.retry_delay, remaining / 3)
        return False

    def _release_orphan(self, kept: KeptLock) -> None:
        # Its holder is gone without stopping it: the run it guarded has ended.
        logger.warning("lock %s outlived its run: released", kept.lock.key)
        try:
            self.redlock.release(kept.lock, confirm=False)
        except RedlockError as error:
            logger.warning(
                "releasing lock %s failed (it expires by itself): %s", kept.lock.key, error
            )

    def _report_lost(self, kept: KeptLock) -> None:
        logger.error("lock %s was lost: %s", kept.lock.key, kept.lost_reason)
        try:
            kept.on_lost(kept)
        except Exception:
            logger.exception("lock_lost handler for %s raised", kept.lock.key)
