"""`celery_redlock.admin`: node status, held locks, keys, forced release and reaping, against
real redis-server processes, embedded workers (a solo pool busy in a task does not answer
control commands) and real ``celery worker`` subprocesses (killed and restarted under the same
node name). No test waits on a sleep: each waits for an event (a signal, a run record, a key).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.bootsteps import CLOSE, RUN
from celery_apps.subprocesses import WorkerProcess, app_environment, celery_processes
from celery_apps.support import LockSignals, RunLog, embedded_worker, key_gone, make_app
from cli_app import create_app
from redlock_support import values_on, wait_until

from celery_redlock import ConfigurationError, QuorumUnavailable, Redlock, SingletonTask, admin
from celery_redlock.lock import keyspace
from celery_redlock.lock.owner import Owner
from celery_redlock.settings import RedlockSettings
from celery_redlock.testing import RedisNodes, RedisServer

pytest_plugins = ["celery_apps.fixtures"]

HOST = socket.gethostname()
FAST = 0.3  # seconds per node and per control command


def dead_pid() -> int:
    """The process id of a process that has exited (and was reaped)."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def take(nodes: RedisNodes, resource: str, owner: Owner | None, ttl: float = 30.0) -> Any:
    """Take the lock on ``resource`` for ``owner`` as a worker would; returns it once every node
    has it (an acquisition returns as soon as a majority has)."""
    redlock = Redlock(nodes.urls, node_timeout=1.0)  # a busy machine must not skip a node
    lock = redlock.acquire(resource, ttl, owner=owner.to_text() if owner else "")
    assert lock is not None
    assert wait_until(lambda: values_on(nodes, lock.key) == [lock.value] * len(nodes))
    redlock.close()
    return lock


def ghost(task: str, task_id: str, **fields: Any) -> Owner:
    """The owner record of a run that nobody runs any more (a host and worker that are gone)."""
    values: dict[str, Any] = {
        "host": "gone.invalid",
        "pid": 4242,
        "worker": "ghost@gone.invalid",
        "since": round(time.time(), 3),
    }
    values.update(fields)
    return Owner(id=task_id, task=task, **values)


def by_key(results: list[admin.ReapResult]) -> dict[str, admin.ReapResult]:
    return {result.lock.key: result for result in results}


# -- status, listing, keys, release (no workers) ------------------------------------------------


def test_node_status_one_record_per_node_and_group_warnings(redis_nodes: Any) -> None:
    nodes = redis_nodes(4)
    nodes[3].kill()
    app = create_app([*nodes.urls, nodes.urls[0].replace("/0", "/1")])  # 5 URLs, 4 servers

    report = admin.status_report(app, timeout=FAST)
    statuses = admin.node_status(app, timeout=FAST)

    assert [status.node for status in statuses] == [status.node for status in report.nodes]
    assert len(statuses) == 5 and all(isinstance(status, admin.NodeStatus) for status in statuses)
    assert [status.reachable for status in statuses] == [True, True, True, False, True]
    assert statuses[3].error and "Connection refused" in statuses[3].error
    assert all(
        0 < (status.round_trip_milliseconds or 0) < 300 for status in statuses if status.reachable
    )
    assert statuses[0].role == "master" and statuses[0].aof_enabled is False
    assert any("delayed restart" in warning for warning in statuses[0].warnings)
    assert (report.reachable, report.quorum, report.has_quorum) == (4, 3, True)
    assert f"{nodes.urls[0]} and {nodes.urls[0][:-1]}1 are the same Redis server" in " ".join(
        report.warnings
    )
    assert "1 of 5 lock nodes unreachable: locks still work, but 2 more" in " ".join(
        report.warnings
    )
    assert report.to_json()["nodes"][3]["reachable"] is False

    even = admin.status_report(create_app(nodes.urls[:2]), timeout=FAST)
    assert even.warnings[0] == (
        "2 lock nodes configured: an even number tolerates no more failed nodes than 1 would "
        "(2 of 2 must agree), while adding a node that can fail; use an odd number such as 3 or 5"
    )


