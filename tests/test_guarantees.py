"""The promise on Celery's edge paths, with a real embedded worker and real lock nodes: "this work
runs, and never twice at once". Each test names the guarantee (README: Guarantees) it proves.

The paths that cross processes (time limits, killed children and hosts, redelivery by the
broker, a worker refusing a bad configuration) are in test_guarantees_prefork.py.
"""

from __future__ import annotations

import datetime
import decimal
import logging
import threading
import time
import uuid
from typing import Any

import pytest
from celery import chain, chord, group
from celery.exceptions import Ignore
from celery_apps.support import (
    ENDED_FOR_GOOD,
    LockSignals,
    RunLog,
    all_keys,
    completion_ranks,
    embedded_worker,
    key_gone,
    lock_keys,
    make_app,
    make_app_publishing_nowhere,
)
from redlock_support import value_on, values_on, wait_until

from celery_redlock import DuplicateSkipped, LockLost, SingletonTask, singleton_task
from celery_redlock.integration import run as run_module
from celery_redlock.integration.messages import MESSAGE_HEADER
from celery_redlock.lock.owner import Owner, lock_value, owner_text_of
from celery_redlock.testing import RedisNodes, RedisServer

pytest_plugins = ["celery_apps.fixtures"]


# -- error replies are not votes; a split vote is no holder -------------------------------------


def test_a_majority_of_erroring_nodes_delays_the_run_instead_of_skipping_it(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="edge.oom", on_duplicate="skip")
    def job(self: SingletonTask, item: int) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            return "ran"

    for server in lock_nodes.servers[:2]:
        with server.client() as client:
            client.config_set("maxmemory", 1)  # OOM under noeviction: every write is refused
    with embedded_worker(app):
        result = job.delay(1)
        (event,) = lock_signals.wait("lock_unavailable", task_id=result.id, timeout=10)
        assert event["policy"] == "retry"  # "no quorum", never "held by someone"
        assert lock_signals.of("lock_duplicate", task_id=result.id) == []
        for server in lock_nodes.servers[:2]:
            with server.client() as client:
                client.config_set("maxmemory", 0)
        assert result.get(timeout=15) == "ran"
    assert [run["task_id"] for run in run_log.runs()] == [result.id]


def test_a_split_vote_is_waited_out_not_skipped(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="edge.split", lock_args=())
    def job(self: SingletonTask) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            return "ran"

    key = job.lock_key_for()
    # Leftovers of two different owners, each on a minority: nobody holds the lock.
    with lock_nodes[0].client() as client:
        client.set(key, lock_value("a" * 40, "crashed owner A"), px=1500)
    with lock_nodes[1].client() as client:
        client.set(key, lock_value("b" * 40, "crashed owner B"), px=1500)
    with embedded_worker(app):
        result = job.delay()
        assert result.get(timeout=15) == "ran"
    assert lock_signals.of("lock_duplicate", task_id=result.id) == []
    assert [run["task_id"] for run in run_log.runs()] == [result.id]


def test_a_split_vote_outlasting_the_wait_is_deferred_briefly_not_for_its_ttl(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    run_log: RunLog,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A split vote is racing callers (settled in moments) or leftovers: the delivery comes back
    # within a second or so, not after the leftovers' whole time to live.
    monkeypatch.setattr(run_module, "IN_PROCESS_WAIT", 0.5)
    caplog.set_level(logging.INFO, logger="celery_redlock.integration.run")
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="edge.split_long", lock_args=())
    def job(self: SingletonTask) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            return "ran"

    key = job.lock_key_for()
    for node, name in zip(lock_nodes.servers[:2], "ab", strict=False):
        with node.client() as client:
            client.set(key, lock_value(name * 40, f"crashed owner {name}"), px=30_000)
    with embedded_worker(app):
        result = job.delay()
        assert wait_until(lambda: "no majority agreed on a holder" in caplog.text, timeout=10)
        for node in lock_nodes.servers[:2]:
            with node.client() as client:
                client.delete(key)
        assert result.get(timeout=5) == "ran"
    assert [run["task_id"] for run in run_log.runs()] == [result.id]


