"""``on_duplicate="coalesce"``: at most one run and one pending run per key, on real lock nodes
with a real embedded worker (and, for a pending run whose worker dies, real worker processes:
tests/test_guarantees_prefork.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from celery_apps.support import LockSignals, RunLog, embedded_worker, key_gone, make_app
from redlock_support import wait_until

from celery_redlock import DuplicateCoalesced, SingletonTask, singleton_task
from celery_redlock.testing import RedisNodes, RedisServer

pytest_plugins = ["celery_apps.fixtures"]


def _coalescing_task(app: Any, run_log: RunLog, gates: dict[int, threading.Event]) -> Any:
    """A task coalescing on ``key``; the run called with ``gate=n`` waits for ``gates[n]``."""

    @singleton_task(
        app=app,
        shared=False,
        bind=True,
        name="coalesce.refresh",
        lock_args=("key",),
        on_duplicate="coalesce",
    )
    def refresh(self: SingletonTask, key: str, gate: int = 0) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            if gate:
                gates[gate].wait(10)
        return str(self.request.id)

    return refresh


def test_a_flood_of_duplicates_runs_once_more_after_the_current_run(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)
    gates = {1: threading.Event()}
    refresh = _coalescing_task(app, run_log, gates)

    with embedded_worker(app, concurrency=4):
        first = refresh.delay("report", gate=1)
        run_log.wait_task_started(first.id)
        duplicates = [refresh.delay("report") for _ in range(10)]
        (pending,) = lock_signals.wait("lock_duplicate", policy="coalesce", timeout=10)
        merged = lock_signals.wait("lock_duplicate", 9, policy="coalesced", timeout=10)
        assert {event["holder"]["id"] for event in merged} == {pending["task_id"]}
        assert len(run_log.started()) == 1  # nothing else ran meanwhile
        gates[1].set()
        assert first.get(timeout=10) == first.id
        ran = [result for result in duplicates if result.id == pending["task_id"]]
        assert ran[0].get(timeout=10) == pending["task_id"]
        for result in duplicates:
            if result.id != pending["task_id"]:
                with pytest.raises(DuplicateCoalesced) as coalesced:
                    result.get(timeout=10)
                assert coalesced.value.into == pending["task_id"]
                assert result.state == "REVOKED"

    first_run, second_run = run_log.runs()
    assert second_run["task_id"] == pending["task_id"]
    # Woken by the release notification, not by polling the 60 s ttl.
    assert 0 <= second_run["start"] - first_run["end"] < 0.5
    assert key_gone(lock_nodes, first_run["key"])
    assert key_gone(lock_nodes, first_run["key"] + ":pending")


def test_a_duplicate_arriving_after_the_pending_run_started_runs_again(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    # The pending run gives its slot up when it starts: a change after that start is not in
    # its work, so the next duplicate becomes the next pending run instead of merging.
    app = make_app(broker, lock_nodes)
    gates = {1: threading.Event(), 2: threading.Event()}
    refresh = _coalescing_task(app, run_log, gates)

    with embedded_worker(app, concurrency=4):
        first = refresh.delay("feed", gate=1)
        run_log.wait_task_started(first.id)
        second = refresh.delay("feed", gate=2)
        lock_signals.wait("lock_duplicate", policy="coalesce", task_id=second.id, timeout=10)
        gates[1].set()
        run_log.wait_task_started(second.id)
        third = refresh.delay("feed")
        lock_signals.wait("lock_duplicate", policy="coalesce", task_id=third.id, timeout=10)
        gates[2].set()
        assert [result.get(timeout=10) for result in (first, second, third)] == [
            first.id,
            second.id,
            third.id,
        ]
    assert [run["task_id"] for run in run_log.runs()] == [first.id, second.id, third.id]
    assert lock_signals.of("lock_duplicate", policy="coalesced") == []


def test_coalescing_keys_are_independent(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)
    gates = {1: threading.Event()}
    refresh = _coalescing_task(app, run_log, gates)

    with embedded_worker(app, concurrency=4):
        held = refresh.delay("a", gate=1)
        run_log.wait_task_started(held.id)
        started = time.monotonic()
        assert refresh.delay("b").get(timeout=10)  # another key runs at once
        assert time.monotonic() - started < 5
        gates[1].set()
        held.get(timeout=10)
    assert wait_until(lambda: len(run_log.runs()) == 2)
