"""`celery_redlock.admin` and `celery redlock` with lock nodes that misbehave or deny commands.

Real redis-server nodes mixed with fake RESP servers (tests/fake_resp.py) that answer every
command with ``:1``, ``+OK``, ``+COMPLETED``, an error, a wrong-shaped array, bytes that are not
RESP, or by closing the connection. A bad node is an error record, never an exception; the
command line prints no traceback and exits 1 exactly when a majority is missing. Then real nodes
with an ACL user denied every ``@dangerous`` command (INFO, CONFIG, KEYS, DEBUG, ...) and PING:
every operators' command still works, and each denial names the command and the grant.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from cli_app import create_app
from cli_support import FAST, as_json, invoke, run_celery
from fake_resp import FakeRedisServer, Reply, always

from celery_redlock import QuorumUnavailable, admin
from celery_redlock.lock.owner import Owner, Tokens, lock_value
from celery_redlock.testing import RedisNodes, RedisServer

TOKENS = Tokens()  # fresh lock tokens, as the package draws them
HOST = socket.gethostname()
TIMEOUT = 0.3
TASK = "cli_app.sync_account"


def closes_the_connection(command: list[bytes]) -> bytes:
    """Accepts the handshake, then hangs up on the first real command."""
    if command and command[0] in (b"AUTH", b"SELECT", b"CLIENT", b"HELLO"):
        return b"+OK\r\n"
    raise ConnectionResetError("the fake node hangs up")


BAD_NODES: dict[str, tuple[Reply, str]] = {
    # what the node does: (its replies, what its error record says)
    "integer": (always(b":1\r\n"), "bad reply to PING: 1, not PONG"),
    "ok": (always(b"+OK\r\n"), "bad reply to PING: b'OK', not PONG"),
    "completed": (always(b"+COMPLETED\r\n"), "bad reply to PING: b'COMPLETED', not PONG"),
    "error": (always(b"-ERR nothing works here\r\n"), "ResponseError: nothing works here"),
    "wrong shape": (always(b"*2\r\n:1\r\n$1\r\nx\r\n"), "bad reply to PING: [1, b'x'], not PONG"),
    "not RESP": (always(b"hello, I am no Redis\r\n"), "Protocol"),
    "hangs up": (closes_the_connection, "Connection"),
}
LISTING_ERRORS = {  # where the same node fails when asked for the locks (SCAN)
    "integer": "bad reply to SCAN: 1, not a cursor and a list of keys",
    "ok": "bad reply to SCAN: b'OK', not a cursor and a list of keys",
    "wrong shape": "bad reply to SCAN: [1, b'x'], not a cursor and a list of keys",
}


def dead_pid() -> int:
    """The process id of a process that has exited (and was reaped)."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def put_lock(servers: list[RedisServer], key: str, owner: Owner, **client_options: Any) -> str:
    """Store a lock value for ``owner`` at ``key`` on ``servers`` (as an acquisition would);
    returns the stored value."""
    value = lock_value(TOKENS.new(), owner.to_text())
    for server in servers:
        with server.client(**client_options) as client:
            client.set(key, value, px=30_000)
    return value


def read_on(servers: list[RedisServer], key: str, **client_options: Any) -> list[Any]:
    """``key``'s value on each server."""
    values = []
    for server in servers:
        with server.client(decode_responses=True, **client_options) as client:
            values.append(client.get(key))
    return values


@pytest.fixture(params=sorted(BAD_NODES))
def bad_node(request: pytest.FixtureRequest) -> Iterator[tuple[str, FakeRedisServer]]:
    """One misbehaving fake node, for each way of misbehaving."""
    reply, _ = BAD_NODES[request.param]
    with FakeRedisServer(reply) as server:
        yield request.param, server


@dataclass(frozen=True)
class MixedNodes:
    """Two real nodes with a bad one between them, and an app using the three."""

    kind: str
    fake: FakeRedisServer
    real: list[RedisServer]
    app: Any


@pytest.fixture
def mixed(redis_nodes: Any, bad_node: tuple[str, FakeRedisServer]) -> MixedNodes:
    """Real, bad, real: a majority of good nodes."""
    kind, fake = bad_node
    real = list(redis_nodes(2))
    return MixedNodes(kind, fake, real, create_app([real[0].url, fake.url, real[1].url]))


