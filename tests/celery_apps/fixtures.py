"""Fixtures of the tests/test_celery_*.py modules (loaded with ``pytest_plugins``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from conftest import MakeRedisNodes

from celery_apps.support import LockSignals, RunLog
from celery_redlock.testing import RedisNodes, RedisServer


@pytest.fixture
def broker(redis_nodes: MakeRedisNodes) -> RedisServer:
    """A harness Redis node for the broker, the result back-end and the run log."""
    return redis_nodes(1)[0]


@pytest.fixture
def lock_nodes(redis_nodes: MakeRedisNodes) -> RedisNodes:
    """Three independent harness Redis masters for the locks."""
    return redis_nodes(3)


@pytest.fixture
def lock_signals() -> Iterator[LockSignals]:
    """The celery_redlock signals sent in this process during the test."""
    recorder = LockSignals().connect()
    yield recorder
    recorder.disconnect()


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Holds task bodies until the test opens it (opened at teardown whatever happens)."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def run_log(broker: RedisServer) -> Iterator[RunLog]:
    """The test's run log; at teardown, no two runs of one key may have overlapped."""
    log = RunLog(broker.url)
    yield log
    log.assert_no_overlap()