def test_held_locks_show_holders_beat_leader_and_never_tokens(three_nodes: RedisNodes) -> None:
    app = create_app(three_nodes.urls)
    task_owner = Owner.here("cli_app.sync_account", "run-1", 2, 1, worker=f"alpha@{HOST}")
    task_lock = take(three_nodes, "cli_app.sync_account:abc", task_owner)
    lease = take(three_nodes, "celery-beat-leader", Owner.here(None, None, role="beat leader"))
    prefix = RedlockSettings.key_prefix
    leftover = keyspace.lock_key(prefix, "leftover")
    with three_nodes[0].client() as client:
        client.hset(keyspace.records_key(task_lock.key, "run-0"), "run", "0:0")  # completion
        client.set(keyspace.schedule_key(lease.key), "{}")  # the leader's records
        client.set(keyspace.fence_key(lease.key), "7")  # a fencing counter
        client.lpush(keyspace.lock_key(prefix, "a-list"), "x")  # not a string
        client.set(keyspace.lock_key(prefix, "app"), "important")  # not a lock value
        client.set(leftover, "f" * 40 + "|{}", px=5000)  # a minority leftover

    locks = admin.held_locks(app, timeout=FAST)

    assert [record.key for record in locks] == [lease.key, task_lock.key]
    beat, task = locks
    assert beat.role == "beat leader" and beat.task is None and beat.pid == os.getpid()
    assert (task.task, task.task_id, task.worker, task.host, task.pid) == (
        "cli_app.sync_account",
        "run-1",
        f"alpha@{HOST}",
        HOST,
        os.getpid(),
    )
    assert task.owner is not None and task.owner.attempt == (1, 2)
    assert (task.nodes_holding, task.nodes_total, task.held) == (3, 3, True)
    assert task.time_left is not None and 25 < task.time_left <= 30
    assert task.worker_answers is None and task.task_active is None  # not asked
    shown = repr(locks) + str([record.to_json() for record in locks])
    assert task_lock.token not in shown and lease.token not in shown
    listing = admin.lock_listing(app, timeout=FAST)
    assert [record.key for record in listing.minority] == [leftover]

    three_nodes[1].kill()
    three_nodes[2].kill()
    with pytest.raises(QuorumUnavailable):
        admin.held_locks(app, timeout=FAST)


def test_lock_key_holder_and_force_release(three_nodes: RedisNodes) -> None:
    app = create_app(three_nodes.urls)
    sync_account = app.tasks["cli_app.sync_account"]
    key = admin.lock_key(app, "cli_app.sync_account", 42, full=True)
    assert key == sync_account.lock_key_for(42, full=True) == sync_account.lock_key_for(42)
    nightly = app.tasks["cli_app.nightly_cleanup"]
    assert admin.lock_key(app, "cli_app.nightly_cleanup") == nightly.lock_key_for()
    with pytest.raises(admin.UnknownTask, match=r"did you mean cli_app\.sync_account"):
        admin.lock_key(app, "cli_app.sync_acount", 1)
    with pytest.raises(admin.UnknownTask, match="is not a SingletonTask"):
        admin.lock_key(app, "cli_app.plain")

    assert admin.holder(app, "cli_app.sync_account", 42) is None
    resource = admin.call_key(app, "cli_app.sync_account", [42]).resource
    lock = take(three_nodes, resource, Owner.here("cli_app.sync_account", "run-42"))
    held = admin.holder(app, "cli_app.sync_account", account_id=42)
    assert held is not None and held.task_id == "run-42" and held.key == key

    result = admin.force_release(app, resource, timeout=FAST)  # a resource, not the key

    assert (result.key, result.resource, result.found) == (key, resource, True)
    assert result.lock is not None and result.lock.task_id == "run-42"
    assert result.deleted_on == tuple(three_nodes.urls) and not result.still_present_on
    assert values_on(three_nodes, key) == [None, None, None]
    assert lock.token not in str(result.to_json())
    assert not admin.force_release(app, key, timeout=FAST).found
    with pytest.raises(admin.NotALock, match=r"is not a lock: it is a fencing counter"):
        admin.force_release(app, keyspace.fence_key(key))