def test_a_bad_node_is_an_error_record_and_the_rest_carries_on(mixed: MixedNodes) -> None:
    kind, fake, real, app = mixed.kind, mixed.fake, mixed.real, mixed.app
    key = admin.lock_key(app, TASK, 7)
    owner = Owner(id="t-7", task=TASK, host=HOST, pid=os.getpid(), since=1.0)
    value = put_lock(real, key, owner)

    report = admin.status_report(app, timeout=TIMEOUT)
    statuses = admin.node_status(app, timeout=TIMEOUT)
    listing = admin.lock_listing(app, timeout=TIMEOUT)
    held = admin.held_locks(app, timeout=TIMEOUT)
    found = admin.holder(app, TASK, 7)

    assert [status.reachable for status in report.nodes] == [True, False, True]
    assert [status.node for status in statuses] == [real[0].url, fake.url, real[1].url]
    assert BAD_NODES[kind][1] in (report.nodes[1].error or ""), report.nodes[1].error
    assert (report.reachable, report.has_quorum) == (2, True)
    assert [record.key for record in listing.locks] == [key] and listing.has_quorum
    assert [node.node for node in listing.unreachable] == [fake.url]
    assert LISTING_ERRORS.get(kind, "") in listing.unreachable[0].error
    assert [(record.key, record.nodes_holding, record.nodes_total) for record in held] == [
        (key, 2, 3)
    ]
    assert found is not None and found.task_id == "t-7"

    dry = admin.reap(app, dry_run=True, grace=0, timeout=TIMEOUT)
    assert [(result.lock.key, result.action) for result in dry] == [(key, admin.KEPT)]
    released = admin.force_release(app, key, timeout=TIMEOUT)
    assert released.deleted_on == (real[0].url, real[1].url)
    assert [node.node for node in released.unreachable] == [fake.url]
    assert read_on(real, key) == [None, None]
    assert value not in str(released.to_json())

    gone = Owner(id="t-8", task=TASK, host=HOST, pid=dead_pid(), since=1.0)
    dead_key = admin.lock_key(app, TASK, 8)
    put_lock(real, dead_key, gone)
    (reaped,) = admin.reap(app, grace=0, timeout=TIMEOUT)
    assert (reaped.lock.key, reaped.action, reaped.proof) == (
        dead_key,
        admin.FREED,
        admin.PROOF_PROCESS_GONE,
    )
    assert read_on(real, dead_key) == [None, None]


def test_the_command_line_names_a_bad_node_and_prints_no_traceback(mixed: MixedNodes) -> None:
    kind, fake, real, app = mixed.kind, mixed.fake, mixed.real, mixed.app
    key = admin.lock_key(app, TASK, 9)
    put_lock(real, key, Owner(id="t-9", task=TASK, host=HOST, pid=os.getpid()))

    runs = {
        "status": invoke(app, "status", *FAST),
        "list": invoke(app, "list", "--check-workers", *FAST),
        "key": invoke(app, "key", TASK, "9", *FAST),
        "reap": invoke(app, "reap", "--dry-run", "--grace", "0", *FAST),
        "release": invoke(app, "release", key, "--force", "--yes", *FAST),
    }

    for name, result in runs.items():
        assert result.exit_code == 0, (name, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), name
        assert "Traceback" not in result.output, name
    assert f"DOWN {fake.url}  unreachable: " in runs["status"].stdout
    assert BAD_NODES[kind][1] in runs["status"].stdout
    assert "2 of 3 reachable, a majority is 2: OK" in runs["status"].stdout
    assert f"unreachable: {fake.url}" in runs["list"].stdout
    assert "1 lock(s) held (2 of 3 lock nodes answered" in runs["list"].stdout
    assert "state     held by task cli_app.sync_account[t-9]" in runs["key"].stdout
    assert f"Released {key}: deleted on 2 of 3 nodes." in runs["release"].stdout
    assert read_on(real, key) == [None, None]


