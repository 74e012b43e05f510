"""Small helpers shared by the tests/test_redlock_*.py modules (not a harness: servers come
from celery_redlock.testing through the fixtures of tests/conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from celery_redlock.testing import RedisServer


def wait_until(condition: Callable[[], object], timeout: float = 3.0) -> bool:
    """Poll ``condition`` every few milliseconds; True as soon as it holds, False at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def value_on(server: RedisServer, key: str) -> str | None:
    """The value of ``key`` on one running, unpaused server (None when absent)."""
    with server.client(socket_timeout=2, decode_responses=True) as client:
        value: str | None = client.get(key)
        return value


def values_on(servers: Iterable[RedisServer], key: str) -> list[str | None]:
    """The value of ``key`` on each server, in order."""
    return [value_on(server, key) for server in servers]


def pttl_on(server: RedisServer, key: str) -> int:
    """PTTL of ``key`` on one server (-2 when absent, -1 without expiry)."""
    with server.client(socket_timeout=2) as client:
        return int(client.pttl(key))


class Stopwatch:
    """``with Stopwatch() as watch: ...`` then ``watch.elapsed`` in seconds (monotonic)."""

    def __enter__(self) -> Stopwatch:
        self.started = time.monotonic()
        self.elapsed = 0.0
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.elapsed = time.monotonic() - self.started
