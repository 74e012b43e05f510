"""Enqueue-time de-duplication (lock_on_enqueue=True) with a real Redis broker and worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redlock import singleton_task
from celery_redlock.testing import RedisNodes

TTL = 2.0


@pytest.fixture
def setup(redis_nodes: Any) -> Iterator[tuple[Celery, RedisNodes, Any]]:
    nodes = redis_nodes(4)  # three lock nodes, one broker + result backend + run log
    broker = nodes[3]
    app = Celery("enqueue_tests", broker=broker.url, backend=broker.url, set_as_current=False)
    app.conf.redlock_urls = nodes.urls[:3]
    app.conf.redlock_node_timeout = 0.5
    app.conf.broker_connection_retry_on_startup = True
    log = broker.client()

    @singleton_task(
        app=app, shared=False, bind=True, lock_on_enqueue=True, lock_ttl=TTL, max_retries=2
    )
    def export(self: Any, account: int, fail_once: bool = False) -> int:
        log.rpush("runs", json.dumps([account, self.request.id, self.request.retries]))
        time.sleep(0.4)
        if fail_once and self.request.retries == 0:
            raise self.retry(countdown=0)
        return account

    app.export = export  # type: ignore[attr-defined]
    yield app, nodes, log
    log.close()
    app.close()


def runs(log: Any) -> list[list[Any]]:
    return [json.loads(item) for item in log.lrange("runs", 0, -1)]


def test_duplicates_return_the_queued_call_and_publish_nothing(setup: Any) -> None:
    app, _nodes, log = setup
    first = app.export.delay(1)
    second = app.export.delay(account=1)
    other = app.export.delay(2)
    assert second.id == first.id
    assert other.id != first.id
    assert log.llen("celery") == 2  # two messages on the broker, not three
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert first.get(timeout=15) == 1
        assert other.get(timeout=15) == 2
    assert sorted(run[0] for run in runs(log)) == [1, 2]


def test_while_running_the_running_call_is_returned_and_retries_are_queued(setup: Any) -> None:
    app, _nodes, log = setup
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        running = app.export.delay(3, fail_once=True)
        deadline = time.monotonic() + 10
        while not runs(log) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert app.export.delay(3, fail_once=True).id == running.id
        assert running.get(timeout=15) == 3
        time.sleep(0.1)  # the postrun release follows the stored result
        fresh = app.export.delay(3, fail_once=True)
        assert fresh.id != running.id
        assert fresh.get(timeout=15) == 3
    attempts = [(run[1], run[2]) for run in runs(log)]
    # Each call ran its first attempt and its retry (same id, queued despite the lock).
    assert attempts == [(running.id, 0), (running.id, 1), (fresh.id, 0), (fresh.id, 1)]


def test_an_unclaimed_enqueue_lock_expires_within_one_ttl(setup: Any) -> None:
    app, _nodes, log = setup
    first = app.export.delay(4)
    log.delete("celery")  # the message is lost (say, a broker without persistence restarted)
    assert app.export.delay(4).id == first.id
    time.sleep(TTL + 0.1)
    replacement = app.export.delay(4)
    assert replacement.id != first.id
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        assert replacement.get(timeout=15) == 4


def test_send_task_bypasses_enqueue_but_not_the_execution_lock(setup: Any) -> None:
    app, _nodes, log = setup
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        held = app.export.delay(5)
        deadline = time.monotonic() + 10
        while not runs(log) and time.monotonic() < deadline:
            time.sleep(0.01)
        sent = app.send_task(app.export.name, args=(5,))
        assert sent.id != held.id  # send_task published a message of its own...
        assert held.get(timeout=15) == 5
        with pytest.raises(Exception) as raised:
            sent.get(timeout=15)
        assert type(raised.value).__name__ == "DuplicateSkipped"  # ...which the run lock skipped
    assert [run[1] for run in runs(log)] == [held.id]
