"""A run's lock from start to end: released on every outcome, in eager mode and on direct calls;
kept alive past its ttl while the body runs; lost (and said so) when the nodes drop it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from typing import Any

import pytest
from celery.exceptions import Ignore, Reject
from celery_apps.support import (
    LockSignals,
    RunLog,
    documented_key,
    embedded_worker,
    key_gone,
    key_held,
    lock_keys,
    make_app,
)
from redlock_support import pttls_on, wait_until

from celery_redlock import (
    DuplicateSkipped,
    LockLost,
    LockNotAcquired,
    Redlock,
    SingletonTask,
    singleton_task,
)
from celery_redlock.integration.run import Run, current_run
from celery_redlock.lock import keyspace
from celery_redlock.testing import RedisNodes, RedisServer

pytest_plugins = ["celery_apps.fixtures"]


# -- release on every outcome ------------------------------------------------------------------


class Flaky(ConnectionError):
    """Raised once by the autoretry task."""


OUTCOMES = [
    pytest.param("success", ["SUCCESS"], id="success"),
    pytest.param("failure", ["FAILURE"], id="failure"),
    pytest.param("ignore", ["IGNORED"], id="ignore"),
    pytest.param("reject", ["REJECTED"], id="reject"),
    pytest.param("retry", ["RETRY", "SUCCESS"], id="retry"),
    pytest.param("autoretry", ["RETRY", "SUCCESS"], id="autoretry"),
]


def resource_of(key: str) -> str:
    """The resource a documented lock key locks."""
    resource = keyspace.resource_of("redlock:", key)
    assert resource is not None, key
    return resource


@pytest.mark.parametrize(("kind", "states"), OUTCOMES)
def test_the_lock_is_released_on_every_outcome(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    run_log: RunLog,
    lock_signals: LockSignals,
    kind: str,
    states: list[str],
) -> None:
    app = make_app(broker, lock_nodes)
    held_inside: list[bool] = []

    @singleton_task(
        app=app,
        shared=False,
        bind=True,
        name="life.outcome",
        max_retries=3,
        autoretry_for=(Flaky,),
        retry_kwargs={"countdown": 0.05},
    )
    def outcome(self: SingletonTask, kind: str) -> int:
        with run_log.run(self.lock.key, task_id=self.request.id):
            held_inside.append(key_held(lock_nodes, self.lock.key))
        first_attempt = self.request.retries == 0
        if kind == "failure":
            raise ValueError("boom")
        if kind == "ignore":
            raise Ignore()
        if kind == "reject":
            raise Reject("rejected", requeue=False)
        if kind == "retry" and first_attempt:
            raise self.retry(countdown=0.05)
        if kind == "autoretry" and first_attempt:
            raise Flaky("once")
        return int(self.request.retries)

    with embedded_worker(app, concurrency=2):
        result = outcome.delay(kind)
        released = lock_signals.wait("lock_released", len(states), task_id=result.id)
        if kind == "failure":
            with pytest.raises(ValueError, match="boom"):
                result.get(timeout=10)
        elif kind in ("success", "retry", "autoretry"):
            assert result.get(timeout=10) == len(states) - 1

    key = documented_key("life.outcome", {"kind": kind})
    assert [event["state"] for event in released] == states
    assert [(event["key"], event["released"]) for event in released] == [(key, True)] * len(states)
    assert held_inside == [True] * len(states)  # every attempt held the lock while it ran
    assert key_gone(lock_nodes, key)
    assert len(run_log.runs()) == len(states)


# -- eager mode and direct calls ---------------------------------------------------------------


def _external_redlock(lock_nodes: RedisNodes) -> Redlock:
    return Redlock(lock_nodes.urls)


def test_eager_mode_takes_and_releases_the_lock(
    broker: RedisServer, lock_nodes: RedisNodes, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes, task_always_eager=True)
    ran: list[int] = []

    @singleton_task(app=app, shared=False, bind=True, name="life.eager")
    def eager(self: SingletonTask, item: int, fail: bool = False) -> dict[str, Any]:
        ran.append(item)
        if fail:
            raise ValueError("eager failure")
        return {"key": self.lock.key, "held": key_held(lock_nodes, self.lock.key)}

    key = documented_key("life.eager", {"item": 1, "fail": False})
    observed = eager.delay(1).get(timeout=5)
    assert observed == {"key": key, "held": True}
    assert key_gone(lock_nodes, key)

    failed = eager.delay(2, fail=True)
    assert failed.state == "FAILURE"
    assert key_gone(lock_nodes, documented_key("life.eager", {"item": 2, "fail": True}))

    # Held elsewhere: the eager call is skipped without running its body.
    redlock = _external_redlock(lock_nodes)
    other = redlock.acquire(resource_of(key), ttl=30)
    assert other is not None
    skipped = eager.delay(1)
    assert skipped.state == "IGNORED"
    assert ran == [1, 2]
    assert lock_signals.of("lock_duplicate", task="life.eager")[0]["policy"] == "skip"
    redlock.release(other)
    assert eager.delay(1).get(timeout=5)["held"] is True
    assert ran == [1, 2, 1]
    assert key_gone(lock_nodes, key)


def test_a_direct_call_takes_and_releases_the_lock(
    broker: RedisServer, lock_nodes: RedisNodes
) -> None:
    app = make_app(broker, lock_nodes)
    ran: list[int] = []

    @singleton_task(app=app, shared=False, name="life.direct")
    def direct(item: int, fail: bool = False) -> bool:
        ran.append(item)
        if fail:
            raise ValueError("direct failure")
        return key_held(lock_nodes, documented_key("life.direct", {"item": item, "fail": fail}))

    @singleton_task(app=app, shared=False, name="life.direct_raise", on_duplicate="raise")
    def direct_raise(item: int) -> int:
        ran.append(-item)
        return item

    assert direct(1) is True  # the lock was held while the body ran
    with pytest.raises(ValueError, match="direct failure"):
        direct(2, fail=True)
    assert all(not keys for keys in lock_keys(lock_nodes))  # both released

    redlock = _external_redlock(lock_nodes)
    key = documented_key("life.direct", {"item": 1, "fail": False})
    other = redlock.acquire(resource_of(key), ttl=30)
    raise_key = documented_key("life.direct_raise", {"item": 5})
    other_raise = redlock.acquire(resource_of(raise_key), ttl=30)
    assert other is not None and other_raise is not None
    assert direct(1) is None  # on_duplicate="skip": not run
    with pytest.raises(LockNotAcquired):
        direct_raise(5)
    assert ran == [1, 2]
    redlock.release(other)
    redlock.release(other_raise)
    assert direct_raise(5) == 5
    assert ran == [1, 2, -5]


def test_a_direct_call_of_a_bound_task_sees_its_lock(
    broker: RedisServer, lock_nodes: RedisNodes
) -> None:
    # A bound task written for the worker (it extends its lock as it goes) works when called
    # as a plain function too: the direct call holds a lock, and `self.lock` is that lock.
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="life.direct_bound", lock_ttl=5)
    def chunked(self: SingletonTask, item: int) -> dict[str, Any]:
        assert self.lock is not None
        extended = self.extend_lock(ttl=20)
        return {
            "key": self.lock.key,
            "extended": extended,
            "pttls": pttls_on(lock_nodes, self.lock.key),
        }

    observed = chunked(3)
    assert observed["key"] == documented_key("life.direct_bound", {"item": 3})
    assert observed["extended"] is True
    assert all(15_000 < pttl <= 20_000 for pttl in observed["pttls"])
    assert key_gone(lock_nodes, observed["key"])


def test_a_finished_run_is_freed_at_once(broker: RedisServer, lock_nodes: RedisNodes) -> None:
    # Freed by reference counting as it ends, not left as a cycle (run, kept lock, the keeper's
    # callback) for the cycle collector: that kept every run's request, arguments included, until
    # a collection, and made the collector work on every task.
    app = make_app(broker, lock_nodes)
    runs: list[weakref.ref[Run]] = []

    @singleton_task(app=app, shared=False, bind=True, name="life.freed")
    def freed(self: SingletonTask, item: int) -> int:
        run = current_run(self)
        assert run is not None and run.kept is not None  # held, and in the keeper's care
        runs.append(weakref.ref(run))
        return item

    gc.collect()
    gc.disable()
    try:
        assert freed(1) == 1
        assert runs[0]() is None
    finally:
        gc.enable()


# -- auto-extension ----------------------------------------------------------------------------


def test_a_run_three_times_its_ttl_keeps_its_lock(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="life.long", lock_ttl=1)
    def long_run(self: SingletonTask, item: int, seconds: float = 0.0) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            time.sleep(seconds)
        return str(self.request.id)

    with embedded_worker(app, concurrency=4):
        first = long_run.delay(1, 3.0)
        started = run_log.wait_task_started(first.id)
        key = started["key"]
        time.sleep(max(0.0, started["start"] + 2.0 - time.time()))  # two ttls into the run
        assert all(0 < pttl <= 1_000 for pttl in pttls_on(lock_nodes, key))  # extended, not longer
        duplicate = long_run.apply_async((1,), {"seconds": 3.0})
        with pytest.raises(DuplicateSkipped):
            duplicate.get(timeout=10)
        assert first.get(timeout=10) == first.id
    (run,) = run_log.runs()
    assert run["end"] - run["start"] >= 3.0
    assert lock_signals.of("lock_lost") == []
    (released,) = lock_signals.wait("lock_released", task_id=first.id)
    assert released["released"] is True  # still ours at the end


def test_without_auto_extension_the_lock_expires_mid_run(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    gate: threading.Event,
    run_log: RunLog,
    lock_signals: LockSignals,
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(
        app=app, shared=False, bind=True, name="life.no_extend", lock_ttl=1, lock_auto_extend=False
    )
    def no_extend(self: SingletonTask) -> None:
        with run_log.run(self.lock.key, task_id=self.request.id):
            gate.wait(10)

    with embedded_worker(app, concurrency=2):
        result = no_extend.delay()
        started = run_log.wait_task_started(result.id)
        assert wait_until(lambda: key_gone(lock_nodes, started["key"]), timeout=3)
        assert time.time() - started["start"] >= 0.9  # expired after its ttl, not before
        assert run_log.runs() == []  # while the body still runs
        gate.set()
        result.get(timeout=10)
    (released,) = lock_signals.wait("lock_released", task_id=result.id)
    assert released["released"] is False  # nothing left to release


def test_losing_a_minority_node_mid_run_keeps_the_lock(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="life.minority", lock_ttl=1)
    def steady(self: SingletonTask) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            time.sleep(2.5)
        return str(self.lock.key)

    with embedded_worker(app, concurrency=2):
        result = steady.delay()
        run_log.wait_task_started(result.id)
        lock_nodes[2].kill()
        key = result.get(timeout=10)
    assert lock_signals.of("lock_lost") == []
    (released,) = lock_signals.wait("lock_released", task_id=result.id)
    assert released["released"] is True
    for server in lock_nodes.servers[:2]:  # released on the nodes that are still up
        with server.client() as client:
            assert client.exists(key) == 0


# -- losing the lock ---------------------------------------------------------------------------


def _take_over_everywhere(lock_nodes: RedisNodes, key: str) -> None:
    """Another owner's value on every node (a key that is merely missing is set again by the
    next extension: that is how a node that restarted empty heals)."""
    for server in lock_nodes:
        with server.client() as client:
            client.set(key, "another-token|another owner", px=30_000)


def test_a_lock_taken_by_another_owner_is_reported_lost(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    run_log: RunLog,
    lock_signals: LockSignals,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="life.lossy", lock_ttl=1)
    def lossy(self: SingletonTask) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            lock_signals.wait("lock_lost", task_id=self.request.id, timeout=10)
            try:
                self.extend_lock()
            except LockLost as lost:
                return f"LockLost: {lost.key}"
        return "extended a lost lock"

    with caplog.at_level(logging.ERROR, logger="celery_redlock"), embedded_worker(app):
        result = lossy.delay()
        key = run_log.wait_task_started(result.id)["key"]
        _take_over_everywhere(lock_nodes, key)
        assert result.get(timeout=15) == f"LockLost: {key}"

    (lost,) = lock_signals.of("lock_lost", task_id=result.id)
    assert lost["key"] == key
    assert lost["task"] == "life.lossy"
    assert lost["reason"]
    assert any(
        key in record.getMessage() and "lost" in record.getMessage() for record in caplog.records
    )
    (released,) = lock_signals.wait("lock_released", task_id=result.id)
    assert released["released"] is False


def test_extend_lock_that_finds_the_lock_taken_raises_and_reports_it(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    gate: threading.Event,
    run_log: RunLog,
    lock_signals: LockSignals,
) -> None:
    # With a 30 s ttl the extension thread would not look before 10 s: here the task's own
    # extend_lock() is first to find out, and the loss must still be reported.
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="life.lossy_by_hand", lock_ttl=30)
    def by_hand(self: SingletonTask) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            gate.wait(10)
            try:
                self.extend_lock()
            except LockLost:
                return "LockLost"
        return "extended a lost lock"

    with embedded_worker(app):
        result = by_hand.delay()
        key = run_log.wait_task_started(result.id)["key"]
        _take_over_everywhere(lock_nodes, key)
        gate.set()
        assert result.get(timeout=10) == "LockLost"
        (lost,) = lock_signals.wait("lock_lost", task_id=result.id, timeout=2)
    assert lost["key"] == key


def test_extend_lock_without_a_quorum_returns_false(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="life.no_quorum", lock_ttl=5)
    def no_quorum(self: SingletonTask) -> list[Any]:
        with run_log.run(self.lock.key, task_id=self.request.id):
            answers: list[Any] = [self.extend_lock(ttl=10)]
            gate.wait(10)
            answers.append(self.extend_lock())  # two of three nodes hang now
            answers.append(self.lock.remaining() > 0)
        return answers

    with embedded_worker(app):
        result = no_quorum.delay()
        key = run_log.wait_task_started(result.id)["key"]
        assert wait_until(lambda: min(pttls_on(lock_nodes, key)) > 5_000, timeout=5)
        lock_nodes[0].pause()
        lock_nodes[1].pause()
        try:
            gate.set()
            answers = result.get(timeout=10)
        finally:
            lock_nodes[0].resume()
            lock_nodes[1].resume()
    assert answers == [True, False, True]  # not extended, yet still valid: not lost