@pytest.mark.parametrize("acks_late", [False, True], ids=["acks-on-receipt", "acks-late"])
def test_a_deferral_the_broker_does_not_take_loses_no_work(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    run_log: RunLog,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    acks_late: bool,
) -> None:
    # The worker publishes through a broker address where nothing listens (broker_write_url):
    # every deferral fails to publish. A split vote outlasting the in-process wait must not end
    # the delivery: it waits in its process (acknowledged on receipt) or goes back to the broker
    # (acks_late), and runs once the vote is settled.
    monkeypatch.setattr(run_module, "IN_PROCESS_WAIT", 0.3)
    monkeypatch.setattr(run_module, "UNPUBLISHED_PAUSE", 0.3)
    monkeypatch.setattr(run_module, "ACKS_LATE_PATIENCE", 0.5)
    caplog.set_level(logging.INFO, logger="celery_redlock")
    app = make_app_publishing_nowhere(broker, lock_nodes, monkeypatch)
    name = f"edge.unpublished_{acks_late}"

    @singleton_task(app=app, shared=False, bind=True, name=name, lock_args=(), acks_late=acks_late)
    def job(self: SingletonTask) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            return "ran"

    key = job.lock_key_for()
    for node, letter in zip(lock_nodes.servers[:2], "ab", strict=False):
        with node.client() as client:
            client.set(key, lock_value(letter * 40, f"crashed owner {letter}"), px=60_000)
    with app.connection_for_read() as good, embedded_worker(app, concurrency=1):
        result = job.apply_async(connection=good)
        expected = "goes back to the broker" if acks_late else "waits in its process instead"
        assert wait_until(lambda: expected in caplog.text, timeout=15), caplog.text
        assert "could not be deferred" in caplog.text
        for node in lock_nodes.servers[:2]:
            with node.client() as client:
                client.delete(key)
        assert result.get(timeout=15) == "ran"
    assert [run["task_id"] for run in run_log.runs()] == [result.id]