def test_reap_settings_are_validated() -> None:
    settings = RedlockSettings(urls=("redis://localhost:6379/0",))
    assert (settings.reap_interval, settings.reap_grace) == (None, 30.0)
    for wrong in ({"reap_interval": 0}, {"reap_interval": "5"}, {"reap_grace": -1}):
        with pytest.raises(ConfigurationError, match="redlock_reap_"):
            RedlockSettings(urls=("redis://localhost:6379/0",), **wrong)
    app = create_app("redis://localhost:6379/0")
    app.conf.redlock_reap_grace = True
    with pytest.raises(ConfigurationError, match="redlock_reap_grace"):
        admin.reap(app)


# -- reaping --------------------------------------------------------------------------------------


def test_reap_never_frees_what_it_cannot_prove(three_nodes: RedisNodes) -> None:
    """Dead holders whose locks must stay: no proof applies, so nothing changes."""
    app = create_app(three_nodes.urls)
    gone = dead_pid()
    locks = {
        "unknown task": take(
            three_nodes, "other.task", ghost("other.task", "t1", host=HOST, pid=gone)
        ),
        "hold window": take(
            three_nodes,
            "cli_app.nightly_cleanup",
            ghost("cli_app.nightly_cleanup", "t2", host=HOST, pid=gone),
        ),
        "queued claim": take(
            three_nodes,
            "cli_app.sync_account:q",
            ghost("cli_app.sync_account", "t3", host=HOST, pid=gone, queued=True),
        ),
        "no owner": take(three_nodes, "cli_app.sync_account:bare", None),
        "silent": take(three_nodes, "cli_app.sync_account:s", ghost("cli_app.sync_account", "t4")),
        "grace too short": take(
            three_nodes, "cli_app.sync_account:long", ghost("cli_app.sync_account", "t5"), ttl=30
        ),
    }

    results = by_key(admin.reap(app, grace=0, timeout=FAST))
    longer = by_key(admin.reap(app, grace=5, timeout=FAST))

    reasons = {name: results[lock.key].reason for name, lock in locks.items()}
    assert "not a singleton task of this app" in reasons["unknown task"]
    assert "lock_hold window" in reasons["hold window"]  # nightly_cleanup: lock_hold=45
    assert "when the call was queued" in reasons["queued claim"]
    assert "no owner" in reasons["no owner"]
    assert "grace is 0" in reasons["silent"]
    assert "longer than the grace of 5s" in longer[locks["grace too short"].key].reason
    assert {result.action for result in [*results.values(), *longer.values()]} == {admin.KEPT}
    for lock in locks.values():
        assert values_on(three_nodes, lock.key) == [lock.value] * 3


def test_reap_frees_a_dead_local_process_only_for_real(three_nodes: RedisNodes) -> None:
    app = create_app(three_nodes.urls)
    gone = dead_pid()
    owner = ghost("cli_app.sync_account", "t1", host=HOST, pid=gone, worker=None)
    lock = take(three_nodes, "cli_app.sync_account:dead", owner)
    alive = take(
        three_nodes,
        "cli_app.sync_account:alive",
        ghost("cli_app.sync_account", "t2", host=HOST, pid=os.getpid(), worker=None),
    )

    dry = by_key(admin.reap(app, dry_run=True, grace=0, timeout=FAST))
    assert dry[lock.key].action == admin.WOULD_FREE
    assert dry[lock.key].proof == admin.PROOF_PROCESS_GONE
    assert dry[alive.key].action == admin.KEPT
    assert values_on(three_nodes, lock.key) == [lock.value] * 3  # a dry run deletes nothing
    host_names_shared = by_key(admin.reap(app, grace=0, check_local_processes=False, timeout=FAST))
    assert host_names_shared[lock.key].action == admin.KEPT

    results = by_key(admin.reap(app, grace=0, timeout=FAST))

    assert results[lock.key].action == admin.FREED and results[lock.key].nodes_freed >= 2
    assert f"process {gone} no longer exists" in results[lock.key].reason
    assert results[alive.key].action == admin.KEPT
    assert wait_until(lambda: key_gone(three_nodes, lock.key))
    assert values_on(three_nodes, alive.key) == [alive.value] * 3
    assert Redlock(three_nodes.urls).acquire(lock.resource, 5) is not None  # free to take


