"""What a run does when its lock is taken (``on_duplicate``), when the lock nodes are down
(``on_unavailable``), after it ends (``lock_hold``), and when the broker delivers the same task
id again while it runs — each with a real embedded worker whose pool runs duplicates at once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import pytest
from celery.result import AsyncResult
from celery_apps.support import (
    LockSignals,
    RunLog,
    embedded_worker,
    key_gone,
    make_app,
)
from redlock_support import pttls_on, values_on, wait_until

from celery_redlock import (
    DuplicateSkipped,
    LockNotAcquired,
    QuorumUnavailable,
    SingletonTask,
    singleton_task,
)
from celery_redlock.testing import RedisNodes, RedisServer

pytest_plugins = ["celery_apps.fixtures"]


def _holding_task(
    app: Any, run_log: RunLog, gate: threading.Event, name: str, **options: Any
) -> Any:
    """A task locked on ``item``; a run called with ``hold=True`` waits for the gate."""

    @singleton_task(app=app, shared=False, bind=True, name=name, lock_args=("item",), **options)
    def job(self: SingletonTask, item: int, hold: bool = False) -> dict[str, Any]:
        entry = {"id": self.request.id, "retries": self.request.retries, "key": self.lock.key}
        with run_log.run(self.lock.key, task_id=self.request.id):
            if hold:
                gate.wait(10)
        return entry

    return job


def _hold_then_duplicate(job: Any, run_log: RunLog) -> tuple[AsyncResult, str, AsyncResult]:
    """Start a run of item 1 that holds its lock until the gate opens; once it runs, send a
    duplicate of it. Returns the first run's result, its lock key and the duplicate's result."""
    first = job.delay(1, hold=True)
    key = run_log.wait_task_started(first.id)["key"]
    return first, key, job.delay(1)


# -- on_duplicate ------------------------------------------------------------------------------


def test_skip_reports_revoked_with_duplicate_skipped_and_leaves_the_holder_alone(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    gate: threading.Event,
    run_log: RunLog,
    lock_signals: LockSignals,
) -> None:
    app = make_app(broker, lock_nodes)
    job = _holding_task(app, run_log, gate, "policy.skip", on_duplicate="skip")

    with embedded_worker(app, concurrency=4):
        first, key, second = _hold_then_duplicate(job, run_log)
        with pytest.raises(DuplicateSkipped) as skipped:
            second.get(timeout=10)
        assert second.state == "REVOKED"
        assert skipped.value.key == key
        assert first.id in str(skipped.value)  # it names the run holding the lock
        (duplicate,) = lock_signals.of("lock_duplicate", task_id=second.id)
        assert duplicate["policy"] == "skip"
        assert duplicate["holder"]["id"] == first.id

        # The skipped run released nothing: the first run still holds its lock everywhere.
        assert all(value and first.id in value for value in values_on(lock_nodes, key))

        gate.set()
        assert first.get(timeout=10)["id"] == first.id
    assert [run["task_id"] for run in run_log.runs()] == [first.id]
    assert key_gone(lock_nodes, key)
    assert lock_signals.of("lock_released", task_id=second.id) == []  # it held nothing


def test_retry_runs_the_duplicate_after_the_holder_and_never_alongside(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    gate: threading.Event,
    run_log: RunLog,
    lock_signals: LockSignals,
) -> None:
    app = make_app(broker, lock_nodes)
    job = _holding_task(app, run_log, gate, "policy.retry", on_duplicate="retry", max_retries=6)

    with embedded_worker(app, concurrency=4):
        first, _, second = _hold_then_duplicate(job, run_log)
        lock_signals.wait("lock_duplicate", task_id=second.id, policy="retry")
        assert second.state in ("PENDING", "RETRY")
        gate.set()
        first_entry = first.get(timeout=10)
        second_entry = second.get(timeout=20)

    assert second_entry["retries"] >= 1
    assert second_entry["key"] == first_entry["key"]
    assert [run["task_id"] for run in run_log.runs()] == [first.id, second.id]


def test_retry_honours_max_retries_and_fails_with_lock_not_acquired(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    gate: threading.Event,
    run_log: RunLog,
    lock_signals: LockSignals,
) -> None:
    app = make_app(broker, lock_nodes)
    job = _holding_task(app, run_log, gate, "policy.retry_max", on_duplicate="retry", max_retries=1)

    with embedded_worker(app, concurrency=4):
        first, key, second = _hold_then_duplicate(job, run_log)
        with pytest.raises(LockNotAcquired) as raised:
            second.get(timeout=20)
        assert second.state == "FAILURE"
        assert raised.value.key == key
        attempts = lock_signals.of("lock_duplicate", task_id=second.id)
        assert len(attempts) == 2  # the first attempt and its one retry
        gate.set()
        first.get(timeout=10)
    assert [run["task_id"] for run in run_log.runs()] == [first.id]


def test_raise_fails_the_duplicate_at_once(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)
    job = _holding_task(app, run_log, gate, "policy.raise", on_duplicate="raise")

    with embedded_worker(app, concurrency=4):
        first, key, second = _hold_then_duplicate(job, run_log)
        with pytest.raises(LockNotAcquired) as raised:
            second.get(timeout=10)
        assert not isinstance(raised.value, DuplicateSkipped)
        assert second.state == "FAILURE"
        assert raised.value.key == key
        assert first.id in (raised.value.holder or "")
        assert job.delay(2).get(timeout=10)["key"] != key  # other keys are not affected
        gate.set()
        first.get(timeout=10)
    assert sorted(run["task_id"] for run in run_log.runs() if run["key"] == key) == [first.id]


def test_wait_starts_the_duplicate_as_soon_as_the_holder_releases(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    gate: threading.Event,
    run_log: RunLog,
    lock_signals: LockSignals,
) -> None:
    # With a 30 s ttl, a waiter that polled on the holder's remaining ttl would sleep for
    # about 30 s: starting within half a second of the release takes the release notification.
    app = make_app(broker, lock_nodes)
    job = _holding_task(app, run_log, gate, "policy.wait", on_duplicate="wait", lock_ttl=30)

    with embedded_worker(app, concurrency=4):
        first, _, second = _hold_then_duplicate(job, run_log)
        lock_signals.wait("lock_duplicate", task_id=second.id, policy="wait")
        time.sleep(0.3)  # the waiter is now blocked on the release notification
        assert len(run_log.started()) == 1
        gate.set()
        first.get(timeout=10)
        second_entry = second.get(timeout=10)

    first_run, second_run = run_log.runs()
    assert second_run["task_id"] == second.id
    assert second_entry["retries"] == 0  # it waited, it did not retry
    gap = second_run["start"] - first_run["end"]
    assert 0 <= gap < 0.5, gap
    (acquired,) = lock_signals.of("lock_acquired", task_id=second.id)
    assert acquired["waited"] >= 0.3


def test_wait_falls_back_to_retry_after_lock_wait(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    gate: threading.Event,
    run_log: RunLog,
    lock_signals: LockSignals,
) -> None:
    app = make_app(broker, lock_nodes)
    job = _holding_task(
        app, run_log, gate, "policy.wait_short", on_duplicate="wait", lock_wait=0.3, max_retries=6
    )

    with embedded_worker(app, concurrency=4):
        first, _, second = _hold_then_duplicate(job, run_log)
        lock_signals.wait("lock_duplicate", 2, timeout=15, task_id=second.id)  # waited, retried
        gate.set()
        first.get(timeout=10)
        assert second.get(timeout=20)["retries"] >= 1
    assert [run["task_id"] for run in run_log.runs()] == [first.id, second.id]


# -- on_unavailable ----------------------------------------------------------------------------


def _stop_majority(lock_nodes: RedisNodes) -> None:
    lock_nodes[0].stop()
    lock_nodes[1].stop()


def test_unavailable_retry_waits_for_the_nodes_without_spending_retries(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    # max_retries=0: waiting for the lock nodes through Celery's retry() spent the retry budget,
    # and the work failed with QuorumUnavailable at the first outage.
    app = make_app(broker, lock_nodes)
    gate = threading.Event()
    gate.set()
    job = _holding_task(app, run_log, gate, "policy.unavailable_retry", max_retries=0)

    with embedded_worker(app, concurrency=3):
        for server in lock_nodes:
            server.stop()
        results = [job.delay(item) for item in range(3)]
        for result in results:
            (event,) = lock_signals.wait("lock_unavailable", task_id=result.id, timeout=10)
            assert event["policy"] == "retry"
        time.sleep(2.0)  # the outage lasts a while; nothing runs, nothing fails meanwhile
        assert run_log.started() == []
        assert {result.state for result in results} == {"PENDING"}
        for server in lock_nodes:
            server.restart()
        back_at = time.time()
        entries = [result.get(timeout=20) for result in results]

    assert [entry["retries"] for entry in entries] == [0, 0, 0]
    assert sorted(run["task_id"] for run in run_log.runs()) == sorted(r.id for r in results)
    first_start = min(run["start"] for run in run_log.runs())
    assert first_start - back_at < 1.5, first_start - back_at  # within about a second
    assert all(key_gone(lock_nodes, entry["key"]) for entry in entries)


def test_unavailable_timeout_fails_the_task_loudly(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    run_log: RunLog,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(broker, lock_nodes, redlock_unavailable_timeout=1.0)
    job = _holding_task(app, run_log, threading.Event(), "policy.unavailable_timeout")

    with caplog.at_level(logging.ERROR, logger="celery_redlock"), embedded_worker(app):
        _stop_majority(lock_nodes)
        started = time.monotonic()
        result = job.delay(1)
        with pytest.raises(QuorumUnavailable):
            result.get(timeout=15)
        assert 1.0 <= time.monotonic() - started < 8
    assert result.state == "FAILURE"
    assert run_log.started() == []
    assert any("redlock_unavailable_timeout" in record.getMessage() for record in caplog.records)


def test_a_long_outage_defers_the_message_and_keeps_its_retries(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    # A soft time limit of 2 s bounds the wait in the pool process to 1 s: then the message is
    # published again (same id, same retries) and this delivery ends, freeing the process.
    app = make_app(broker, lock_nodes)
    gate = threading.Event()
    gate.set()
    job = _holding_task(
        app, run_log, gate, "policy.unavailable_defer", max_retries=0, soft_time_limit=2
    )

    with embedded_worker(app, concurrency=2):
        _stop_majority(lock_nodes)
        result = job.delay(1)
        lock_signals.wait("lock_unavailable", 3, task_id=result.id, timeout=15)  # 3 deliveries
        assert run_log.started() == []
        lock_nodes[0].restart()
        lock_nodes[1].restart()
        entry = result.get(timeout=20)

    assert entry["id"] == result.id and entry["retries"] == 0
    assert [run["task_id"] for run in run_log.runs()] == [result.id]


def test_unavailable_raise_fails_with_quorum_unavailable(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)
    job = _holding_task(
        app, run_log, threading.Event(), "policy.unavailable_raise", on_unavailable="raise"
    )

    with embedded_worker(app, concurrency=2):
        _stop_majority(lock_nodes)
        result = job.delay(1)
        with pytest.raises(QuorumUnavailable) as raised:
            result.get(timeout=10)
    assert result.state == "FAILURE"
    assert raised.value.needed == 2
    assert raised.value.answered < 2
    assert lock_signals.of("lock_unavailable", task_id=result.id)[0]["policy"] == "raise"
    assert run_log.started() == []


def test_unavailable_run_runs_unguarded(
    broker: RedisServer, lock_nodes: RedisNodes, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(
        app=app, shared=False, bind=True, name="policy.unavailable_run", on_unavailable="run"
    )
    def job(self: SingletonTask, item: int) -> str:
        return f"ran {item} with lock {self.lock}"

    with embedded_worker(app, concurrency=2):
        _stop_majority(lock_nodes)
        result = job.delay(1)
        assert result.get(timeout=10) == "ran 1 with lock None"
    assert lock_signals.of("lock_unavailable", task_id=result.id)[0]["policy"] == "run"
    assert lock_signals.of("lock_acquired", task_id=result.id) == []


# -- lock_hold ---------------------------------------------------------------------------------


def test_lock_hold_skips_calls_within_the_window_and_runs_one_after_it(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)
    gate = threading.Event()
    job = _holding_task(app, run_log, gate, "policy.hold", lock_hold=2.0, lock_ttl=30)

    with embedded_worker(app, concurrency=2):
        first = job.delay(1)
        key = first.get(timeout=10)["key"]
        ended = run_log.runs()[0]["end"]
        (released,) = lock_signals.wait("lock_released", task_id=first.id)
        assert released["released"] is False  # kept for the hold window
        assert all(0 < pttl <= 2_000 for pttl in pttls_on(lock_nodes, key))  # held 2 s, not 30

        with pytest.raises(DuplicateSkipped):
            job.delay(1).get(timeout=10)
        assert time.time() - ended < 2.0  # the skip happened inside the window

        assert wait_until(lambda: key_gone(lock_nodes, key), timeout=5)
        assert time.time() - ended >= 1.9
        third = job.delay(1)
        assert third.get(timeout=10)["key"] == key
    assert [run["task_id"] for run in run_log.runs()] == [first.id, third.id]


def test_lock_hold_does_not_block_the_tasks_own_retry(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(
        app=app, shared=False, bind=True, name="policy.hold_retry", lock_hold=20, lock_ttl=30
    )
    def job(self: SingletonTask, item: int) -> int:
        with run_log.run(self.lock.key, task_id=self.request.id):
            pass
        if self.request.retries == 0:
            raise self.retry(countdown=0.05)
        return int(self.request.retries)

    with embedded_worker(app, concurrency=2):
        started = time.monotonic()
        result = job.delay(1)
        assert result.get(timeout=10) == 1
        assert time.monotonic() - started < 5  # not after the 20 s hold window
    states = [event["state"] for event in lock_signals.of("lock_released", task_id=result.id)]
    assert states == ["RETRY", "SUCCESS"]
    assert len(run_log.runs()) == 2


# -- the same task id delivered again while it runs --------------------------------------------


def test_same_task_id_delivered_again_while_running_is_not_run_twice(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    gate: threading.Event,
    run_log: RunLog,
    lock_signals: LockSignals,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # What a Redis broker does to an acks_late task that outlives visibility_timeout: the same
    # message, same task id and retries, while the first copy still runs. Even with
    # on_duplicate="retry" the copy must neither run nor be retried.
    caplog.set_level(logging.INFO, logger="celery_redlock")
    app = make_app(broker, lock_nodes)
    job = _holding_task(
        app, run_log, gate, "policy.redelivered", on_duplicate="retry", acks_late=True
    )
    task_id = str(uuid.uuid4())

    with embedded_worker(app, concurrency=4):
        job.apply_async((1,), {"hold": True}, task_id=task_id)
        run_log.wait_task_started(task_id)
        job.apply_async((1,), {"hold": True}, task_id=task_id)
        (copy,) = lock_signals.wait("lock_duplicate", task_id=task_id)
        assert copy["policy"] == "redelivered"
        # The log names the holder as people read it, not as the library stores it.
        assert wait_until(lambda: "a copy of it holds the lock (task " in caplog.text)
        assert "Owner(" not in caplog.text
        gate.set()
        entry = AsyncResult(task_id, app=app).get(timeout=10)

    assert entry["id"] == task_id
    assert len(run_log.started()) == 1
    assert [event["policy"] for event in lock_signals.of("lock_duplicate")] == ["redelivered"]
    assert key_gone(lock_nodes, entry["key"])