def test_a_retry_the_broker_does_not_take_waits_for_the_holder_and_runs(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    run_log: RunLog,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # on_duplicate="retry" asks Celery for a retry; Celery rejects the message (for good) when
    # the broker does not take the retry. The duplicate waits for the holder instead, then runs.
    monkeypatch.setattr(run_module, "UNPUBLISHED_PAUSE", 0.3)
    caplog.set_level(logging.INFO, logger="celery_redlock")
    app = make_app_publishing_nowhere(broker, lock_nodes, monkeypatch)
    gate = threading.Event()
    name = "edge.retry_unpublished"

    @singleton_task(
        app=app, shared=False, bind=True, name=name, lock_args=("item",), on_duplicate="retry"
    )
    def job(self: SingletonTask, item: int, hold: bool = False) -> int:
        with run_log.run(self.lock.key, task_id=self.request.id):
            if hold:
                gate.wait(10)
            return item

    with app.connection_for_read() as good, embedded_worker(app, concurrency=2):
        holder = job.apply_async((1,), {"hold": True}, connection=good)
        run_log.wait_task_started(holder.id)
        duplicate = job.apply_async((1,), connection=good)
        expected = "could not be deferred (retrying"
        assert wait_until(lambda: expected in caplog.text, timeout=15), caplog.text
        gate.set()
        assert holder.get(timeout=10) == 1
        assert duplicate.get(timeout=10) == 1
    assert [run["task_id"] for run in run_log.runs()] == [holder.id, duplicate.id]


# -- exactly once per task id --------------------------------------------------------------------


def test_a_task_id_that_completed_does_not_run_again(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    # What a broker does when the connection drops before the ack: the same message again.
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="edge.once", acks_late=True)
    def job(self: SingletonTask, item: int) -> int:
        with run_log.run(self.lock.key, task_id=self.request.id):
            return item

    task_id = str(uuid.uuid4())
    # The same message: the same headers, identity included (a re-send would get a new one).
    message = {"headers": {MESSAGE_HEADER: uuid.uuid4().hex[:16]}}
    with embedded_worker(app):
        assert job.apply_async((1,), task_id=task_id, **message).get(timeout=10) == 1
        job.apply_async((1,), task_id=task_id, **message)
        (again,) = lock_signals.wait("lock_duplicate", task_id=task_id, timeout=10)
        assert again["policy"] == "completed"
        assert job.AsyncResult(task_id).get(timeout=5) == 1  # the first run's result stays
    assert [run["task_id"] for run in run_log.runs()] == [task_id]
    assert completion_ranks(lock_nodes, task_id) == [{ENDED_FOR_GOOD}] * len(lock_nodes)


def test_runs_acknowledged_on_receipt_leave_nothing_on_the_lock_nodes(
    broker: RedisServer, lock_nodes: RedisNodes, lock_signals: LockSignals
) -> None:
    # A message acknowledged on receipt is never delivered again: its run needs no completion
    # record, and its fencing counter goes a second after the release. An acks_late run's
    # record lives the broker's redelivery window (its visibility_timeout) and the lock's ttl.
    app = make_app(broker, lock_nodes, broker_transport_options={"visibility_timeout": 120})

    @singleton_task(app=app, shared=False, name="edge.early")
    def early(item: int) -> int:
        return item

    @singleton_task(app=app, shared=False, name="edge.late", acks_late=True)
    def late(item: int) -> int:
        return item

    def keys_of(task_name: str) -> list[set[str]]:
        return [{key for key in keys if task_name in key} for keys in all_keys(lock_nodes)]

    with embedded_worker(app):
        assert [early.delay(item).get(timeout=10) for item in range(20)] == list(range(20))
        kept = late.delay(1)
        assert kept.get(timeout=10) == 1
        lock_signals.wait("lock_released", task_id=kept.id)
    assert wait_until(lambda: keys_of("edge.early") == [set()] * len(lock_nodes), timeout=5)
    assert completion_ranks(lock_nodes, kept.id) == [{ENDED_FOR_GOOD}] * len(lock_nodes)
    (record,) = {key for key in keys_of("edge.late")[0] if ":done:" in key}
    for server in lock_nodes:
        with server.client() as client:
            assert 170_000 < client.pttl(record) <= 180_000  # 120 s + the default ttl of 60 s


@pytest.mark.parametrize("completed_ttl", [None, 600])
def test_a_message_that_waited_past_half_the_redelivery_window_leaves_a_record(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    lock_signals: LockSignals,
    completed_ttl: int | None,
) -> None:
    # Acknowledged on receipt, but only when a pool thread took it: 1.5 s after the worker
    # received it, past half the 2 s visibility_timeout. A copy may come: the run records itself
    # — also where records are kept longer than the window (redlock_completed_ttl = 600).
    app = make_app(
        broker,
        lock_nodes,
        broker_transport_options={"visibility_timeout": 2, "polling_interval": 0.1},
        redlock_completed_ttl=completed_ttl,
    )

    @singleton_task(app=app, shared=False, name="edge.queued")
    def job(item: int, seconds: float) -> int:
        time.sleep(seconds)
        return item

    with embedded_worker(app, concurrency=1):
        first, second = job.delay(1, 1.5), job.delay(2, 0)
        assert (first.get(timeout=10), second.get(timeout=10)) == (1, 2)
        lock_signals.wait("lock_released", task_id=second.id)
    assert completion_ranks(lock_nodes, first.id) == [set()] * len(lock_nodes)
    assert completion_ranks(lock_nodes, second.id) == [{ENDED_FOR_GOOD}] * len(lock_nodes)


def test_only_the_attempts_that_ran_are_completed(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    # A task that retried once: both attempts ran. A copy of either is not run again — but the
    # marker never stops an attempt that has not run (here: the retry itself). acks_late: a copy
    # of a message acknowledged on receipt never comes (no record is written for it).
    app = make_app(broker, lock_nodes)

    @singleton_task(
        app=app, shared=False, bind=True, name="edge.retried", max_retries=2, acks_late=True
    )
    def job(self: SingletonTask, item: int) -> int:
        with run_log.run(self.lock.key, task_id=self.request.id, retries=self.request.retries):
            pass
        if self.request.retries == 0:
            raise self.retry(countdown=0.05)
        return int(self.request.retries)

    task_id = str(uuid.uuid4())
    message = {"headers": {MESSAGE_HEADER: uuid.uuid4().hex[:16]}}  # a retry keeps its identity
    with embedded_worker(app):
        assert job.apply_async((1,), task_id=task_id, **message).get(timeout=10) == 1
        job.apply_async((1,), task_id=task_id, retries=0, **message)  # attempt 0 delivered again
        job.apply_async((1,), task_id=task_id, retries=1, **message)  # attempt 1 delivered again
        lock_signals.wait("lock_duplicate", 2, task_id=task_id, timeout=10)
    assert [run["retries"] for run in run_log.runs()] == [0, 1]
    assert {event["policy"] for event in lock_signals.of("lock_duplicate")} == {"completed"}


# -- lock_hold shorter than the validity floor ---------------------------------------------------


def test_a_short_lock_hold_keeps_the_lock_that_long_not_a_ttl(
    broker: RedisServer, lock_nodes: RedisNodes, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="edge.hold", lock_hold=0.02)
    def job(self: SingletonTask) -> str:
        return str(self.lock.key)

    with embedded_worker(app):
        result = job.delay()
        key = result.get(timeout=10)
        lock_signals.wait("lock_released", task_id=result.id)
        ended = time.monotonic()
        assert wait_until(lambda: key_gone(lock_nodes, key), timeout=2.0)
        assert time.monotonic() - ended < 1.0  # 20 ms, not the 60 s ttl


# -- the release never skips a lock it believes lost ---------------------------------------------


def test_a_lost_lock_is_still_released_where_copies_remain(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="edge.lost", lock_ttl=30)
    def job(self: SingletonTask) -> str:
        with run_log.run(self.lock.key, task_id=self.request.id):
            gate.wait(10)
            try:
                self.extend_lock()
            except LockLost:
                return "lost"
        return "kept"

    with embedded_worker(app):
        result = job.delay()
        key = run_log.wait_task_started(result.id)["key"]
        for server in lock_nodes.servers[:2]:  # another owner on a majority: the lock is lost
            with server.client() as client:
                client.set(key, lock_value("c" * 40, "another owner"), px=30_000)
        assert value_on(lock_nodes[2], key) is not None  # our copy, with about 30 s to live
        gate.set()
        assert result.get(timeout=10) == "lost"
        # The run's end still releases by token: our copy does not block the third node for 30 s.
        assert wait_until(lambda: value_on(lock_nodes[2], key) is None, timeout=2.0)


# -- enqueue-time de-duplication keeps Celery's semantics ----------------------------------------


def test_a_retry_is_queued_even_while_another_call_holds_the_key(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(
        app=app,
        shared=False,
        bind=True,
        name="edge.enqueue_retry",
        lock_on_enqueue=True,
        on_duplicate="retry",
        max_retries=20,
        lock_args=("item",),
    )
    def job(self: SingletonTask, item: int, hold: bool = False) -> int:
        with run_log.run(self.lock.key, task_id=self.request.id):
            if hold:
                gate.wait(10)
        return int(self.request.retries)

    with embedded_worker(app, concurrency=3):
        holder = app.send_task("edge.enqueue_retry", (1,), {"hold": True})  # no claim taken
        run_log.wait_task_started(holder.id)
        duplicate = app.send_task("edge.enqueue_retry", (1,))  # runs, finds it held: retries
        assert wait_until(lambda: duplicate.state == "RETRY", timeout=10)
        gate.set()
        assert holder.get(timeout=10) == 0
        assert duplicate.get(timeout=20) >= 1  # its retries were queued and it ran
    assert [run["task_id"] for run in run_log.runs()] == [holder.id, duplicate.id]


def test_calls_with_callbacks_are_never_answered_with_another_calls_result(
    broker: RedisServer, lock_nodes: RedisNodes, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(broker, lock_nodes)
    called_back: list[int] = []

    @singleton_task(app=app, shared=False, name="edge.enqueue_links", lock_on_enqueue=True)
    def job(item: int) -> int:
        return item

    @app.task(shared=False, name="edge.enqueue_callback")
    def callback(result: int) -> None:
        called_back.append(result)

    first = job.delay(1)
    with caplog.at_level(logging.INFO, logger="celery_redlock"):
        linked = job.apply_async((1,), link=callback.s())
    assert linked.id != first.id  # queued: its callback must run with its own result
    assert "callbacks, errbacks or chord options" in caplog.text
    assert job.delay(1).id == first.id  # a plain duplicate is still answered with the first
    with embedded_worker(app, concurrency=2):
        assert first.get(timeout=10) == 1
        linked.get(timeout=10, propagate=False)
        assert wait_until(lambda: called_back == [1] or linked.state == "REVOKED", timeout=10)


def test_a_failed_publish_releases_the_enqueue_claim(
    broker: RedisServer, lock_nodes: RedisNodes
) -> None:
    unreachable = RedisServer().start()
    url = unreachable.url
    unreachable.stop()
    app = make_app(
        broker,
        lock_nodes,
        broker_url=url,
        task_publish_retry=False,
        # the transport's own connection retries (6 s) would only delay the same failure
        broker_transport_options={"polling_interval": 0.1, "max_retries": 0},
    )

    @singleton_task(app=app, shared=False, name="edge.enqueue_fail", lock_on_enqueue=True)
    def job(item: int) -> int:
        return item

    with pytest.raises(Exception):  # noqa: B017 - kombu's connection error, whatever its type
        job.delay(1)
    assert all(not keys for keys in lock_keys(lock_nodes))  # no claim for a never-queued id


# -- chords never hang ---------------------------------------------------------------------------


def test_a_skipped_chord_member_fails_the_chord_instead_of_hanging_it(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)
    bodies: list[Any] = []

    @singleton_task(app=app, shared=False, bind=True, name="edge.member", lock_args=("item",))
    def member(self: SingletonTask, item: int, hold: bool = False) -> int:
        with run_log.run(self.lock.key, task_id=self.request.id):
            if hold:
                gate.wait(10)
        return item

    @app.task(shared=False, name="edge.chord_body")
    def body(results: list[int]) -> list[int]:
        bodies.append(results)
        return results

    with embedded_worker(app, concurrency=3):
        holder = member.delay(1, hold=True)
        run_log.wait_task_started(holder.id)
        result = chord([member.s(1), member.s(2)], body.s()).apply_async()
        # The body's own state (get() would raise the header's error without waiting for it).
        assert wait_until(lambda: app.AsyncResult(result.id).state == "FAILURE", timeout=15)
        with pytest.raises(DuplicateSkipped):  # the chord reports its member's skip
            result.get(timeout=5)
        gate.set()
        holder.get(timeout=10)
    assert bodies == []


def test_a_deferred_chord_member_still_completes_the_chord(
    broker: RedisServer, lock_nodes: RedisNodes, lock_signals: LockSignals
) -> None:
    # No quorum for a while: the member waits half its soft time limit in its process, is
    # published again with the same id and chord, and completes the chord once the nodes return.
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, name="edge.patient_member", soft_time_limit=2)
    def member(item: int) -> int:
        return item

    @app.task(shared=False, name="edge.patient_body")
    def body(results: list[int]) -> int:
        return sum(results)

    with embedded_worker(app, concurrency=3):
        lock_nodes[0].stop()
        lock_nodes[1].stop()
        result = chord([member.s(1), member.s(2)], body.s()).apply_async()
        lock_signals.wait("lock_unavailable", 4, timeout=15)  # each member deferred at least once
        lock_nodes[0].restart()
        lock_nodes[1].restart()
        assert result.get(timeout=20) == 3


def test_canvas_works_unchanged_with_singleton_tasks(
    broker: RedisServer, lock_nodes: RedisNodes
) -> None:
    app = make_app(broker, lock_nodes)
    failed_ids: list[str] = []

    @singleton_task(app=app, shared=False, name="canvas.add")
    def add(left: int, right: int) -> int:
        return left + right

    @singleton_task(app=app, shared=False, name="canvas.total")
    def total(values: list[int]) -> int:
        return sum(values)

    @singleton_task(app=app, shared=False, name="canvas.boom")
    def boom(item: int) -> None:
        raise ValueError(f"boom {item}")

    @singleton_task(app=app, shared=False, name="canvas.on_error")
    def on_error(request: Any, exc: BaseException, traceback: Any) -> None:
        # A new-style errback: Celery calls it in the worker with the failed task's request.
        failed_ids.append(request.id)

    @singleton_task(app=app, shared=False, bind=True, name="canvas.replaced", lock_args=("n",))
    def replaced(self: SingletonTask, n: int) -> int:
        if n > 0:
            raise self.replace(add.si(n, 100))
        return n

    with embedded_worker(app, concurrency=4):
        assert chain(add.s(1, 2), add.s(3), add.s(4)).apply_async().get(timeout=15) == 10
        assert group(add.s(i, i) for i in range(4)).apply_async().get(timeout=15) == [0, 2, 4, 6]
        assert chord([add.s(i, 1) for i in range(3)], total.s()).apply_async().get(timeout=15) == 6
        assert add.apply_async((2, 3), link=add.s(10)).get(timeout=10) == 5
        failing = boom.apply_async((7,), link_error=on_error.s())
        with pytest.raises(ValueError, match="boom 7"):
            failing.get(timeout=10)
        assert wait_until(lambda: failed_ids == [failing.id], timeout=10), failed_ids
        assert replaced.delay(5).get(timeout=10) == 105
    assert all(not keys for keys in lock_keys(lock_nodes))


def test_a_replacement_with_the_same_key_runs(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog, lock_signals: LockSignals
) -> None:
    # The replacement keeps the task id and is published before the release: it must wait for
    # its predecessor, not be taken for a redelivered copy (and dropped).
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="edge.replace", lock_args=("key",))
    def step(self: SingletonTask, key: str, remaining: int) -> int:
        with run_log.run(self.lock.key, task_id=self.request.id, remaining=remaining):
            time.sleep(0.05)  # work after the hand-off would come here
            if remaining:
                raise self.replace(step.si(key, remaining - 1))
        return remaining

    with embedded_worker(app, concurrency=3):
        result = step.delay("k", 3)
        assert result.get(timeout=20) == 0
    assert [run["remaining"] for run in run_log.runs()] == [3, 2, 1, 0]
    assert lock_signals.of("lock_duplicate") == []


def test_a_chain_of_same_key_steps_runs_every_step(
    broker: RedisServer, lock_nodes: RedisNodes, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="edge.step", lock_args=("key",))
    def step(self: SingletonTask, key: str, index: int) -> int:
        with run_log.run(self.lock.key, task_id=self.request.id, index=index):
            time.sleep(0.02)
        return index

    with embedded_worker(app, concurrency=3):
        steps = chain(step.si("k", index) for index in range(5))
        assert steps.apply_async().get(timeout=20) == 4
    assert [run["index"] for run in run_log.runs()] == [0, 1, 2, 3, 4]


# -- one call, one key, on both sides of the broker ----------------------------------------------

SERIALIZED_ARGUMENTS: dict[str, list[Any]] = {
    "json": [7, "x", 1.5, None, True, [1, [2]], {"b": 1, "a": {"c": [1]}}, {1: "a"}],
    "pickle": [
        7,
        (1, 2),
        {1: "a"},
        datetime.datetime(2024, 5, 1, 12, 30),
        decimal.Decimal("1.10"),
        uuid.UUID(int=5),
        b"\x00\xff",
        frozenset({1, 2}),
    ],
    "msgpack": [7, "x", 1.5, None, [1, 2], {"a": 1}, b"\x00\xff"],
    "yaml": [7, "x", 1.5, None, [1, 2], {"a": {"b": 2}}, datetime.date(2024, 5, 1)],
}


@pytest.mark.parametrize("serializer", sorted(SERIALIZED_ARGUMENTS))
def test_the_enqueue_key_is_the_run_key_for_every_serializer(
    broker: RedisServer, lock_nodes: RedisNodes, serializer: str
) -> None:
    app = make_app(
        broker,
        lock_nodes,
        task_serializer=serializer,
        accept_content=[serializer, "json"],
        result_serializer="json",
    )
    keys_seen: list[str] = []

    @singleton_task(
        app=app, shared=False, bind=True, name=f"edge.serialized_{serializer}", lock_on_enqueue=True
    )
    def job(self: SingletonTask, value: Any) -> None:
        keys_seen.append(self.lock.key)

    values = SERIALIZED_ARGUMENTS[serializer]
    queued = [job.delay(value) for value in values]
    assert [job.delay(value).id for value in values] == [result.id for result in queued]
    with embedded_worker(app, concurrency=2):
        for result in queued:
            result.get(timeout=10)
    assert len(set(keys_seen)) == len(values)
    # Every run took over its call's enqueue claim: none is left behind.
    assert wait_until(lambda: all(not keys for keys in lock_keys(lock_nodes)), timeout=2)


def test_int_and_string_mapping_keys_share_a_key_only_where_the_worker_cannot_tell(
    broker: RedisServer, lock_nodes: RedisNodes
) -> None:
    for serializer, shared in (("json", True), ("pickle", False)):
        conf = {"task_serializer": serializer, "accept_content": [serializer]}
        # Closed at the end: no worker closes this app's connections (publishing only).
        with make_app(broker, lock_nodes, task_ignore_result=True, **conf) as app:

            @singleton_task(
                app=app, shared=False, name=f"edge.mapping_{serializer}", lock_on_enqueue=True
            )
            def job(value: Any) -> None:
                """Only keyed, never run."""

            as_int, as_text = job.delay({1: "a"}), job.delay({"1": "a"})
            assert (as_int.id == as_text.id) is shared, serializer
            numbers = {job.delay(value).id for value in (1, 1.0, decimal.Decimal("1"), True)}
            assert len(numbers) == 4  # numbers keep their type with both serializers


def test_an_ignore_from_the_body_still_releases_and_completes(
    broker: RedisServer, lock_nodes: RedisNodes, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, name="edge.ignored", acks_late=True)
    def job() -> None:
        raise Ignore()

    with embedded_worker(app):
        result = job.delay()
        (released,) = lock_signals.wait("lock_released", task_id=result.id)
    assert released["state"] == "IGNORED" and released["released"] is True
    assert completion_ranks(lock_nodes, result.id) == [{"0:0"}] * len(lock_nodes)


def test_the_stored_owner_names_the_worker_node_in_every_pool(
    broker: RedisServer, lock_nodes: RedisNodes
) -> None:
    # Celery hands solo and threads tasks the bare host name; the owner must name the worker
    # (name@host), which is what operators and `admin.reap` ask with control commands.
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="edge.owner")
    def job(self: SingletonTask) -> str | None:
        stored = [value for value in values_on(lock_nodes, self.lock.key) if value]
        owner = Owner.parse(owner_text_of(stored[0]))
        return owner.worker if owner is not None else None

    for pool in ("solo", "threads"):
        with embedded_worker(app, pool=pool, hostname=f"{pool}-worker@box"):
            assert job.delay().get(timeout=10) == f"{pool}-worker@box"