def test_without_a_majority_of_good_nodes_nothing_raises_but_quorum_errors(
    one_node: RedisNodes,
) -> None:
    with (
        FakeRedisServer(always(b":1\r\n")) as integer,
        FakeRedisServer(always(b"*2\r\n:1\r\n:2\r\n")) as shapeless,
    ):
        urls = [integer.url, one_node.urls[0], shapeless.url]
        app = create_app(urls)
        key = admin.lock_key(app, TASK, 1)
        put_lock(list(one_node), key, Owner(id="t-1", task=TASK, host=HOST, pid=dead_pid()))

        report = admin.status_report(app, timeout=TIMEOUT)
        listing = admin.lock_listing(app, timeout=TIMEOUT)
        released = admin.force_release(app, key, timeout=TIMEOUT)

        assert [status.reachable for status in report.nodes] == [False, True, False]
        assert not report.has_quorum and not listing.has_quorum and not released.has_quorum
        assert [node.node for node in listing.unreachable] == [integer.url, shapeless.url]
        for call in (
            lambda: admin.held_locks(app, timeout=TIMEOUT),
            lambda: admin.holder(app, TASK, 1),
            lambda: admin.reap(app, grace=0, timeout=TIMEOUT),
        ):
            with pytest.raises(QuorumUnavailable):
                call()

        for arguments in (
            ["status"],
            ["list"],
            ["key", TASK, "1"],
            ["release", key, "--force", "--yes"],
            ["reap", "--grace", "0"],
        ):
            result = invoke(app, *arguments, *FAST)
            assert result.exit_code == 1, (arguments, result.output)
            assert isinstance(result.exception, SystemExit), (arguments, result.exception)
            assert "Traceback" not in result.output
            reason = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
            assert len(reason) == 1, (arguments, result.stderr)
            assert "majority" in reason[0] or "quorum" in reason[0], reason

        from_celery = run_celery(urls, "status", "--timeout", "0.3")
        assert from_celery.returncode == 1
        assert "Traceback" not in from_celery.stderr + from_celery.stdout
        assert "only 1 of 3 lock nodes answered; a majority (2) is needed" in from_celery.stderr
        assert "bad reply to PING: 1, not PONG" in from_celery.stdout


def answers_reads_but_not_the_release(value: bytes, release_reply: bytes) -> Reply:
    """A node that holds ``value`` under every key it is asked about, and answers the forced
    release with ``release_reply``."""

    def reply(command: list[bytes]) -> bytes:
        name = command[0] if command else b""
        if name in (b"AUTH", b"SELECT", b"CLIENT", b"HELLO"):
            return b"+OK\r\n"
        if name == b"GET":
            return b"$%d\r\n%s\r\n" % (len(value), value)
        if name == b"PTTL":
            return b":30000\r\n"
        if name == b"EVAL":
            return release_reply
        return b"-ERR unknown command\r\n"

    return reply


@pytest.mark.parametrize(
    ("release_reply", "shown"),
    [(b"+COMPLETED\r\n", "b'COMPLETED'"), (b":5\r\n", "5"), (b"*0\r\n", "[]")],
)
def test_a_forced_release_reply_that_is_no_answer_is_an_error(
    redis_nodes: Any, release_reply: bytes, shown: str
) -> None:
    real = list(redis_nodes(2))
    key = admin.lock_key(create_app([real[0].url]), TASK, 4)
    value = put_lock(real, key, Owner(id="t-4", task=TASK, host=HOST, pid=os.getpid()))
    fake_reply = answers_reads_but_not_the_release(value.encode(), release_reply)
    with FakeRedisServer(fake_reply) as fake:
        app = create_app([real[0].url, real[1].url, fake.url])

        result = admin.force_release(app, key, timeout=TIMEOUT)

    assert result.lock is not None and result.lock.nodes_holding == 3
    assert result.deleted_on == (real[0].url, real[1].url) and not result.refused
    assert [(node.node, node.error) for node in result.unreachable] == [
        (
            fake.url,
            f"bad reply to the forced release: {shown}, not 1, 0 or why the key is not a lock",
        )
    ]
    assert result.has_quorum and read_on(real, key) == [None, None]


# -- ACL: a user denied every @dangerous command, and PING -------------------------------------

OPERATOR = ("operator", "s3cret")
ROOT = ("root", "r00t")


def acl_nodes(nodes: RedisNodes, *rules: str) -> list[str]:
    """Give every node a ``root`` user (for the test's own checks), an ``operator`` user with
    ``rules``, and turn the default user off; returns the operator's URLs."""
    for server in nodes:
        with server.client() as client:
            client.execute_command(
                "ACL", "SETUSER", ROOT[0], "on", f">{ROOT[1]}", "~*", "&*", "+@all"
            )
            client.execute_command("ACL", "SETUSER", OPERATOR[0], "reset", "on", f">{OPERATOR[1]}")
            client.execute_command("ACL", "SETUSER", OPERATOR[0], *rules)
            client.execute_command("ACL", "SETUSER", "default", "off")
    user, password = OPERATOR
    return [f"redis://{user}:{password}@{server.address}/0" for server in nodes]