@pytest.fixture
def busy_gate() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def test_reap_keeps_a_busy_solo_holder_and_frees_a_silent_unextended_one(
    broker: RedisServer,
    lock_nodes: RedisNodes,
    busy_gate: threading.Event,
    lock_signals: LockSignals,
) -> None:
    """A solo worker busy in a task answers no control command, exactly like a dead one; its
    keeper extending the lock is what shows it alive. A lock nobody extends is freed."""
    app = make_app(broker, lock_nodes)

    @app.task(base=SingletonTask, name="reap.hold", shared=False, lock_args=("key",), lock_ttl=3)
    def hold(key: str) -> str:
        busy_gate.wait(20)
        return key

    worker_name = f"busy@{HOST}"
    with embedded_worker(app, pool="solo", concurrency=1, hostname=worker_name):
        try:
            running = hold.delay("live")
            live_key = lock_signals.wait("lock_acquired", task_id=running.id)[0]["key"]
            resource = admin.call_key(app, "reap.hold", ["stuck"]).resource
            stuck = take(lock_nodes, resource, ghost("reap.hold", "stuck-1"), ttl=6)
            expires_at = time.monotonic() + 6

            assert app.control.ping(destination=[worker_name], timeout=FAST) == []  # busy
            checked = {record.key: record for record in admin.held_locks(app, check_workers=True)}
            assert checked[stuck.key].worker_answers is False
            watching: list[str] = []
            results = by_key(admin.reap(app, grace=3.1, timeout=FAST, progress=watching.append))

            assert watching == ["watching 2 lock(s) for 3.1s"]
            assert results[live_key].action == admin.KEPT
            assert "extended it while it was watched" in results[live_key].reason
            assert results[stuck.key].action == admin.FREED
            assert results[stuck.key].proof == admin.PROOF_SILENT
            assert "ghost@gone.invalid did not answer" in results[stuck.key].reason
            assert key_gone(lock_nodes, stuck.key)
            assert all(values_on(lock_nodes, live_key))
        finally:
            busy_gate.set()
        assert running.get(timeout=10) == "live"
        freed_run = hold.delay("stuck")
        assert freed_run.get(timeout=10) == "stuck"  # it took the freed lock and ran
        acquired = lock_signals.wait("lock_acquired", task_id=freed_run.id)[0]
        assert acquired["at"] < time.time() + (expires_at - time.monotonic())


def test_reap_a_killed_worker_with_proof_only(broker: RedisServer, lock_nodes: RedisNodes) -> None:
    """A real prefork worker holding a 30 s lock is SIGKILLed with its pool (nothing frees the
    lock); reaping needs proof, then the same call runs again at once."""
    app = make_app(broker, lock_nodes)

    # The operator's app defines the same task as the worker's (celery_apps.prefork_app).
    @app.task(
        base=SingletonTask,
        name="celery_apps.prefork_app.sleeper",
        shared=False,
        lock_args=("key",),
        lock_ttl=30,
    )
    def sleeper(key: str, seconds: float) -> None: ...

    environment = app_environment(broker, lock_nodes)
    log = RunLog(broker.url)
    lock_key = sleeper.lock_key_for("reaped", 0)

    def victim() -> WorkerProcess:
        worker = WorkerProcess(
            "celery_apps.prefork_app",
            "victim",
            environment,
            concurrency=1,
            extra_arguments=["-Q", "victim"],
        )
        processes.append(worker.start())
        worker.wait_ready(app)
        return worker

    with celery_processes() as processes:
        worker = victim()
        first = app.send_task(sleeper.name, args=("reaped", 60), queue="victim")
        log.wait_task_started(first.id, timeout=20)
        (record,) = admin.held_locks(app, check_workers=True, timeout=FAST)
        assert (record.worker, record.task_id) == (worker.hostname, first.id)
        assert (record.worker_answers, record.task_active) == (True, True)
        (alive,) = admin.reap(app, grace=0, timeout=FAST)
        assert alive.action == admin.KEPT and "is running task" in alive.reason

        worker.kill()
        assert wait_until(lambda: not admin.process_exists(record.pid or 0), timeout=10)
        stored = values_on(lock_nodes, lock_key)
        (silent,) = admin.reap(app, grace=0, check_local_processes=False, timeout=FAST)
        assert silent.action == admin.KEPT and "the grace is 0" in silent.reason
        (dry,) = admin.reap(app, dry_run=True, grace=0, timeout=FAST)
        assert (dry.action, dry.proof) == (admin.WOULD_FREE, admin.PROOF_PROCESS_GONE)
        assert values_on(lock_nodes, lock_key) == stored  # nothing changed so far

        restarted = victim()  # the same node name, new processes
        (record,) = admin.held_locks(app, check_workers=True, timeout=FAST)
        assert (record.worker_answers, record.task_active) == (True, False)
        (freed,) = admin.reap(app, grace=0, check_local_processes=False, timeout=FAST)

        assert (freed.action, freed.proof) == (admin.FREED, admin.PROOF_NOT_RUNNING), freed
        assert "is none of its processes" in freed.reason
        assert key_gone(lock_nodes, lock_key)
        again = app.send_task(sleeper.name, args=("reaped", 0.05), queue="victim")
        assert log.wait_runs(1, key=lock_key, timeout=20)[0]["task_id"] == again.id
        restarted.check_alive()


