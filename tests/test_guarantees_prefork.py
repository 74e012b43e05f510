"""The promise on the paths that cross processes, with real ``celery worker -P prefork``
subprocesses (tests/celery_apps/guarantee_app.py): hard and soft time limits, a host that dies
while its task holds the lock, ETA tasks the broker delivers twice, task ids with unusual
characters, a ``lock_key`` the worker's main process cannot compute, and workers that refuse a
bad configuration instead of failing every task later.

Two workers of three pool processes each consume one harness Redis broker (visibility_timeout
2 s); locks live on three other harness nodes.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from billiard.exceptions import WorkerLostError
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery.result import AsyncResult
from celery_apps.subprocesses import (
    CeleryProcess,
    WorkerProcess,
    app_environment,
    celery_processes,
    control_app,
)
from celery_apps.support import LOCK_EVENTS, RunLog, documented_key, key_gone, key_held
from conftest import MakeRedisNodes
from prometheus_client import CollectorRegistry
from redlock_support import (
    collect_results_while_the_broker_is_up,
    requires_prompt_redelivery,
    wait_until,
)

from celery_redlock import DuplicateSkipped
from celery_redlock.testing import RedisNodes, RedisServer
from example_project.metrics_exporter import LockMetrics

APP = "celery_apps.guarantee_app"
VISIBILITY_TIMEOUT = 2


@dataclass
class Fleet:
    """Two prefork workers, their broker, lock nodes and run log."""

    broker: RedisServer
    nodes: RedisNodes
    environment: dict[str, str]
    client_app: Celery
    log: RunLog
    workers: list[WorkerProcess]

    def send(self, name: str, *args: object, **options: object) -> AsyncResult:
        return self.client_app.send_task(f"{APP}.{name}", args=args, **options)

    def logs(self) -> str:
        return "\n".join(worker.log_text() for worker in self.workers)

    def duplicates(self, task_id: str) -> list[str]:
        return [
            str(event["policy"])
            for event in self.log.read(LOCK_EVENTS)
            if event.get("task_id") == task_id
        ]

    def settled(self) -> bool:
        """Nothing left in the queue or unacknowledged on the broker."""
        with self.broker.client() as client:
            return client.llen("celery") == 0 and client.hlen("unacked") == 0


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with RedisServer() as broker, RedisNodes(3) as nodes, celery_processes() as processes:
        environment = app_environment(broker, nodes, CRL_VISIBILITY_TIMEOUT=str(VISIBILITY_TIMEOUT))
        client_app = control_app(broker, result_backend=broker.url)
        workers = [
            WorkerProcess(APP, name, environment, concurrency=3) for name in ("alpha", "beta")
        ]
        try:
            for worker in workers:
                processes.append(worker.start())
            for worker in workers:
                worker.wait_ready(client_app)
            log = RunLog(broker.url)
            yield Fleet(broker, nodes, environment, client_app, log, workers)
            log.assert_no_overlap()
        finally:
            collect_results_while_the_broker_is_up()
            client_app.close()


# -- time limits ---------------------------------------------------------------------------------


def test_a_hard_time_limit_keeps_the_lock_until_the_child_is_gone(fleet: Fleet) -> None:
    # Celery calls the request's on_timeout before billiard sends SIGTERM, waits 0.1 s and sends
    # SIGKILL; this task ignores SIGTERM and beats every 5 ms until SIGKILL. A duplicate waiting
    # for the lock must start after the last beat, never while the old child still runs.
    first = fleet.send("stubborn", "limit-key", time_limit=1.0)
    started = fleet.log.wait_task_started(first.id, timeout=15)
    duplicate = fleet.send("stubborn", "limit-key", False)
    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=15)
    entry = duplicate.get(timeout=15)
    beats = [beat["at"] for beat in fleet.log.read("heartbeats") if beat["task_id"] == first.id]
    fleet.log.mark_ended(started, max(beats))  # the killed child never recorded its end
    assert entry["start"] > max(beats), (entry["start"], max(beats))


def test_a_soft_time_limit_during_acquisition_leaks_no_lock(fleet: Fleet) -> None:
    # Two of three nodes hang: the acquisition waits for them (0.5 s node timeout) and the soft
    # time limit (0.3 s) interrupts it after the SETs were sent. Whatever landed is released.
    key = documented_key(f"{APP}.quick", {"key": "soft-key"})
    fleet.nodes[0].pause()
    fleet.nodes[1].pause()
    try:
        result = fleet.send("quick", "soft-key", soft_time_limit=0.3)
        with pytest.raises(SoftTimeLimitExceeded):
            result.get(timeout=15)
    finally:
        fleet.nodes[0].resume()
        fleet.nodes[1].resume()
    assert wait_until(lambda: key_gone(fleet.nodes, key), timeout=3), "a lock leaked (30 s ttl)"
    assert fleet.log.started(key) == []


# -- a dead host, and the broker delivering the same message again --------------------------------


@requires_prompt_redelivery
def test_a_copy_redelivered_after_its_host_died_runs_once_the_lock_is_gone(fleet: Fleet) -> None:
    # acks_late: the broker delivers the message again (after visibility_timeout) while the dead
    # host's lock still has seconds left. The copy is deferred, never acknowledged and dropped.
    with celery_processes() as processes:
        workers = [
            WorkerProcess(APP, name, fleet.environment, 2, ["-Q", "hostdeath"])
            for name in ("gamma", "delta")
        ]
        for worker in workers:
            processes.append(worker.start())
        for worker in workers:
            worker.wait_ready(fleet.client_app)
        result = fleet.send("late", "host-key", 30, queue="hostdeath")
        started = fleet.log.wait_task_started(result.id, timeout=15)
        (host,) = [worker for worker in workers if started["pid"] in worker.child_pids()]
        (survivor,) = [worker for worker in workers if worker is not host]
        host.kill()  # the whole worker, children and all: what a dead machine looks like
        killed_at = time.time()
        fleet.log.mark_ended(started, killed_at)
        entry = result.get(timeout=30)
        assert wait_until(fleet.settled, timeout=10)
    assert entry["start"] > killed_at
    assert entry["worker"] == survivor.hostname
    assert "redelivered" in fleet.duplicates(result.id)  # it arrived while the lock was held
    runs = [run for run in fleet.log.runs() if run["task_id"] == result.id]
    assert [run.get("killed") for run in runs] == [True, None]


@requires_prompt_redelivery
def test_a_pending_coalesced_run_survives_the_death_of_its_worker(fleet: Fleet) -> None:
    # on_duplicate="coalesce": the pending run waits in a worker that dies. Its message was
    # acknowledged when it started; the copy it published when it became pending runs instead.
    flag = f"release-{uuid.uuid4().hex}"
    with celery_processes() as processes:
        holder_worker = WorkerProcess(APP, "holder", fleet.environment, 1, ["-Q", "holder"])
        pending_worker = WorkerProcess(APP, "pending", fleet.environment, 1, ["-Q", "pending"])
        for worker in (holder_worker, pending_worker):
            processes.append(worker.start())
        for worker in (holder_worker, pending_worker):
            worker.wait_ready(fleet.client_app)
        holder = fleet.send("coalescing", "coalesce-key", flag, queue="holder")
        fleet.log.wait_task_started(holder.id, timeout=15)
        duplicate = fleet.send("coalescing", "coalesce-key", queue="pending")
        assert wait_until(lambda: "coalesce" in fleet.duplicates(duplicate.id), timeout=15)
        pending_worker.kill()
        successor = WorkerProcess(APP, "successor", fleet.environment, 1, ["-Q", "pending"])
        processes.append(successor.start())
        successor.wait_ready(fleet.client_app)
        with fleet.broker.client() as client:
            client.set(flag, 1)
        holder_entry = holder.get(timeout=15)
        assert wait_until(lambda: duplicate.ready(), timeout=20), (
            f"{fleet.log.read(LOCK_EVENTS)}\n{successor.log_text()}\n{pending_worker.log_text()}"
        )
        entry = duplicate.get(timeout=1)
    assert entry["worker"] == successor.hostname
    assert entry["start"] >= holder_entry["end"]
    runs = [run for run in fleet.log.runs() if run["task_id"] == duplicate.id]
    assert len(runs) == 1


@requires_prompt_redelivery
def test_an_eta_task_delivered_twice_runs_once(fleet: Fleet) -> None:
    # The Redis transport hands an ETA message to a second worker after visibility_timeout
    # (Celery #4400): both copies come due at once. The later one finds the first one's record
    # ("completed": acknowledged) or the first one still holding the lock ("redelivered":
    # deferred until the lock expires, 3 s for this task, then acknowledged).
    result = fleet.send("brief", "eta-key", countdown=VISIBILITY_TIMEOUT + 3)
    result.get(timeout=30)

    def copies_done() -> bool:
        # A deferred copy is due within the lock's ttl and 0.6 s of jitter. Until then "settled"
        # may be a copy between the broker's queue and a worker's unacknowledged messages.
        mine = [event for event in fleet.log.read(LOCK_EVENTS) if event.get("task_id") == result.id]
        deferred = [float(event["at"]) for event in mine if event["policy"] == "redelivered"]
        return bool(mine) and time.time() > max(deferred, default=0.0) + 4 and fleet.settled()

    assert wait_until(copies_done, timeout=20), fleet.log.read(LOCK_EVENTS)
    assert [run["task_id"] for run in fleet.log.runs() if run["task_id"] == result.id] == [
        result.id
    ]
    assert set(fleet.duplicates(result.id)) <= {"redelivered", "completed"}


# -- every task id works; the main process's clean-up never breaks Celery ------------------------


def test_a_killed_child_frees_its_lock_whatever_the_task_id(fleet: Fleet) -> None:
    task_id = f'id with | and " and \\ and ø {uuid.uuid4()}'
    result = fleet.send("sleeper", "odd-id-key", 20, task_id=task_id)
    started = fleet.log.wait_task_started(task_id, timeout=15)
    key = started["key"]
    assert key_held(fleet.nodes, key)
    os.kill(started["pid"], signal.SIGKILL)
    fleet.log.mark_ended(started, time.time())
    assert wait_until(lambda: key_gone(fleet.nodes, key), timeout=10), fleet.logs()  # not 30 s
    with pytest.raises(WorkerLostError):
        result.get(timeout=10)


def test_a_lock_key_that_fails_in_the_main_process_does_not_break_failure_handling(
    fleet: Fleet,
) -> None:
    result = fleet.send("odd_key", "main-process", 20)
    started = fleet.log.wait_task_started(result.id, timeout=15)
    os.kill(started["pid"], signal.SIGKILL)
    fleet.log.mark_ended(started, time.time())
    with pytest.raises(WorkerLostError):  # Celery still stores the failure
        result.get(timeout=10)
    assert wait_until(lambda: "could not free the lock of lost task" in fleet.logs(), timeout=5)


# -- a bad configuration stops the worker at start -----------------------------------------------

BAD_CONFIGURATIONS = {
    "ttl-zero": ({"redlock_ttl": 0}, {}, "redlock_ttl"),
    "unknown-policy": ({"redlock_on_duplicate": "sometimes"}, {}, "redlock_on_duplicate"),
    "http-url": ({"redlock_urls": ["http://127.0.0.1:6379/0"]}, {}, "not a Redis URL"),
    "empty-urls": ({"redlock_urls": []}, {}, "redlock_urls is empty"),
    "space-separated": (
        {"redlock_urls": "redis://127.0.0.1:1/0 redis://127.0.0.1:2/0"},
        {},
        "several URLs in one string",
    ),
    "semicolon-separated": (
        {"redlock_urls": "redis://127.0.0.1:1/0;redis://127.0.0.1:2/0"},
        {},
        "several URLs in one string",
    ),
    "database-name": ({"redlock_urls": ["redis://127.0.0.1:1/abc"]}, {}, "not a number"),
    "lock-ttl-too-short": ({}, {"lock_ttl": 0.04}, "lock_ttl of task"),
}


def test_a_bad_configuration_stops_the_worker_at_start(redis_nodes: MakeRedisNodes) -> None:
    broker = redis_nodes(1)[0]
    locks = redis_nodes(3)
    with celery_processes() as processes:
        for name, (settings, options, _) in BAD_CONFIGURATIONS.items():
            environment = app_environment(
                broker,
                locks,
                CRL_SETTINGS=json.dumps(settings),
                CRL_TASK_OPTIONS=json.dumps(options),
            )
            processes.append(
                CeleryProcess(
                    "celery_apps.config_app",
                    ["worker", "-P", "solo", "-n", f"{name}@%h", "--without-mingle"],
                    environment,
                ).start()
            )
        expected = BAD_CONFIGURATIONS.items()
        for process, (name, (_, _, named)) in zip(processes, expected, strict=True):
            returncode = process.wait(60)
            output = process.log_text()
            assert returncode != 0, f"{name}: the worker started\n{output}"
            assert named in output, f"{name}: {output}"


# -- what monitors see ---------------------------------------------------------------------------


def test_lock_outcomes_are_celery_events_when_the_worker_sends_events(fleet: Fleet) -> None:
    # Events of the group redlock- from a prefork child, counted by the metrics exporter of the
    # example project, plus task-revoked for a skipped duplicate (Flower then shows it finished).
    registry = CollectorRegistry()
    metrics = LockMetrics(registry)
    seen: list[dict[str, object]] = []
    stop = threading.Event()
    handlers = {
        **{
            name: (lambda event, count=count: (seen.append(event), count(event)))
            for name, count in metrics.handlers().items()
        },
        "task-revoked": seen.append,
    }

    listening = threading.Event()

    def listen() -> None:
        # One capture, never left until the end: Redis carries events over publish/subscribe,
        # so an event sent while no capture is subscribed is lost for good.
        with fleet.client_app.connection_for_read() as connection:
            receiver = fleet.client_app.events.Receiver(connection, handlers=handlers)
            iterations = itertools.count()

            def on_iteration() -> None:
                receiver.should_stop = stop.is_set()
                if next(iterations) == 1:  # the first wait for events has subscribed
                    listening.set()

            receiver.on_iteration = on_iteration
            for _ in receiver.consume(limit=None, timeout=None, safety_interval=0.2, wakeup=False):
                pass

    listener = threading.Thread(target=listen, daemon=True)
    with celery_processes() as processes:
        worker = WorkerProcess(APP, "monitored", fleet.environment, 2, ["-Q", "monitored", "-E"])
        processes.append(worker.start())
        worker.wait_ready(fleet.client_app)
        listener.start()
        assert listening.wait(10)
        try:
            holder = fleet.send("sleeper", "monitored-key", 1.0, queue="monitored")
            fleet.log.wait_task_started(holder.id, timeout=15)
            skipped = fleet.send("sleeper", "monitored-key", 0, queue="monitored")
            with pytest.raises(DuplicateSkipped):
                skipped.get(timeout=15)
            holder.get(timeout=15)

            def types() -> set[tuple[object, object]]:
                return {(event["type"], event.get("uuid")) for event in seen}

            expected = {
                ("redlock-acquired", holder.id),
                ("redlock-released", holder.id),
                ("redlock-duplicate", skipped.id),
                ("task-revoked", skipped.id),
            }
            assert wait_until(lambda: expected <= types(), timeout=10), seen
        finally:
            stop.set()
            listener.join(5)
    duplicate = next(event for event in seen if event["type"] == "redlock-duplicate")
    assert duplicate["policy"] == "skip" and duplicate["task"] == f"{APP}.sleeper"
    assert str(duplicate["key"]).startswith("redlock:")  # a hash, never the argument values
    assert "monitored-key" not in json.dumps(seen)
    task = f"{APP}.sleeper"
    assert (
        registry.get_sample_value("redlock_outcomes_total", {"task": task, "outcome": "acquired"})
        == 1.0
    )
    assert (
        registry.get_sample_value("redlock_duplicates_total", {"task": task, "policy": "skip"})
        == 1.0
    )
