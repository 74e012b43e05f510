"""Completion is per message, not per task id (issue 15, item 1), with real embedded workers,
real lock nodes and the Redis result back-end.

A delivery is "already ran" only when it is the same message again (a broker redelivery). A new
message that reuses a task id runs, whether it carries other arguments, is another task, was
sent again after ``forget()``, or is part of a canvas Celery re-sends (a frozen chord applied
twice, a frozen signature reused in another chord). Each canvas pattern runs with a plain Celery
task as well: whatever a plain task does there, a `SingletonTask` must do too. A true
redelivery is still acknowledged without running again, and the first run's stored result
stays.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, Task, chord, signals
from celery_apps.support import (
    ENDED_FOR_GOOD,
    LockSignals,
    RunLog,
    completion_ranks,
    embedded_worker,
    make_app,
)
from redlock_support import requires_prompt_redelivery, wait_until

from celery_redlock import SingletonTask, singleton_task
from celery_redlock.testing import RedisNodes, RedisServer

pytest_plugins = ["celery_apps.fixtures"]

KINDS = ("plain", "singleton")
"""A plain Celery task (the reference behaviour) and a `SingletonTask`."""


MakeApp = Callable[..., Celery]


@pytest.fixture
def make_test_app(broker: RedisServer, lock_nodes: RedisNodes) -> Iterator[MakeApp]:
    """`make_app` on the test's broker and lock nodes (``conf`` overrides settings).

    At teardown, while the broker still runs, the test thread's result back-end forgets its
    subscriptions: results a failed test's traceback keeps alive would otherwise try to
    unsubscribe from the stopped broker when collected, and fail the next test with them.
    """
    apps: list[Celery] = []

    def make(**conf: Any) -> Celery:
        app = make_app(broker, lock_nodes, **conf)
        apps.append(app)
        return app

    yield make
    for app in apps:
        consumer = app.backend.result_consumer
        consumer.subscribed_to.clear()
        consumer.stop()


def _define(app: Celery, kind: str, name: str, run_log: RunLog) -> Task:
    """Task ``name`` of ``kind`` adding its arguments: ``value`` (a number, or the list of a
    chord header's results) plus ``extra``. Every body run is recorded in ``run_log``."""
    decorator = app.task if kind == "plain" else singleton_task
    options: dict[str, Any] = {"shared": False, "bind": True, "name": f"identity.{kind}.{name}"}
    if kind == "singleton":
        options["app"] = app

    @decorator(**options)
    def add(self: Task, value: int | list[int], extra: int = 0) -> int:
        arguments = json.dumps([value, extra])
        with run_log.run(f"{self.name}:{arguments}", task_id=self.request.id, arguments=arguments):
            pass
        return (sum(value) if isinstance(value, list) else value) + extra

    return add


def _stored(app: Celery, task_id: str) -> tuple[str, Any]:
    """The state and result the back-end holds for ``task_id`` now (never a cached copy)."""
    meta = app.backend.get_task_meta(task_id, cache=False)
    return meta["status"], meta["result"]


def _runs_of(run_log: RunLog, task_id: str) -> list[dict[str, Any]]:
    return [run for run in run_log.runs() if run["task_id"] == task_id]


def _wait_for_runs(
    run_log: RunLog,
    lock_signals: LockSignals,
    task_id: str,
    count: int,
    timeout: float = 15.0,
) -> list[dict[str, Any]]:
    """Wait until ``count`` bodies of ``task_id`` ran. Fails at once, instead of at the
    timeout, when a delivery of ``task_id`` was acknowledged as having run already."""

    def acknowledged() -> list[dict[str, Any]]:
        return lock_signals.of("lock_duplicate", task_id=task_id, policy="completed")

    wait_until(lambda: len(_runs_of(run_log, task_id)) >= count or acknowledged(), timeout)
    assert not acknowledged(), (
        f"a new message with task id {task_id!r} was acknowledged as already run "
        f"(completion recorded per task id, not per message): {acknowledged()}; "
        f"runs: {_runs_of(run_log, task_id)}"
    )
    runs = _runs_of(run_log, task_id)
    assert len(runs) >= count, f"{count} run(s) of {task_id!r} expected: {run_log.runs()}"
    return runs


# -- a task id sent again is a new message --------------------------------------------------------


@pytest.mark.parametrize("pool", ["solo", "threads"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_task_id_sent_again_runs_with_its_own_arguments_and_task(
    make_test_app: MakeApp,
    run_log: RunLog,
    lock_signals: LockSignals,
    deliveries: dict[str, list[str]],
    kind: str,
    pool: str,
) -> None:
    # Applications reuse ids on purpose (task_id=f"sync-{account}"): every message runs.
    app = make_test_app()
    first_task = _define(app, kind, "t", run_log)
    other_task = _define(app, kind, "u", run_log)
    task_id = "fixed"

    with embedded_worker(app, pool=pool, concurrency=2):
        assert first_task.apply_async((1,), task_id=task_id).get(timeout=10) == 1

        first_task.apply_async((2,), task_id=task_id)  # the same task, other arguments
        second = _wait_for_runs(run_log, lock_signals, task_id, 2)[1]
        assert json.loads(second["arguments"]) == [2, 0]
        # The body's end is not the delivery's: the worker stores the result after it (ignored
        # while the id's first SUCCESS is stored). A forget() in between let it store 2, which
        # the third run's result could then not replace.
        assert wait_until(lambda: deliveries.get(task_id, []).count("finished") >= 2, 10)
        # Celery's result store keeps the first SUCCESS of an id, for plain tasks too
        # (celery/backends/base.py, _store_result): a caller that wants the answer of a call
        # reusing an id forgets the id first.
        app.AsyncResult(task_id).forget()

        result = other_task.apply_async((3,), task_id=task_id)  # another task
        third = _wait_for_runs(run_log, lock_signals, task_id, 3)[2]
        assert third["key"].startswith(other_task.name + ":")
        assert result.get(timeout=10) == 3  # its own result, not the first task's
        assert _stored(app, task_id) == ("SUCCESS", 3)

    assert [run["key"].split(":")[0] for run in _runs_of(run_log, task_id)] == [
        first_task.name,
        first_task.name,
        other_task.name,
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_a_forgotten_task_id_sent_again_runs_to_success(
    make_test_app: MakeApp,
    run_log: RunLog,
    lock_signals: LockSignals,
    kind: str,
) -> None:
    # The same task and arguments, sent again after forget(): a new message, so a new run; the
    # caller must not see PENDING for ever.
    app = make_test_app()
    task = _define(app, kind, "forgotten", run_log)
    task_id = f"report-{uuid.uuid4().hex}"

    with embedded_worker(app, pool="solo"):
        first = task.apply_async((7,), task_id=task_id)
        assert first.get(timeout=10) == 7
        first.forget()
        assert _stored(app, task_id)[0] == "PENDING"
        again = task.apply_async((7,), task_id=task_id)
        _wait_for_runs(run_log, lock_signals, task_id, 2)
        assert again.get(timeout=10) == 7
        assert again.state == "SUCCESS"
    assert len(_runs_of(run_log, task_id)) == 2


# -- Celery's canvas sends task ids again ---------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_frozen_chord_applied_twice_completes_twice(
    make_test_app: MakeApp,
    run_log: RunLog,
    lock_signals: LockSignals,
    kind: str,
) -> None:
    app = make_test_app()
    add = _define(app, kind, "add", run_log)

    workflow = chord([add.s(1), add.s(2)], add.s(10))
    frozen = workflow.freeze()  # the header's, the group's and the body's ids are fixed
    header_ids = [result.id for result in frozen.parent.results]
    with embedded_worker(app, concurrency=3):
        first = workflow.apply_async()
        assert first.get(timeout=15) == 13
    # Forgotten, so that the second application's answer can only come from its own run.
    first.forget()
    # Queued whole before a worker runs it: Celery 5.7 clears the chord's "done" marker only as
    # it publishes the last header task, and drops the part of a header task that finished
    # before that (its race: a plain task's chord body then never runs either).
    second = workflow.apply_async()
    assert second.id == first.id
    with embedded_worker(app, concurrency=3):
        for header_id in header_ids:
            _wait_for_runs(run_log, lock_signals, header_id, 2)
        _wait_for_runs(run_log, lock_signals, second.id, 2)
        assert second.get(timeout=15) == 13

    assert [len(_runs_of(run_log, task_id)) for task_id in [*header_ids, first.id]] == [2, 2, 2]


@pytest.mark.parametrize("kind", KINDS)
def test_a_frozen_signature_in_one_chords_header_then_anothers_body_completes_both(
    make_test_app: MakeApp,
    run_log: RunLog,
    lock_signals: LockSignals,
    kind: str,
) -> None:
    app = make_test_app()
    add = _define(app, kind, "add", run_log)

    with embedded_worker(app, concurrency=3):
        reused = add.s(5)
        reused_id = reused.freeze().id
        first = chord([reused, add.s(1)], add.s()).apply_async()
        assert first.get(timeout=15) == 6
        first.forget()  # the reused id's header result too: only the new run can answer
        second = chord([add.s(2), add.s(3)], reused).apply_async()
        assert second.id == reused_id
        _wait_for_runs(run_log, lock_signals, reused_id, 2)
        assert second.get(timeout=15) == 10  # add([2, 3], 5)

    assert [json.loads(run["arguments"]) for run in _runs_of(run_log, reused_id)] == [
        [5, 0],
        [[2, 3], 5],
    ]


# -- the same message again is still acknowledged, and its result stays ---------------------------


@pytest.fixture
def deliveries() -> Iterator[dict[str, list[str]]]:
    """Per task id, every delivery a worker in this process started on (Celery's own
    ``task_prerun``, sent before the lock is tried) and every one it finished with
    (``task_postrun``, sent for every outcome)."""
    seen: dict[str, list[str]] = {}
    guard = threading.Lock()

    def receiver(kind: str) -> Callable[..., None]:
        def receive(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
            with guard:
                seen.setdefault(str(task_id), []).append(kind)

        return receive

    started, finished = receiver("started"), receiver("finished")
    signals.task_prerun.connect(started, weak=False)
    signals.task_postrun.connect(finished, weak=False)
    yield seen
    signals.task_prerun.disconnect(started)
    signals.task_postrun.disconnect(finished)


def _broker_settled(broker: RedisServer) -> bool:
    """Nothing queued and nothing unacknowledged on the broker."""
    with broker.client() as client:
        return client.llen("celery") == 0 and client.hlen("unacked") == 0


def _ran_twice_and_settled(
    deliveries: dict[str, list[str]], task_id: str, broker: RedisServer
) -> bool:
    """Both deliveries of ``task_id`` started and finished, and the broker holds nothing more."""
    return deliveries.get(task_id) == ["started", "finished"] * 2 and _broker_settled(broker)


def _redelivered(raw_message: bytes) -> bytes:
    """The message as kombu's Redis transport puts it back on its queue when it restores an
    unacknowledged delivery (``Channel._do_restore_message``): the very same message, marked
    redelivered."""
    payload = json.loads(raw_message)
    payload["headers"]["redelivered"] = True
    payload["properties"]["delivery_info"]["redelivered"] = True
    return json.dumps(payload).encode()


def _later_attempt(raw_message: bytes) -> bytes:
    """The message as a retry of it would be published: the same message (its identity kept),
    one attempt later."""
    payload = json.loads(raw_message)
    payload["headers"]["retries"] = payload["headers"].get("retries", 0) + 1
    return json.dumps(payload).encode()


@pytest.mark.parametrize("copy", [_redelivered, _later_attempt], ids=["redelivered", "retried"])
def test_the_same_message_delivered_again_after_its_run_is_acknowledged_and_keeps_its_result(
    broker: RedisServer,
    make_test_app: MakeApp,
    run_log: RunLog,
    deliveries: dict[str, list[str]],
    copy: Callable[[bytes], bytes],
) -> None:
    # "redelivered": what the broker does when an acks_late worker died after the body ran but
    # before its ack: the stored message comes back, marked redelivered (kombu restores it
    # after the visibility timeout). "retried": two copies of one attempt (a redelivery) can
    # decide apart, one running, the other finding a duplicate's lock held and retrying: that
    # retry comes after the run ended for good. Here the test puts the copy back itself, at a
    # known moment, after the run.
    app = make_test_app()

    @singleton_task(app=app, shared=False, bind=True, name="identity.once", acks_late=True)
    def job(self: Task, item: int) -> str:
        with run_log.run(f"identity.once:{item}", task_id=self.request.id) as entry:
            return str(entry["run"])

    result = job.delay(1)  # queued while no worker runs: the test can read the message
    with broker.client() as client:
        (raw_message,) = client.lrange("celery", 0, -1)
    with embedded_worker(app, pool="solo"):
        ran = result.get(timeout=10)
        assert wait_until(lambda: _broker_settled(broker), timeout=5)
        with broker.client() as client:
            client.lpush("celery", copy(raw_message))
        assert wait_until(lambda: _ran_twice_and_settled(deliveries, result.id, broker), 10), (
            deliveries,
            run_log.runs(),
        )
    assert [run["run"] for run in _runs_of(run_log, result.id)] == [ran]
    # The first run's result is never overwritten by the acknowledgement of its copy.
    assert _stored(app, result.id) == ("SUCCESS", ran)
    assert app.AsyncResult(result.id).get(timeout=5) == ran


class RetriedOnFailure(SingletonTask):  # type: ignore[misc]
    """Asks for a retry from ``on_failure``, after its first attempt's body failed."""

    def on_failure(self, exc: BaseException, task_id: str, *args: Any, **kwargs: Any) -> None:
        if self.request.retries == 0:
            self.retry(countdown=0.2, throw=False)


@pytest.mark.parametrize("where", ["body", "on_failure"])
def test_a_retry_asked_for_without_raising_still_runs(
    make_test_app: MakeApp, run_log: RunLog, where: str
) -> None:
    # ``retry(throw=False)`` publishes the next attempt and lets the body end in SUCCESS; asked
    # for from ``on_failure``, it comes after the body ended in FAILURE. Neither end may be
    # recorded as the message's last, or the retry would be acknowledged unrun.
    app = make_test_app()

    @app.task(
        base=RetriedOnFailure,
        shared=False,
        bind=True,
        name=f"identity.retry.{where}",
        acks_late=True,
        # A failed attempt's request outlives the worker in its exception's traceback: were its
        # retry's result kept as its child, it would unsubscribe after the broker stopped.
        trail=False,
    )
    def job(self: Task, item: int) -> None:
        with run_log.run(f"identity.retry:{item}", task_id=self.request.id):
            if self.request.retries == 0 and where == "body":
                self.retry(countdown=0.2, throw=False)
            elif self.request.retries == 0:
                raise ValueError("the first attempt fails; on_failure asks for a retry")

    with embedded_worker(app, pool="solo"):
        result = job.delay(1)
        assert wait_until(lambda: len(_runs_of(run_log, result.id)) == 2, timeout=10), (
            run_log.runs()
        )


def test_a_redelivered_copy_acknowledged_on_receipt_records_its_run(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    make_test_app: MakeApp,
    run_log: RunLog,
    deliveries: dict[str, list[str]],
) -> None:
    # The broker hands a message out again when its first delivery stayed unacknowledged past the
    # visibility timeout, waiting in a busy worker. The copy runs first and is acknowledged on
    # receipt; it must still record its run, or the first delivery would run it again later.
    app = make_test_app()

    @singleton_task(app=app, shared=False, bind=True, name="identity.copy_first")
    def job(self: Task, item: int) -> str:
        with run_log.run(f"identity.copy_first:{item}", task_id=self.request.id) as entry:
            return str(entry["run"])

    result = job.delay(1)  # queued while no worker runs: the test can read the message
    with broker.client() as client:
        (raw_message,) = client.lrange("celery", 0, -1)
        client.delete("celery")
        client.lpush("celery", _redelivered(raw_message))  # the copy
    with embedded_worker(app, pool="solo"):
        ran = result.get(timeout=10)
        assert wait_until(lambda: _broker_settled(broker), timeout=5)
        with broker.client() as client:
            client.lpush("celery", raw_message)  # the first delivery, finally let go
        assert wait_until(lambda: _ran_twice_and_settled(deliveries, result.id, broker), 10), (
            deliveries,
            run_log.runs(),
        )
    assert [run["run"] for run in _runs_of(run_log, result.id)] == [ran]
    assert completion_ranks(lock_nodes, result.id) == [{ENDED_FOR_GOOD}] * len(lock_nodes)


@requires_prompt_redelivery
def test_an_eta_message_the_broker_delivers_twice_runs_once_and_keeps_its_result(
    broker: RedisServer,
    make_test_app: MakeApp,
    run_log: RunLog,
    deliveries: dict[str, list[str]],
) -> None:
    # The Redis transport restores an ETA message the worker holds unacknowledged once the
    # visibility timeout passed (Celery #4400): copies of one message all come due together.
    visibility_timeout = 1.0
    app = make_test_app(
        broker_transport_options={
            "polling_interval": 0.1,
            "visibility_timeout": visibility_timeout,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
    )

    @singleton_task(app=app, shared=False, bind=True, name="identity.eta")
    def job(self: Task, item: int) -> str:
        with run_log.run(f"identity.eta:{item}", task_id=self.request.id) as entry:
            return str(entry["run"])

    with embedded_worker(app, pool="solo"):
        result = job.apply_async((1,), countdown=visibility_timeout + 3)
        ran = result.get(timeout=20)

        def settled() -> bool:
            seen = deliveries.get(result.id, [])
            return (
                seen.count("started") >= 2
                and seen.count("started") == seen.count("finished")
                and _broker_settled(broker)
            )

        assert wait_until(settled, timeout=15), (deliveries, run_log.runs())
    assert [run["run"] for run in _runs_of(run_log, result.id)] == [ran]
    assert _stored(app, result.id) == ("SUCCESS", ran)
    assert app.AsyncResult(result.id).get(timeout=5) == ran


@requires_prompt_redelivery
def test_a_message_redelivered_while_it_runs_is_acknowledged_later_and_keeps_its_result(
    broker: RedisServer,
    make_test_app: MakeApp,
    run_log: RunLog,
    deliveries: dict[str, list[str]],
    lock_signals: LockSignals,
    gate: threading.Event,
) -> None:
    # acks_late past the visibility timeout: the broker hands the same message out again while
    # its first delivery still runs. The copy runs neither beside the first delivery nor after
    # it: it is acknowledged without running once the first run has ended (today it is put off
    # by publishing it again, which must keep it the same message).
    visibility_timeout = 1.0
    app = make_test_app(
        broker_transport_options={
            "polling_interval": 0.1,
            "visibility_timeout": visibility_timeout,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
    )

    @singleton_task(
        app=app, shared=False, bind=True, name="identity.late", acks_late=True, lock_ttl=2
    )
    def job(self: Task, item: int) -> str:
        with run_log.run(f"identity.late:{item}", task_id=self.request.id) as entry:
            gate.wait(15)
            return str(entry["run"])

    with embedded_worker(app, pool="threads", concurrency=2):
        result = job.delay(1)

        def copy_met_the_lock() -> bool:
            seen = deliveries.get(result.id, [])
            decided = seen.count("finished") >= 1 or lock_signals.of(
                "lock_duplicate", task_id=result.id
            )
            return seen.count("started") >= 2 and bool(decided)

        assert wait_until(copy_met_the_lock, timeout=15), (deliveries, run_log.started())
        assert run_log.runs() == []  # the copy did not run beside the first delivery
        gate.set()
        ran = result.get(timeout=10)

        def settled() -> bool:
            seen = deliveries.get(result.id, [])
            return seen.count("started") == seen.count("finished") and _broker_settled(broker)

        assert wait_until(settled, timeout=20), (deliveries, run_log.runs())
    assert [run["run"] for run in _runs_of(run_log, result.id)] == [ran]
    assert _stored(app, result.id) == ("SUCCESS", ran)
    assert app.AsyncResult(result.id).get(timeout=5) == ran
