"""A Redis Cluster as one lock node (``redis+cluster://``), on real local clusters: mutual
exclusion (threads and processes), locks spread over the masters, clusters as members of one
quorum, a master failed over (``CLUSTER FAILOVER``, a killed master) and a slot migrated (``ASK``,
then ``MOVED``) under a held lock, replica acknowledgement, a Celery worker's singleton tasks,
and the operators' API and CLI reading every master. Seconds each: marked ``topology``.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery_apps.support import RunLog, embedded_worker, make_app
from cli_support import as_json, invoke
from redlock_support import run_together, value_on, wait_until
from topologies import RedisCluster, SlotMigration
from topology_support import HoldThroughFailover, Rival, lock_managers, unique

from celery_redlock import (
    DuplicateSkipped,
    QuorumUnavailable,
    Redlock,
    SingletonTask,
    admin,
    singleton_task,
)
from celery_redlock.admin import startup
from celery_redlock.lock import keyspace
from celery_redlock.lock.outcomes import Acquired, Held, Lock, Unavailable
from celery_redlock.lock.redlock import from_settings
from celery_redlock.settings import RedlockSettings
from celery_redlock.testing import RedisServer

pytestmark = pytest.mark.topology
pytest_plugins = ["celery_apps.fixtures"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """Three masters with a replica each, failing over 1 s after a master stops answering.
    Tests leave it stable (one of them kills a master: later tests pick masters by need)."""
    with RedisCluster(masters=3, replicas_per_master=1, node_timeout=1.0) as started:
        yield started


def key_of(resource: str) -> str:
    """The lock key of ``resource`` under the default prefix."""
    return f"redlock:{{{resource}}}"


def stored(cluster: RedisCluster, key: str) -> str | None:
    """The value of ``key`` on the master that serves its slot now."""
    return value_on(cluster.slot_owner(cluster.key_slot(key)), key)


def resource_with_replica(cluster: RedisCluster, name: str) -> str:
    """A new resource whose slot's master has a replica."""
    while True:
        resource = unique(name)
        if cluster.replicas_of(cluster.slot_owner(cluster.key_slot(key_of(resource)))):
            return resource


def resource_in_slot(cluster: RedisCluster, slot: int, name: str) -> str:
    """A new resource whose lock lives in ``slot``."""
    for number in itertools.count():
        resource = f"{name}-{number}"
        if cluster.key_slot(key_of(resource)) == slot:
            return resource
    raise AssertionError("unreachable")


def resources_per_master(cluster: RedisCluster, name: str, count: int) -> dict[int, list[str]]:
    """``count`` new resources on each master (by port)."""
    wanted: dict[int, list[str]] = {master.port: [] for master in cluster.masters()}
    while any(len(found) < count for found in wanted.values()):
        resource = unique(name)
        found = wanted[cluster.slot_owner(cluster.key_slot(key_of(resource))).port]
        if len(found) < count:
            found.append(resource)
    return wanted


# -- mutual exclusion ----------------------------------------------------------------------------


