"""Helpers of the topology tests (tests/test_topology_*.py): lock managers over Cluster and
Sentinel lock nodes, and a rival that keeps trying to take a lock while a test fails servers
over under its holder."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType

from celery_redlock import Redlock, RedlockSettings
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
