"""``on_duplicate="coalesce"``: at most one run and one pending run per key, on real lock nodes
with a real embedded worker; the hand-over of a freed lock to the pending run (never to a
newcomer) with a real prefork worker whose pool process the test pauses (for a pending run
whose worker dies: tests/test_guarantees_prefork.py)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from types import FrameType
from typing import Any

import pytest
from celery_apps.coalesce_app import REFRESH_TTL, refresh
from celery_apps.subprocesses import WorkerProcess, app_environment, celery_processes, control_app
from celery_apps.support import (
    LockSignals,
    RunLog,
    embedded_worker,
    key_gone,
    make_app,
    make_app_publishing_nowhere,
)
from conftest import MakeRedisNodes
from redlock_support import collect_results_while_the_broker_is_up, values_on, wait_until
from robustness.interruptions import after_call_of, raising_once

from celery_redlock import DuplicateCoalesced, SingletonTask, singleton_task
from celery_redlock.integration import coalesce as coalesce_module
from celery_redlock.lock import keyspace
from celery_redlock.lock.owner import Owner, owner_text_of
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
    assert key_gone(lock_nodes, keyspace.reservation_key(first_run["key"]))


def test_a_pending_run_whose_copy_the_broker_refuses_still_runs(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    run_log: RunLog,
    lock_signals: LockSignals,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The worker publishes through an address where nothing listens (broker_write_url): the
    # pending run cannot publish the copy of itself that insures it against its process dying.
    # It goes on without one, and runs after the current run.
    caplog.set_level(logging.WARNING, logger="celery_redlock")
    app = make_app_publishing_nowhere(broker, lock_nodes, monkeypatch)
    gates = {1: threading.Event()}
    refresh = _coalescing_task(app, run_log, gates)
    with app.connection_for_read() as good, embedded_worker(app, concurrency=2):
        first = refresh.apply_async(("report",), {"gate": 1}, connection=good)
        run_log.wait_task_started(first.id)
        pending = refresh.apply_async(("report",), connection=good)
        lock_signals.wait("lock_duplicate", task_id=pending.id, policy="coalesce", timeout=10)
        assert "without a copy of itself in the broker" in caplog.text
        gates[1].set()
        assert first.get(timeout=10) == first.id
        assert pending.get(timeout=10) == pending.id

    assert [run["task_id"] for run in run_log.runs()] == [first.id, pending.id]


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


# -- the pending run gets the lock before any newcomer (real prefork workers) ----------------------

COALESCE_APP = "celery_apps.coalesce_app"


def _majority_owner(nodes: RedisNodes, key: str) -> Owner | None:
    """The owner a majority of ``nodes`` store at ``key``, or None when no majority agrees."""
    owners = [
        Owner.parse(owner_text_of(value)) if value else None for value in values_on(nodes, key)
    ]
    for owner in owners:
        if owner is not None and owners.count(owner) * 2 > len(nodes):
            return owner
    return None


def _owner_id(nodes: RedisNodes, key: str) -> str | None:
    owner = _majority_owner(nodes, key)
    return owner.id if owner is not None else None


def test_the_pending_run_gets_the_freed_lock_before_a_newcomer(
    redis_nodes: MakeRedisNodes,
) -> None:
    # The promise is "one running and one pending": when the running call ends, the pending
    # call runs next, and a call arriving meanwhile merges into it. The pending run's pool
    # process is paused (SIGSTOP) across the release, so that a newcomer always arrives while
    # the lock is free and the pending run has not taken it yet: it must not take it either.
    broker = redis_nodes(1)[0]
    locks = redis_nodes(3)
    key = refresh.lock_key_for("handover")
    reservation = keyspace.reservation_key(key)
    gate = f"gate-{uuid.uuid4().hex}"
    log = RunLog(broker.url)
    client_app = control_app(broker, result_backend=broker.url)

    def send(*args: Any, **kwargs: Any) -> Any:
        return client_app.send_task(f"{COALESCE_APP}.refresh", args=args, kwargs=kwargs)

    try:
        with celery_processes() as processes:
            # Three pool processes: the running call, the pending call, and one for newcomers.
            worker = WorkerProcess(
                COALESCE_APP, "handover", app_environment(broker, locks), concurrency=3
            )
            processes.append(worker.start())
            worker.wait_ready(client_app)

            running = send("handover", gate=gate)
            log.wait_task_started(running.id, timeout=15)
            pending = send("handover")
            assert wait_until(
                lambda: _owner_id(locks, reservation) == pending.id, timeout=15, alive=[worker]
            ), f"no pending run: {values_on(locks, reservation)}\n{worker.log_text()}"
            owner = _majority_owner(locks, reservation)
            assert owner is not None and owner.pid in worker.child_pids()
            os.kill(owner.pid, signal.SIGSTOP)
            try:
                with broker.client() as client:
                    client.set(gate, 1)  # the running call ends and releases its lock
                assert running.get(timeout=15)["task_id"] == running.id
                assert wait_until(lambda: _owner_id(locks, key) != running.id, timeout=5)

                newcomer = send("handover")
                assert wait_until(newcomer.ready, timeout=15), worker.log_text()
                assert newcomer.state == "REVOKED", (
                    f"the newcomer took the lock before the pending run: {newcomer.state}, "
                    f"runs {[run['task_id'] for run in log.runs()]} (running {running.id}, "
                    f"pending {pending.id}, newcomer {newcomer.id})"
                )
                with pytest.raises(DuplicateCoalesced) as coalesced:
                    newcomer.get(timeout=1)
                assert coalesced.value.into == pending.id
                # The pause must not have outlasted the pending run's reservation (or the lock
                # handed over to it), else this test proves nothing.
                assert pending.id in (_owner_id(locks, reservation), _owner_id(locks, key)), (
                    "the pending run's reservation lapsed while its process was paused"
                )
            finally:
                os.kill(owner.pid, signal.SIGCONT)

            assert pending.get(timeout=15)["task_id"] == pending.id
            # The copy the pending run published of itself (due a ttl and a second after it
            # became pending) is acknowledged as run, not run again.
            assert wait_until(lambda: _settled(broker), timeout=REFRESH_TTL + 10, alive=[worker]), (
                worker.log_text()
            )
        assert [run["task_id"] for run in log.runs()] == [running.id, pending.id]
        log.assert_no_overlap()
    finally:
        collect_results_while_the_broker_is_up()
        client_app.close()


def _settled(broker: RedisServer) -> bool:
    """Nothing queued and nothing unacknowledged on the broker."""
    with broker.client() as client:
        return client.llen("celery") == 0 and client.hlen("unacked") == 0


class Interrupted(Exception):
    """Raised in a worker thread where a signal handler's exception can land."""