def test_threads_never_hold_a_cluster_lock_together(cluster: RedisCluster) -> None:
    threads_count, cycles = 8, 8
    by_master = resources_per_master(cluster, "threads", 1)
    resources = [found[0] for found in by_master.values()]  # one lock on each master
    guard = threading.Lock()
    holders: dict[str, int | None] = dict.fromkeys(resources)
    counters = dict.fromkeys(resources, 0)
    tokens: dict[str, list[int]] = {resource: [] for resource in resources}
    violations: list[str] = []
    failures: list[BaseException] = []
    start = threading.Barrier(threads_count)

    with lock_managers([cluster.url], count=1) as (manager,):

        def worker(number: int) -> None:
            try:
                start.wait()
                for cycle in range(cycles):
                    resource = resources[(number + cycle) % len(resources)]
                    lock = manager.acquire(resource, 10.0, blocking=True, timeout=20.0)
                    if lock is None:
                        violations.append(f"thread {number} timed out waiting for {resource}")
                        return
                    with guard:
                        if holders[resource] is not None:
                            violations.append(f"{number} entered {resource} held by another")
                        holders[resource] = number
                        tokens[resource].append(lock.fencing_token)
                    # Unprotected read-modify-write: only the lock keeps it from losing updates.
                    seen = counters[resource]
                    time.sleep(0.0005)
                    counters[resource] = seen + 1
                    with guard:
                        holders[resource] = None
                    if not manager.release(lock):
                        violations.append(f"thread {number} could not release {resource}")
            except BaseException as error:
                failures.append(error)

        workers = [threading.Thread(target=worker, args=(n,)) for n in range(threads_count)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(timeout=60)

    assert not any(thread.is_alive() for thread in workers)
    assert failures == []
    assert violations == []
    assert sum(counters.values()) == threads_count * cycles
    for resource, issued in tokens.items():
        # Each holder's fencing token is larger than every earlier holder's.
        assert issued == sorted(set(issued)), f"fencing tokens of {resource}: {issued}"
        assert stored(cluster, key_of(resource)) is None


_PROCESS_WORKER = r"""
import json, os, sys, time
from celery_redlock import Redlock

url, resource, cycles, log_path, counter_path = json.loads(sys.argv[1])
dlm = Redlock([url], retry_delay=0.01, node_timeout=0.5)
print("ready", flush=True)
sys.stdin.readline()  # wait for "go", so that every process contends from the start
for _ in range(cycles):
    lock = dlm.acquire(resource, ttl=10.0, blocking=True, timeout=20.0)
    if lock is None:
        sys.exit(3)
    started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    with open(counter_path) as handle:
        seen = int(handle.read() or 0)
    time.sleep(0.002)
    with open(counter_path, "w") as handle:
        handle.write(str(seen + 1))
    ended = time.monotonic()
    with open(log_path, "a") as handle:
        handle.write(f"{os.getpid()} {started!r} {ended!r} {lock.fencing_token}\n")
    if not dlm.release(lock):
        sys.exit(4)
"""


def test_processes_never_hold_a_cluster_lock_together(
    cluster: RedisCluster, tmp_path: Path
) -> None:
    processes_count, cycles = 2, 15
    resource = unique("processes")
    log_path, counter_path = tmp_path / "intervals.log", tmp_path / "counter"
    counter_path.write_text("0")
    log_path.write_text("")
    argument = json.dumps([cluster.url, resource, cycles, str(log_path), str(counter_path)])
    errors = run_together(_PROCESS_WORKER, argument, processes_count, timeout=60)
    assert not errors, errors

    intervals = []
    for line in log_path.read_text().splitlines():
        pid, started, ended, token = line.split()
        intervals.append((float(started), float(ended), int(pid), int(token)))
    assert len(intervals) == processes_count * cycles
    assert len({pid for _, _, pid, _ in intervals}) == processes_count
    intervals.sort()
    for previous, following in itertools.pairwise(intervals):
        assert previous[1] <= following[0], f"{following} entered before {previous} left"
        assert previous[3] < following[3], f"fencing token went back: {previous} -> {following}"
    assert int(counter_path.read_text()) == processes_count * cycles


# -- where locks live ------------------------------------------------------------------------------


def test_locks_spread_over_every_master(cluster: RedisCluster) -> None:
    by_master = resources_per_master(cluster, "spread", 3)
    with lock_managers([cluster.url], count=1) as (manager,):
        (member,) = manager.nodes
        assert {endpoint.address for endpoint in member.endpoints()} == {
            ("127.0.0.1", master.port) for master in cluster.masters()
        }
        locks = {
            resource: manager.acquire(resource, 10.0)
            for found in by_master.values()
            for resource in found
        }
        assert all(lock is not None for lock in locks.values())
        for master in cluster.masters():
            with master.client(decode_responses=True) as client:
                here = set(client.scan_iter(match="redlock:{spread-*"))
            expected = {key_of(resource) for resource in by_master[master.port]}
            # Each lock on its slot's master, its fencing counter beside it (one hash slot).
            assert here == expected | {f"{key}:fence" for key in expected}, master.address
            for resource in by_master[master.port]:
                lock = locks[resource]
                assert lock is not None
                assert value_on(master, lock.key) == lock.value
        for lock in locks.values():
            assert lock is not None
            assert manager.release(lock)
        assert all(stored(cluster, lock.key) is None for lock in locks.values() if lock)


def test_two_clusters_and_a_server_are_three_votes(cluster: RedisCluster) -> None:
    # The second cluster's nodes are paused below for about a second: a long node timeout keeps
    # them from failing each other over meanwhile.
    with (
        RedisCluster(masters=3, node_timeout=10.0) as second,
        RedisServer() as single,
        lock_managers([cluster.url, second.url, single.url]) as (holder, rival),
    ):
        assert (len(holder.nodes), holder.quorum) == (3, 2)
        resource = unique("quorum")
        lock = holder.acquire(resource, 10.0)
        assert lock is not None
        assert wait_until(lambda: value_on(single, lock.key) == lock.value)
        assert stored(cluster, lock.key) == stored(second, lock.key) == lock.value
        assert rival.acquire(resource, 10.0) is None

        single.kill()
        # Two clusters are two votes of three: still a majority.
        other = rival.acquire(unique("quorum"), 10.0)
        assert other is not None
        assert rival.release(other)
        assert rival.acquire(resource, 10.0) is None
        assert holder.extend(lock)

        # One cluster, three masters, is one vote: alone it is no majority.
        masters = second.masters()
        app = Celery("topology_votes", broker="memory://", set_as_current=False)
        app.conf.redlock_urls = [cluster.url, second.url, single.url]
        masters[1].pause()
        try:
            # Operators see the second cluster as one node down, naming its silent master.
            listing = admin.lock_listing(app, timeout=0.3)
            statuses = admin.status_report(app, timeout=0.3).nodes
            for master in masters:
                master.pause()
            outcome = rival.attempt(unique("quorum"), 10.0, rounds=1)
        finally:
            for master in masters:
                master.resume()
        assert isinstance(outcome, Unavailable)
        assert outcome.error.answered == 1
        assert {error.node for error in listing.unreachable} == {second.url, single.url}
        (second_down,) = [error for error in listing.unreachable if error.node == second.url]
        assert second_down.error.startswith(f"redis://127.0.0.1:{masters[1].port}: ")
        assert [status.reachable for status in statuses] == [True, False, False]
        assert statuses[1].error is not None
        assert statuses[1].error.startswith(
            f"1 of 3 masters unreachable: redis://127.0.0.1:{masters[1].port}"
        )
        assert [server.reachable for server in statuses[1].servers].count(False) == 1
        assert holder.release(lock)
        # Resumed, the second cluster votes again once its back-off is over.
        assert wait_until(lambda: taken(rival, unique("quorum")), 5.0, 0.1)


def taken(manager: Redlock, resource: str) -> bool:
    """Whether ``manager`` takes (and releases) the lock on ``resource`` in one attempt."""
    outcome = manager.attempt(resource, 10.0, rounds=1)
    if isinstance(outcome, Acquired):
        assert manager.release(outcome.lock)
        return True
    return False


# -- failovers and migrations under a held lock ----------------------------------------------------


def test_a_cluster_failover_keeps_the_held_lock(cluster: RedisCluster) -> None:
    resource = resource_with_replica(cluster, "failover")
    with lock_managers([cluster.url]) as (holder, rival_manager):
        lock = holder.acquire(resource, 15.0)
        assert lock is not None
        slot = cluster.key_slot(lock.key)
        old = cluster.slot_owner(slot)
        with Rival(rival_manager, resource, lock) as rival:
            rival.wait_for_attempts(3)
            new = cluster.failover(old)  # CLUSTER FAILOVER: the replica takes over in step
            assert cluster.slot_owner(slot) is new
            assert value_on(new, lock.key) == lock.value
            assert holder.extend(lock)  # the old master answers MOVED: the node follows
            rival.wait_for_attempts(5)
        assert rival.errors == []
        assert rival.granted == []
        assert holder.release(lock)
        assert value_on(new, lock.key) is None
        # The slot takes new locks on its new master, with larger fencing tokens.
        again = rival_manager.acquire(resource, 10.0)
        assert again is not None
        assert again.fencing_token > lock.fencing_token
        assert value_on(new, again.key) == again.value
        neighbour = rival_manager.acquire(resource_in_slot(cluster, slot, "neighbour"), 10.0)
        assert neighbour is not None
        assert value_on(new, neighbour.key) == neighbour.value
        assert rival_manager.release(again)
        assert rival_manager.release(neighbour)


@pytest.mark.parametrize("mode", [None, "TAKEOVER"])
def test_a_cluster_failover_under_a_kept_lock_never_makes_a_second_holder(
    cluster: RedisCluster, mode: str | None
) -> None:
    # A lock kept alive by the keeper (ttl 1 s) while contenders try every 10 ms: a graceful
    # CLUSTER FAILOVER (the master pauses its writers until the replica caught up, then learns
    # of the switch at once) and a TAKEOVER (the replica takes the slots without the master's
    # consent: the master keeps serving them until it hears of it) alike.
    resource = resource_with_replica(cluster, "kept failover")
    slot = cluster.key_slot(key_of(resource))
    with HoldThroughFailover([cluster.url], 1.0, resource=resource) as hold:
        hold.watch(0.5)
        new = cluster.failover(cluster.slot_owner(slot), mode=mode)
        hold.watch(2.0)
        assert hold.overlaps == []
        if hold.lost_at is None:
            assert value_on(new, hold.lock.key) == hold.lock.value
    cluster.wait_until_stable()


def migrating_lock(
    cluster: RedisCluster, holder: Redlock, resource: str
) -> tuple[Lock, RedisServer, RedisServer, SlotMigration]:
    """``holder``'s new lock on ``resource``, its slot's master, another master, and the
    migration of the slot from the one to the other, begun (no key moved yet)."""
    lock = holder.acquire(resource, 15.0)
    assert lock is not None
    slot = cluster.key_slot(lock.key)
    source = cluster.slot_owner(slot)
    destination = next(master for master in cluster.masters() if master is not source)
    return lock, source, destination, cluster.begin_slot_migration(slot, destination)


def test_a_slot_migration_keeps_the_held_lock(cluster: RedisCluster) -> None:
    resource = unique("migrating")
    with lock_managers([cluster.url]) as (holder, rival):
        lock, _, destination, migration = migrating_lock(cluster, holder, resource)
        finished = False
        try:
            assert holder.extend(lock)  # migrating, but the source still has the keys
            # An acquisition also names the lock's reservation key, which does not exist: in a
            # slot being migrated Redis answers TRYAGAIN to a script on keys some of which are
            # missing, so no lock of the slot can be taken until the migration ends.
            outcome = rival.attempt(resource, 10.0, rounds=1)
            assert isinstance(outcome, Unavailable)
            assert "TRYAGAIN" in str(outcome.error)

            # One of the lock's keys moved: the source answers TRYAGAIN to a script on both
            # (Redis cannot run it across two servers); nobody gets the lock meanwhile.
            assert migration.move_keys(1) == 1
            assert not isinstance(rival.attempt(resource, 10.0, rounds=1), Acquired)

            # Every key moved: the source answers ASK, the destination serves after ASKING.
            migration.move_keys()
            assert migration.remaining_keys() == 0
            assert value_on_asking(destination, lock.key) == lock.value
            assert holder.extend(lock)
            assert not isinstance(rival.attempt(resource, 10.0, rounds=1), Acquired)

            migration.finish()  # the slot is the destination's: the source answers MOVED
            finished = True
            assert holder.extend(lock)
            assert isinstance(rival.attempt(resource, 10.0, rounds=1), Held)
        finally:
            if not finished:
                migration.move_keys()
                migration.finish()
        assert cluster.slot_owner(migration.slot) is destination
        assert value_on(destination, lock.key) == lock.value
        assert holder.release(lock)
        assert value_on(destination, lock.key) is None
        again = rival.acquire(resource, 10.0)
        assert again is not None
        assert value_on(destination, again.key) == again.value
        assert rival.release(again)


def test_a_killed_master_is_replaced_under_a_held_lock(cluster: RedisCluster) -> None:
    resource = resource_with_replica(cluster, "killed")
    with lock_managers([cluster.url]) as (holder, rival_manager):
        lock = holder.acquire(resource, 20.0)
        assert lock is not None
        slot = cluster.key_slot(lock.key)
        old = cluster.slot_owner(slot)
        with old.client() as client:  # the replica has the grant (see the WAIT tests below)
            assert client.wait(1, 5000) == 1
        with Rival(rival_manager, resource, lock) as rival:
            replica = cluster.kill_master(old, wait=False)
            # Unanswered while no master serves the slot, then the node finds the new one.
            assert wait_until(lambda: holder.extend(lock), timeout=15.0, interval=0.1)
            assert cluster.slot_owner(slot) is replica
            rival.wait_for_attempts(5)
        cluster.wait_until_stable()
        assert rival.errors == []
        assert rival.granted == []
        # The rival's member may still route the slot to the dead master (backed off) until its
        # next look at the slot map, a quarter of a second away: unavailable, then held.
        assert wait_until(
            lambda: isinstance(rival_manager.attempt(resource, 10.0, rounds=1), Held),
            timeout=5.0,
            interval=0.1,
        )
        assert holder.release(lock)
        assert value_on(replica, lock.key) is None
        again = rival_manager.acquire(resource, 10.0)
        assert again is not None
        assert again.fencing_token > lock.fencing_token
        assert rival_manager.release(again)


def test_wait_replicas_counts_a_grant_only_once_a_replica_has_it(cluster: RedisCluster) -> None:
    resource = resource_with_replica(cluster, "acknowledged")
    owner = cluster.slot_owner(cluster.key_slot(key_of(resource)))
    replica = cluster.replicas_of(owner)[0]
    with (
        lock_managers([cluster.url], count=1, wait_replicas=1) as (waiting,),
        lock_managers([cluster.url], count=1) as (eager,),
    ):
        lock = waiting.acquire(resource, 10.0)
        assert lock is not None
        assert value_on_replica(replica, lock.key) == lock.value  # WAIT said it has it
        assert waiting.extend(lock)
        assert waiting.release(lock)

        replica.pause()  # no acknowledgement can come
        try:
            refused = waiting.attempt(resource, 10.0, rounds=1)
            # The contrast, without waiting for replicas: granted, though no replica has it
            # (a failover now would hand the lock out again).
            granted = eager.attempt(unique("eager"), 10.0, rounds=1)
        finally:
            replica.resume()
        assert isinstance(refused, Unavailable)
        assert isinstance(granted, Acquired)
        assert eager.release(granted.lock)
    cluster.wait_until_stable()


def value_on_replica(replica: RedisServer, key: str) -> str | None:
    """The value of ``key`` as a cluster replica has it (after READONLY)."""
    with replica.client(decode_responses=True) as client:
        pipeline = client.pipeline(transaction=False)
        pipeline.execute_command("READONLY")
        pipeline.get(key)
        value: str | None = pipeline.execute()[1]
        return value


# -- a Celery worker -----------------------------------------------------------------------------


def test_a_celery_worker_runs_singleton_tasks_on_a_cluster_lock_node(
    cluster: RedisCluster, broker: RedisServer, run_log: RunLog, gate: threading.Event
) -> None:
    app = make_app(broker, [cluster.url])

    @singleton_task(app=app, shared=False, bind=True, name="topology.cluster", lock_args=("item",))
    def job(self: SingletonTask, item: int, call: int) -> int:
        with run_log.run(self.lock.key, task_id=self.request.id):
            assert gate.wait(10)
            return call

    with embedded_worker(app, concurrency=4):
        first = [job.delay(item, 0) for item in (1, 2, 3)]
        started = run_log.wait_started(3)
        keys = {entry["key"] for entry in started}
        assert len(keys) == 3
        assert all(stored(cluster, key) is not None for key in keys)
        duplicates = [job.delay(item, call) for call in (1, 2) for item in (1, 2, 3)]
        for result in duplicates:
            with pytest.raises(DuplicateSkipped):
                result.get(timeout=15)
        gate.set()
        assert [result.get(timeout=15) for result in first] == [0, 0, 0]
        assert wait_until(lambda: all(stored(cluster, key) is None for key in keys), 5.0)
        # Once free, the same call runs again.
        assert job.delay(1, 9).get(timeout=15) == 9
    assert len(run_log.runs()) == 4


# -- operators: every master read, one node counted --------------------------------------------


def operators_app(cluster: RedisCluster, prefix: str) -> Celery:
    """An app whose one lock node is ``cluster``, its keys under ``prefix``."""
    app = Celery("topology_admin", broker="memory://", set_as_current=False)
    app.conf.redlock_urls = [cluster.url]
    app.conf.redlock_key_prefix = prefix
    return app


def test_operators_list_status_and_release_over_every_master(cluster: RedisCluster) -> None:
    prefix = f"{unique('admin')}:"
    app = operators_app(cluster, prefix)
    by_master = resources_per_master(cluster, "listed", 2)
    with lock_managers([cluster.url], count=1, key_prefix=prefix) as (manager,):
        locks: dict[str, Any] = {}
        for found in by_master.values():
            for resource in found:
                locks[resource] = manager.acquire(resource, 30.0, owner="topology operator")
                assert locks[resource] is not None

        listing = admin.lock_listing(app, timeout=2.0)
        assert (listing.nodes_total, listing.quorum, listing.unreachable) == (1, 1, ())
        assert {record.resource for record in listing.locks} == set(locks)
        assert all(record.nodes_holding == 1 for record in listing.locks)
        assert {record.resource for record in admin.held_locks(app, timeout=2.0)} == set(locks)

        report = admin.status_report(app, timeout=2.0)
        (node,) = report.nodes
        assert node.reachable and report.has_quorum
        assert node.node == manager.nodes[0].name
        assert {server.node for server in node.servers} == {
            f"redis://127.0.0.1:{master.port}" for master in cluster.masters()
        }
        assert all(server.role == "master" for server in node.servers)
        assert node.summary().startswith("cluster of 3 masters")
        assert node.to_json()["servers"][0]["role"] == "master"

        # Released where the key lives: on a master other than the node's first.
        first = manager.nodes[0].endpoints()[0].address
        master = next(m for m in cluster.masters() if ("127.0.0.1", m.port) != first)
        resource = by_master[master.port][0]
        lock = locks.pop(resource)
        result = admin.force_release(app, resource, timeout=2.0)
        assert result.deleted_on == (node.node,)
        assert result.still_present_on == ()
        assert value_on(master, lock.key) is None
        assert {r.resource for r in admin.held_locks(app, timeout=2.0)} == set(locks)

        cli_list = invoke(app, "list", "--json", "--timeout", "2")
        assert cli_list.exit_code == 0, cli_list.output
        assert {entry["resource"] for entry in as_json(cli_list)["locks"]} == set(locks)
        cli_status = invoke(app, "status", "--timeout", "2")
        assert cli_status.exit_code == 0, cli_status.output
        assert "cluster of 3 masters" in cli_status.output
        for held in locks.values():
            assert manager.release(held)


def test_operators_read_and_release_a_lock_whose_slot_is_moving(cluster: RedisCluster) -> None:
    prefix = f"{unique('moving')}:"
    app = operators_app(cluster, prefix)
    with lock_managers([cluster.url], count=1, key_prefix=prefix) as (manager,):
        lock = manager.acquire("report", 30.0)
        assert lock is not None
        slot = cluster.key_slot(lock.key)
        source = cluster.slot_owner(slot)
        destination = next(master for master in cluster.masters() if master is not source)
        migration = cluster.begin_slot_migration(slot, destination)
        try:
            migration.move_keys()  # the source answers ASK for the lock from now on
            (record,) = admin.held_locks(app, timeout=2.0)
            assert record.resource == "report"
            result = admin.force_release(app, "report", timeout=2.0)
            assert result.deleted_on == (manager.nodes[0].name,)
            assert value_on_asking(destination, lock.key) is None
        finally:
            migration.move_keys()
            migration.finish()
        assert admin.held_locks(app, timeout=2.0) == []


def test_the_start_up_check_follows_a_slot_that_is_moving(cluster: RedisCluster) -> None:
    """The worker's start-up report reads its check key on every node; in a slot being
    migrated the key's master answers ASK, and the check follows it like any round does,
    instead of reporting the cluster as not answering."""
    prefix = f"{unique('start-check')}:"
    app = operators_app(cluster, prefix)
    slot = cluster.key_slot(keyspace.lock_key(prefix, startup.CHECK_RESOURCE))
    source = cluster.slot_owner(slot)
    destination = next(master for master in cluster.masters() if master is not source)
    migration = cluster.begin_slot_migration(slot, destination)
    try:
        (check,) = startup.report(app)
    finally:
        migration.finish()
    assert check is not None, "the cluster was reported as not answering"
    assert check.denied is None
    assert check.status.reachable


def test_a_cluster_that_cannot_be_reached_is_one_node_down() -> None:
    app = Celery("topology_gone", broker="memory://", set_as_current=False)
    app.conf.redlock_urls = ["redis+cluster://127.0.0.1:1,127.0.0.1:2"]
    listing = admin.lock_listing(app, timeout=0.5)
    (unreachable,) = listing.unreachable
    assert unreachable.node == "redis+cluster://127.0.0.1:1,127.0.0.1:2"
    assert "slot map" in unreachable.error
    with pytest.raises(QuorumUnavailable):
        admin.held_locks(app, timeout=0.5)
    (status,) = admin.status_report(app, timeout=0.5).nodes
    assert not status.reachable


def value_on_asking(server: RedisServer, key: str) -> str | None:
    """The value of ``key`` on a master importing its slot (after ASKING); on the master it is
    leaving, None where the key has gone (ASK)."""
    with server.client(decode_responses=True) as client:
        pipeline = client.pipeline(transaction=False)
        pipeline.execute_command("ASKING")
        pipeline.get(key)
        try:
            value: str | None = pipeline.execute()[1]
        except redis.exceptions.AskError:
            return None
        return value


def test_redlock_over_a_cluster_url_reports_the_cluster_as_one_node(
    cluster: RedisCluster,
) -> None:
    manager = Redlock([cluster.url], node_timeout=0.5)
    try:
        assert len(manager.nodes) == 1
        assert manager.quorum == 1
        assert [node.name for node in manager.nodes] == [cluster.url]
    finally:
        manager.close()


def test_refused_grants_do_not_outlive_their_attempts(cluster: RedisCluster) -> None:
    """``wait_replicas=1`` at the default node timeout with the replica paused: every grant is
    refused (no acknowledgement), and none stays on the master: each attempt's clean-up reaches
    it, although its late WAIT reply got it backed off."""
    first = resource_with_replica(cluster, "unacknowledged")
    owner = cluster.slot_owner(cluster.key_slot(key_of(first)))
    resources = [first]
    while len(resources) < 8:
        resource = unique("unacknowledged")
        if cluster.slot_owner(cluster.key_slot(key_of(resource))) is owner:
            resources.append(resource)
    waiting = from_settings(RedlockSettings(urls=(cluster.url,), wait_replicas=1))
    replica = cluster.replicas_of(owner)[0]
    # Connections open, scripts loaded, slot map read. (A grant may miss its replica's
    # acknowledgement within half a 50 ms node timeout on a busy host: that is no failure here.)
    warm = waiting.attempt(unique("warm-up"), 5.0, rounds=1)
    if isinstance(warm, Acquired):
        waiting.release(warm.lock)
    outcomes: list[object] = []
    replica.pause()
    try:
        threads = [
            threading.Thread(target=lambda r=r: outcomes.append(waiting.attempt(r, 20.0)))
            for r in resources
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        left = lambda: [r for r in resources if stored(cluster, key_of(r)) is not None]  # noqa: E731
        gone = wait_until(lambda: not left(), timeout=1.5)
        still_there = left()
    finally:
        replica.resume()
        waiting.close()
    assert len(outcomes) == 8 and all(isinstance(o, Unavailable) for o in outcomes)
    reasons = [str(o.error) for o in outcomes if isinstance(o, Unavailable)]
    # Each names why the member gave no grant: its replicas did not acknowledge in time, or
    # (queued behind another caller's WAIT on the shared connection) no reply in time.
    unnamed = [r for r in reasons if "acknowledge" not in r and "no reply within" not in r]
    assert not unnamed, unnamed
    assert gone, f"refused grants still on the master: {still_there}"
    cluster.wait_until_stable()


@pytest.mark.parametrize(
    ("moved", "confirm"),
    [("lock key", True), ("fencing counter", True), ("lock key", False)],
    ids=["lock-key-moved", "fencing-counter-moved", "lock-key-moved-unconfirmed-release"],
)
def test_a_holder_extends_and_releases_in_a_half_migrated_slot(
    cluster: RedisCluster, moved: str, confirm: bool
) -> None:
    """One of the lock's two keys has moved to the new master, the other not yet (a resharding
    moves keys in batches): no script can run on both, the servers answer TRYAGAIN. The holder
    still extends its lock and releases it: the scripts run on the lock key alone."""
    resource = unique("half-migrated")
    with lock_managers([cluster.url]) as (holder, rival):
        lock, source, destination, migration = migrating_lock(cluster, holder, resource)
        try:
            key = lock.key if moved == "lock key" else keyspace.fence_key(lock.key)
            with source.client(socket_timeout=5) as client:
                client.execute_command(
                    "MIGRATE", "127.0.0.1", destination.port, "", 0, 5000, "KEYS", key
                )
            for _ in range(3):
                assert holder.extend(lock), "the holder could not extend in a half-migrated slot"
            released = holder.release(lock, confirm=confirm)
            assert released is confirm

            def gone() -> bool:
                # An unconfirmed release's replies are read by the holder's next round (a
                # worker's next task): its TRYAGAIN is followed then.
                holder.attempt(unique("next-task"), 1.0, rounds=1)
                return (
                    value_on_asking(source, lock.key) is None
                    and value_on_asking(destination, lock.key) is None
                )

            assert wait_until(gone, timeout=1.0), "the released lock is still there"
        finally:
            migration.move_keys()
            migration.finish()
        again = rival.acquire(resource, 10.0)
        assert again is not None
        assert rival.release(again)
