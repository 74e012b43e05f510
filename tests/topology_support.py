"""Helpers of the topology tests (tests/test_topology_*.py): lock managers over Cluster and
Sentinel lock nodes, and a rival that keeps trying to take a lock while a test fails servers
over under its holder."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType

from celery_redlock import Redlock, RedlockSettings
from celery_redlock.lock.keeper import KeptLock, LockKeeper
from celery_redlock.lock.outcomes import Acquired, Lock
from celery_redlock.lock.redlock import from_settings

NODE_TIMEOUT = 0.5
"""Per-node timeout of the tests' lock managers: a busy machine must not make a healthy server
look hung (these tests are about topologies, the fault tests are about timing)."""


def unique(name: str) -> str:
    """A resource name no other test uses."""
    return f"{name}-{uuid.uuid4().hex[:10]}"


@contextmanager
def lock_managers(
    urls: Sequence[str], count: int = 2, *, wait_replicas: int = 0, key_prefix: str = "redlock:"
) -> Iterator[list[Redlock]]:
    """``count`` independent lock managers over ``urls`` (as separate processes would have),
    with `NODE_TIMEOUT` and ``redlock_wait_replicas``; closed at the end of the block."""
    settings = RedlockSettings(
        urls=tuple(urls),
        node_timeout=NODE_TIMEOUT,
        retry_delay=0.05,
        wait_replicas=wait_replicas,
        key_prefix=key_prefix,
    )
    managers = [from_settings(settings) for _ in range(count)]
    try:
        yield managers
    finally:
        for manager in managers:
            manager.close()


class Rival:
    """A thread that tries to take the lock on ``resource`` over and over (one round per
    attempt) until the block ends, and records every time it got it (releasing it at once).
    ``while_valid`` is the holder's lock: what the rival got while it was valid is a second
    holder."""

    def __init__(self, manager: Redlock, resource: str, while_valid: Lock) -> None:
        self.manager = manager
        self.resource = resource
        self.holder = while_valid
        self.attempts = 0
        self.granted: list[Lock] = []
        self.granted_while_valid: list[Lock] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rival", daemon=True)

    def __enter__(self) -> Rival:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the rival thread did not stop"

    def wait_for_attempts(self, count: int, timeout: float = 10.0) -> None:
        """Wait until ``count`` more attempts were made."""
        target = self.attempts + count
        deadline = time.monotonic() + timeout
        while self.attempts < target:
            assert time.monotonic() < deadline, f"the rival made {self.attempts} attempts only"
            assert not self.errors, self.errors
            time.sleep(0.01)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                outcome = self.manager.attempt(self.resource, 10.0, "rival", rounds=1)
            except BaseException as error:
                self.errors.append(error)
                return
            self.attempts += 1
            if isinstance(outcome, Acquired):
                self.granted.append(outcome.lock)
                if time.monotonic() < self.holder.valid_until:
                    self.granted_while_valid.append(outcome.lock)
                self.manager.release(outcome.lock)
            self._stop.wait(0.02)


class HoldThroughFailover:
    """A holder kept alive by the lock keeper (as a running task's lock is) and ``contenders``
    threads, each with its own lock manager, trying to take the same lock every 10 ms, while a
    test fails the holder's servers over. Records every grant a contender got while the holder
    still believed it held (its validity not over and no loss reported): a second holder.

    Example::

        with HoldThroughFailover(urls, ttl=1.0) as hold:
            group.failover()
            hold.watch(seconds=4.0)
        assert hold.overlaps == []
    """

    def __init__(
        self,
        urls: Sequence[str],
        ttl: float,
        *,
        contenders: int = 4,
        wait_replicas: int = 0,
        resource: str = "",
    ) -> None:
        self.urls = urls
        self.ttl = ttl
        self.contenders = contenders
        self.wait_replicas = wait_replicas
        self.resource = resource or unique("failover-hold")
        self.lost_at: float | None = None
        self.granted_at: list[float] = []
        self.overlaps: list[str] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._managers: contextlib.ExitStack = contextlib.ExitStack()
        self.started = 0.0

    def __enter__(self) -> HoldThroughFailover:
        (holder,) = self._managers.enter_context(
            lock_managers(self.urls, 1, wait_replicas=self.wait_replicas)
        )
        others = self._managers.enter_context(
            lock_managers(self.urls, self.contenders, wait_replicas=self.wait_replicas)
        )
        self.keeper = LockKeeper(holder)
        lock = holder.acquire(self.resource, self.ttl, owner="holder")
        assert lock is not None, "the holder did not get the lock"
        self.lock = lock
        self.kept = self.keeper.keep(lock, self._lost)
        for manager in others:
            assert not isinstance(manager.attempt(self.resource, 10.0, rounds=1), Acquired)
            thread = threading.Thread(target=self._contend, args=(manager,), daemon=True)
            self._threads.append(thread)
            thread.start()
        self.started = time.monotonic()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        self.keeper.stop(self.kept)
        self._managers.close()

    def holds(self) -> bool:
        """Whether the holder believes it holds the lock now."""
        return self.lost_at is None and time.monotonic() < self.lock.valid_until

    def watch(self, seconds: float) -> None:
        """Let the contenders try for ``seconds`` more."""
        self._stop.wait(seconds)
        assert not self.errors, self.errors

    def _lost(self, kept: KeptLock) -> None:
        self.lost_at = time.monotonic()

    def _contend(self, manager: Redlock) -> None:
        while not self._stop.is_set():
            try:
                outcome = manager.attempt(self.resource, self.ttl, "contender", rounds=1)
            except BaseException as error:
                self.errors.append(error)
                return
            if isinstance(outcome, Acquired):
                now = time.monotonic()
                self.granted_at.append(now - self.started)
                if self.holds():
                    self.overlaps.append(
                        f"granted at {now - self.started:.3f}s while the holder believed it"
                        f" held until {self.lock.valid_until - self.started:.3f}s"
                    )
                manager.release(outcome.lock)
            self._stop.wait(0.01)