def test_a_pending_run_interrupted_as_it_keeps_its_reservation_leaves_it_to_its_copy(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    # A soft time limit raising in the pending run right after the keeper took its reservation:
    # before, the reservation was extended for ever, the pending run never ran, and every later
    # duplicate was merged into it. Now the reservation goes with the interrupted delivery, its
    # insurance copy does the work, and a later duplicate runs.
    app = make_app(broker, lock_nodes)
    gates = {1: threading.Event()}

    @singleton_task(
        app=app,
        shared=False,
        bind=True,
        name="coalesce.interrupted",
        lock_args=("key",),
        lock_ttl=2.0,  # the insurance copies come 3 s after
        on_duplicate="coalesce",
        # The interrupted run's request outlives the worker in its exception's traceback: were
        # its copies' results kept as its children, they would unsubscribe after the broker
        # stopped.
        trail=False,
    )
    def refresh(self: SingletonTask, key: str, gate: int = 0) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            if gate:
                gates[gate].wait(10)
        return str(self.request.id)

    code = coalesce_module.coalesce.__code__
    landing = after_call_of(code, "start")  # the keeper's: the reservation is kept from there

    def where(frame: FrameType, previous: int | None) -> bool:
        return frame.f_lasti == landing

    interruption = Interrupted("as the pending run's reservation was kept")
    # In the worker's threads, started next.
    with (
        raising_once([code], where, interruption, threads=True) as raised,
        embedded_worker(app, concurrency=4),
    ):
        first = refresh.delay("report", gate=1)
        run_log.wait_task_started(first.id)
        pending = refresh.delay("report")
        assert wait_until(lambda: raised, 10)
        gates[1].set()
        assert first.get(timeout=10) == first.id
        key = run_log.runs()[0]["key"]
        # The pending run's insurance copy runs its work.
        pending_id = pending.id
        assert wait_until(lambda: pending_id in {run["task_id"] for run in run_log.runs()}, 10)
        assert wait_until(lambda: key_gone(lock_nodes, keyspace.reservation_key(key)), 5)
        later = refresh.delay("report")
        assert later.get(timeout=10) == later.id
        expected = [first.id, pending_id, later.id]
    assert [run["task_id"] for run in run_log.runs()] == expected