def as_root() -> dict[str, str]:
    """Client options for the root user."""
    return {"username": ROOT[0], "password": ROOT[1]}


def denied_commands(nodes: RedisNodes) -> set[str]:
    """What the nodes' ACL logs say was denied: command names, or ``reason:object``."""
    denied = set()
    for server in nodes:
        with server.client(**as_root()) as client:
            for entry in client.acl_log():
                reason, denied_object = entry["reason"], entry["object"]
                denied.add(denied_object if reason == "command" else f"{reason}:{denied_object}")
    return denied


# No @dangerous command (INFO, CONFIG, KEYS, DEBUG, ...), no SCRIPT FLUSH, no PING; PUBLISH
# wakes the waiters of a released lock.
LEAST = (
    "~redlock:*",
    "&redlock:*",
    "+@read",
    "+@write",
    "+@scripting",
    "+publish",
    "-@dangerous",
    "-script|flush",
)


def test_a_user_without_dangerous_commands_or_ping_runs_every_command(
    three_nodes: RedisNodes,
) -> None:
    app = create_app(acl_nodes(three_nodes, *LEAST))
    live_key, dead_key = admin.lock_key(app, TASK, 1), admin.lock_key(app, TASK, 2)
    servers = list(three_nodes)
    live = put_lock(servers, live_key, Owner.here(TASK, "live"), **as_root())
    put_lock(servers, dead_key, Owner(id="dead", task=TASK, host=HOST, pid=dead_pid()), **as_root())

    report = admin.status_report(app, timeout=TIMEOUT)

    assert [status.reachable for status in report.nodes] == [True, True, True], report
    unread = report.nodes[0].could_not_read
    assert (
        "whether it answers PING: the node's user may not run 'ping'; grant it with "
        "ACL SETUSER operator +ping"
    ) in unread
    assert (
        "role, persistence and eviction (INFO): the node's user may not run 'info'; grant it "
        "with ACL SETUSER operator +info"
    ) in unread
    assert report.nodes[0].redis_version is None and report.nodes[0].role is None
    status = invoke(app, "status", *FAST)
    assert status.exit_code == 0, status.output
    assert "3 of 3 reachable, a majority is 2: OK" in status.stdout
    assert "could not read role, persistence and eviction (INFO)" in status.stdout
    assert "s3cret" not in status.output

    assert [record.key for record in admin.held_locks(app, timeout=TIMEOUT)] == sorted(
        [live_key, dead_key]
    )
    listed = invoke(app, "list", "--json", *FAST)
    assert listed.exit_code == 0 and len(as_json(listed)["locks"]) == 2
    key = invoke(app, "key", TASK, "1", *FAST)
    assert key.exit_code == 0 and "state     held by task" in key.stdout
    reaped = {result.lock.key: result.action for result in admin.reap(app, grace=0)}
    assert reaped == {live_key: admin.KEPT, dead_key: admin.FREED}
    released = invoke(app, "release", live_key, "--force", "--yes", *FAST)
    assert released.exit_code == 0 and "deleted on 3 of 3 nodes" in released.stdout
    assert read_on(servers, live_key, **as_root()) == [None] * 3
    assert read_on(servers, dead_key, **as_root()) == [None] * 3
    assert live not in status.output + listed.output + key.output + released.output

    # Nothing but the optional PING and INFO was asked for and denied; nothing used the
    # default user (it is off).
    assert denied_commands(three_nodes) == {"ping", "info"}


def test_a_denied_scan_is_named_with_its_grant(three_nodes: RedisNodes) -> None:
    app = create_app(acl_nodes(three_nodes, *LEAST, "+ping", "+info", "-scan"))

    listing = admin.lock_listing(app, timeout=TIMEOUT)
    result = invoke(app, "list", *FAST)

    assert [node.error for node in listing.unreachable] == [
        "the node's user may not run 'scan'; grant it with ACL SETUSER operator +scan"
    ] * 3
    assert result.exit_code == 1
    assert "grant it with ACL SETUSER operator +scan" in result.stdout
    assert "Traceback" not in result.output
    assert admin.status_report(app, timeout=TIMEOUT).has_quorum  # the nodes themselves are up
