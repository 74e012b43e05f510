"""What crosses processes: real ``celery worker -P prefork`` subprocesses (tests/celery_apps).

Two workers of two pool processes each consume one harness Redis broker; locks live on three
other harness nodes. A child terminated by ``revoke(terminate=True)`` or SIGKILLed must not
leave its lock behind until the ttl, and an ``acks_late`` message the broker redelivers (same
task id) while the first copy still runs must not run twice.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from billiard.exceptions import WorkerLostError
from celery import Celery
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult
from celery_apps.subprocesses import (
    WorkerProcess,
    app_environment,
    celery_processes,
    control_app,
)
from celery_apps.support import LOCK_EVENTS, RunLog, key_gone, key_held
from redlock_support import (
    collect_results_while_the_broker_is_up,
    requires_prompt_redelivery,
    wait_until,
)

from celery_redlock.testing import RedisNodes, RedisServer

LOCK_TTL = 30  # prefork_app.sleeper: any release within a few seconds is not the ttl's doing


@dataclass
class Fleet:
    """Two prefork worker processes, their broker, lock nodes and run log."""

    broker: RedisServer
    nodes: RedisNodes
    client_app: Celery
    log: RunLog
    workers: list[WorkerProcess]

    def logs(self) -> str:
        return "\n".join(worker.log_text() for worker in self.workers)

    def lock_events(self) -> list[dict[str, object]]:
        return self.log.read(LOCK_EVENTS)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """The fleet whose broker redelivers an unacknowledged message after 2 s."""
    yield from _fleet(CRL_VISIBILITY_TIMEOUT="2")


@pytest.fixture(scope="module")
def patient_fleet() -> Iterator[Fleet]:
    """A fleet whose broker keeps the default visibility timeout (one hour): a message comes
    back only when a worker rejects it."""
    yield from _fleet()


def _fleet(**environment_extra: str) -> Iterator[Fleet]:
    with RedisServer() as broker, RedisNodes(3) as nodes, celery_processes() as processes:
        environment = app_environment(broker, nodes, **environment_extra)
        client_app = control_app(broker, result_backend=broker.url)
        workers = [
            WorkerProcess("celery_apps.prefork_app", name, environment, concurrency=2)
            for name in ("alpha", "beta")
        ]
        try:
            for worker in workers:
                processes.append(worker.start())
            for worker in workers:
                worker.wait_ready(client_app)
            log = RunLog(broker.url)
            yield Fleet(broker, nodes, client_app, log, workers)
            log.assert_no_overlap()
        finally:
            collect_results_while_the_broker_is_up()
            client_app.close()


def _send(fleet: Fleet, name: str, *args: object, **options: object) -> AsyncResult:
    return fleet.client_app.send_task(f"celery_apps.prefork_app.{name}", args=args, **options)


def test_revoke_terminate_frees_the_lock_at_once(fleet: Fleet) -> None:
    result = _send(fleet, "sleeper", "revoked-key", 20)
    key = fleet.log.wait_task_started(result.id, timeout=15)["key"]
    assert key_held(fleet.nodes, key)

    revoked_at = time.monotonic()
    fleet.client_app.control.revoke(result.id, terminate=True)
    assert wait_until(lambda: key_gone(fleet.nodes, key), timeout=5), fleet.logs()
    assert time.monotonic() - revoked_at < 5 < LOCK_TTL
    assert wait_until(lambda: result.state == "REVOKED", timeout=5)
    # The child was stopped mid-sleep (its body may see the signal as an exception).
    assert all(run["end"] - run["start"] < 10 for run in fleet.log.runs(key))

    # The lock is usable again right away: the same key runs to completion.
    again = _send(fleet, "sleeper", "revoked-key", 0.05)
    assert again.get(timeout=15)["key"] == key


def test_sigkilled_child_lock_is_freed_by_the_main_process(fleet: Fleet) -> None:
    result = _send(fleet, "sleeper", "killed-key", 20)
    started = fleet.log.wait_task_started(result.id, timeout=15)
    key, child = started["key"], started["pid"]
    assert child not in {worker.pid for worker in fleet.workers}  # a pool child
    assert key_held(fleet.nodes, key)

    killed_at = time.monotonic()
    os.kill(child, signal.SIGKILL)
    fleet.log.mark_ended(started, time.time())  # the killed child can no longer record it
    assert wait_until(lambda: key_gone(fleet.nodes, key), timeout=10), fleet.logs()
    assert time.monotonic() - killed_at < 10 < LOCK_TTL
    with pytest.raises(WorkerLostError):
        result.get(timeout=10)
    assert wait_until(lambda: "whose process was lost" in fleet.logs(), timeout=5)
    assert [run.get("killed") for run in fleet.log.runs(key)] == [True]  # the body never ended

    again = _send(fleet, "sleeper", "killed-key", 0.05)
    assert again.get(timeout=15)["key"] == key


@requires_prompt_redelivery
def test_acks_late_redelivery_past_visibility_timeout_runs_once(fleet: Fleet) -> None:
    # visibility_timeout is 2 s and the task runs 6 s: the broker hands the same message (same
    # task id, same retries) to a worker again while the first copy still runs.
    result = _send(fleet, "late_sleeper", "late-key", 6)
    entry = result.get(timeout=30)
    key = entry["key"]
    assert entry["task_id"] == result.id

    redelivered = [
        event
        for event in fleet.lock_events()
        if event["task_id"] == result.id and event["policy"] == "redelivered"
    ]
    assert redelivered, f"no redelivery happened: {fleet.lock_events()}\n{fleet.logs()}"

    # The copy was deferred, not dropped: it comes back once the lock is gone and is then
    # acknowledged as completed, leaving nothing on the broker.
    def settled() -> bool:
        policies = {
            event["policy"] for event in fleet.lock_events() if event["task_id"] == result.id
        }
        with fleet.broker.client() as client:
            empty = client.llen("celery") == 0 and client.hlen("unacked") == 0
        return "completed" in policies and empty

    assert wait_until(settled, timeout=20), fleet.lock_events()
    policies = {event["policy"] for event in fleet.lock_events() if event["task_id"] == result.id}
    assert policies <= {"redelivered", "completed"}, policies
    runs = [run for run in fleet.log.runs(key) if run["task_id"] == result.id]
    assert len(runs) == 1, runs
    assert len([s for s in fleet.log.started(key) if s["task_id"] == result.id]) == 1
    assert wait_until(lambda: key_gone(fleet.nodes, key), timeout=5)


def test_hard_time_limit_frees_the_lock_when_the_child_is_killed(fleet: Fleet) -> None:
    result = _send(fleet, "sleeper", "time-limited-key", 20, time_limit=1.5)
    started = fleet.log.wait_task_started(result.id, timeout=15)
    key = started["key"]
    assert key_held(fleet.nodes, key)
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=15)
    fleet.log.mark_ended(started, time.time())  # the child was killed at its time limit
    assert wait_until(lambda: key_gone(fleet.nodes, key), timeout=5), fleet.logs()
    assert time.time() - started["start"] < 10 < LOCK_TTL


def test_a_killed_child_with_reject_on_worker_lost_runs_again(patient_fleet: Fleet) -> None:
    # acks_late + reject_on_worker_lost: Celery puts the message of a killed child back on the
    # queue (same task id, same retries) and sends no task_failure. That delivery is not a
    # duplicate of a running copy: its first copy is dead, and the task must run again (the
    # dead child's lock once made it look like a redelivery, and the task was dropped).
    # The patient fleet: with a 2 s visibility timeout the broker could hand the message to the
    # other worker before the main process notices the dead child (its pool check runs every 5 s
    # when the process sentinel is missed), and that copy is rightly deferred for the lock's ttl.
    fleet = patient_fleet
    result = _send(fleet, "requeued_sleeper", "requeued-key", 20)
    started = fleet.log.wait_task_started(result.id, timeout=15)
    os.kill(started["pid"], signal.SIGKILL)
    fleet.log.mark_ended(started, time.time())  # the killed child can no longer record it
    # Freed by the main process as soon as it notices the loss, it runs again at once.
    entry = result.get(timeout=10)
    assert entry["task_id"] == result.id
    assert entry["pid"] != started["pid"]