def test_workers_reap_on_a_timer_when_configured(
    broker: RedisServer, lock_nodes: RedisNodes
) -> None:
    # No grace: the fake live lock below is never extended, and must stay.
    app = make_app(broker, lock_nodes, redlock_reap_interval=0.1, redlock_reap_grace=0)

    @app.task(base=SingletonTask, name="reap.timer", shared=False, lock_args=("key",))
    def job(key: str) -> None: ...

    resource = admin.call_key(app, "reap.timer", ["k"]).resource
    lock = take(lock_nodes, resource, ghost("reap.timer", "t", host=HOST, pid=dead_pid()))
    live = take(
        lock_nodes,
        admin.call_key(app, "reap.timer", ["live"]).resource,
        ghost("reap.timer", "t2", host=HOST, pid=os.getpid()),
    )
    assert not key_gone(lock_nodes, lock.key)

    with embedded_worker(app, concurrency=1):
        assert wait_until(lambda: key_gone(lock_nodes, lock.key), timeout=10)

    assert values_on(lock_nodes, live.key) == [live.value] * 3

    def reaper_stopped() -> bool:
        return not any(thread.name == "celery-redlock reaper" for thread in threading.enumerate())

    assert wait_until(reaper_stopped, timeout=5)  # it ends with its worker


class StubWorker:
    """Stands for a Celery `WorkController` as the reaper timer sees it: a blueprint state."""

    def __init__(self) -> None:
        self.blueprint = type("Blueprint", (), {"state": RUN})()


def test_the_reaper_thread_reaps_while_its_worker_runs(three_nodes: RedisNodes) -> None:
    assert admin.start_reaper_thread(create_app(three_nodes.urls), StubWorker()) is None  # off
    app = create_app(three_nodes.urls)
    app.conf.update(redlock_reap_interval=0.05, redlock_reap_grace=0)
    dead = ghost("cli_app.sync_account", "t1", host=HOST, pid=dead_pid(), worker=None)
    lock = take(three_nodes, admin.call_key(app, "cli_app.sync_account", [1]).resource, dead)
    worker = StubWorker()
    worker.blueprint.state = CLOSE  # a worker shutting down: the thread ends, reaping nothing

    thread = admin.start_reaper_thread(app, worker)

    assert thread is not None and thread.name == "celery-redlock reaper" and thread.daemon
    thread.join(5)
    assert not thread.is_alive() and values_on(three_nodes, lock.key) == [lock.value] * 3
    worker = StubWorker()
    thread = admin.start_reaper_thread(app, worker)
    assert thread is not None
    assert wait_until(lambda: key_gone(three_nodes, lock.key), timeout=10)
    worker.blueprint.state = CLOSE
    thread.join(5)
    assert not thread.is_alive()
