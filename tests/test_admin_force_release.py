"""Only locks are force-released: `admin.force_release` and ``celery redlock release --force``
against real redis-server nodes holding, beside a lock, the keys that are not locks — completion
records, the beat leader's schedule records, a fencing counter, an application's value under a
lock key's name, a key of another type. Each is refused by name and left as it was; the lock
goes. The check runs atomically in Lua on each node (`scripts.FORCE_RELEASE`), so a node whose
copy is not a lock keeps it even when the others hold a lock under that key.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from cli_app import create_app
from cli_support import FAST, invoke
from redlock_support import values_on

from celery_redlock import Redlock, admin
from celery_redlock.lock import keyspace, scripts
from celery_redlock.lock.owner import Owner, Tokens, lock_value, run_prefix
from celery_redlock.lock.redlock import release_if_owner
from celery_redlock.settings import RedlockSettings
from celery_redlock.testing import RedisNodes

TOKENS = Tokens()  # fresh lock tokens, as the package draws them
PREFIX = RedlockSettings.key_prefix
TASK = "cli_app.sync_account"
NOT_A_LOCK_VALUE = "its value is not a lock token"


def everything_on(nodes: RedisNodes) -> list[dict[str, Any]]:
    """Every key on each node with its type and value, to prove nothing else changed."""
    dumps = []
    for server in nodes:
        with server.client(decode_responses=True) as client:
            dump: dict[str, Any] = {}
            for key in client.scan_iter():
                kind = client.type(key)
                dump[key] = (kind, client.hgetall(key) if kind == "hash" else client.get(key))
            dumps.append(dump)
    return dumps


def set_on(nodes: RedisNodes, key: str, value: str, indexes: tuple[int, ...] = (0, 1, 2)) -> None:
    """SET ``key`` to ``value`` on the nodes at ``indexes``."""
    for index in indexes:
        with nodes[index].client() as client:
            client.set(key, value, px=60_000)


@pytest.fixture
def keys_beside_a_lock(three_nodes: RedisNodes) -> dict[str, str]:
    """A real lock with its fencing counter and completion records, the beat leader's lease
    with its schedule records, an application value and a hash under lock keys' names."""
    app = create_app(three_nodes.urls)
    redlock = Redlock(three_nodes.urls, node_timeout=1.0)
    resource = admin.call_key(app, TASK, [1]).resource
    lock = redlock.acquire(resource, 30, owner=Owner.here(TASK, "run-1").to_text())
    lease = redlock.acquire("celery-beat-leader", 30, owner=Owner.here(None, None).to_text())
    assert lock is not None and lease is not None
    redlock.close()
    keys = {
        "lock": lock.key,
        "fence": keyspace.fence_key(lock.key),
        "records": keyspace.records_key(lock.key, "run-0"),
        "schedule": keyspace.schedule_key(lease.key),
        "application": keyspace.lock_key(PREFIX, "app-data"),
        "hash": keyspace.lock_key(PREFIX, "a-hash"),
    }
    for server in three_nodes:
        with server.client() as client:
            client.set(lock.key, lock.value, px=30_000)  # on every node, however slow
            client.set(keys["fence"], lock.fencing_token, px=60_000)
            client.hset(keys["records"], "message", "0:0")
            client.set(keys["schedule"], '{"tick": "1"}')
            client.set(keys["application"], "important")
            client.hset(keys["hash"], "field", "value")
    return keys


def test_only_the_lock_is_deleted(
    three_nodes: RedisNodes, keys_beside_a_lock: dict[str, str]
) -> None:
    app = create_app(three_nodes.urls)
    keys = keys_beside_a_lock
    before = everything_on(three_nodes)

    for name, what in (
        ("fence", "it is a fencing counter"),
        ("records", "it holds completion records"),
        ("schedule", "it holds the beat leader's schedule records"),
    ):
        with pytest.raises(admin.NotALock, match=re.escape(f"{keys[name]} is not a lock: {what}")):
            admin.force_release(app, keys[name], timeout=0.3)
    application = admin.force_release(app, keys["application"], timeout=0.3)
    hashed = admin.force_release(app, keys["hash"], timeout=0.3)

    assert everything_on(three_nodes) == before  # nothing changed anywhere
    for result in (application, hashed):
        assert not result.found and result.deleted_on == ()
        assert [refusal.node for refusal in result.refused] == three_nodes.urls
    assert {refusal.reason for refusal in hashed.refused} == {"it is a hash, not a string"}
    assert application.refusal_lines()[0] == (
        f"{keys['application']} is not a lock on {three_nodes.urls[0]}: {NOT_A_LOCK_VALUE} "
        "(40 lowercase hex digits, then optionally | and owner)"
    )

    released = admin.force_release(app, keys["lock"], timeout=0.3)

    assert released.found and released.deleted_on == tuple(three_nodes.urls)
    assert not released.refused and not released.still_present_on
    after = everything_on(three_nodes)
    # The lock goes with its copy at its 0.2-layout key (where 0.2 workers look).
    gone = {keys["lock"], keyspace.legacy_key(PREFIX, keys["lock"])}
    assert all(gone <= set(node) for node in before)
    for node_before, node_after in zip(before, after, strict=True):
        assert node_after == {key: entry for key, entry in node_before.items() if key not in gone}


def test_a_node_whose_copy_is_not_a_lock_keeps_it(three_nodes: RedisNodes) -> None:
    """Two nodes hold a lock under the key, the third an application's value: the script on
    the third refuses, atomically, though the key was found to be a lock."""
    app = create_app(three_nodes.urls)
    key = admin.lock_key(app, TASK, 2)
    set_on(three_nodes, key, lock_value(TOKENS.new(), Owner.here(TASK, "run-2").to_text()), (0, 1))
    set_on(three_nodes, key, "important", (2,))

    result = admin.force_release(app, key, timeout=0.3)

    assert result.lock is not None and result.lock.held
    assert result.deleted_on == tuple(three_nodes.urls[:2])
    assert [refusal.node for refusal in result.refused] == [three_nodes.urls[2]]
    assert result.refused[0].reason.startswith(NOT_A_LOCK_VALUE)
    assert values_on(three_nodes, key) == [None, None, "important"]


def test_the_command_line_refuses_what_is_not_a_lock(
    three_nodes: RedisNodes, keys_beside_a_lock: dict[str, str]
) -> None:
    app = create_app(three_nodes.urls)
    keys = keys_beside_a_lock
    before = everything_on(three_nodes)

    runs = {
        name: invoke(app, "release", keys[name], "--force", "--yes", *FAST)
        for name in ("fence", "records", "schedule", "application", "hash")
    }

    assert everything_on(three_nodes) == before
    for name, result in runs.items():
        assert result.exit_code == 1, (name, result.output)
        assert f"Error: {keys[name]} is not a lock: " in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.output
    assert "it is a fencing counter" in runs["fence"].stderr
    assert NOT_A_LOCK_VALUE in runs["application"].stderr
    assert "left alone" in runs["application"].stderr
    assert "it is a hash, not a string" in runs["hash"].stderr
    released = invoke(app, "release", keys["lock"], "--force", "--yes", *FAST)
    assert released.exit_code == 0, released.output
    assert values_on(three_nodes, keys["lock"]) == [None, None, None]


def test_the_scripts_check_the_value_themselves(three_nodes: RedisNodes) -> None:
    """What each node decides on its own, whatever the caller read before: FORCE_RELEASE and
    RELEASE_IF_OWNER delete only lock values, and a key of another type is no error."""
    app = create_app(three_nodes.urls)
    owner = Owner.here(TASK, "run-3")
    lock = lock_value(TOKENS.new(), owner.to_text())
    token_only = TOKENS.new()
    cases = {
        "a lock": (lock, 1),
        "a token alone": (token_only, 1),
        "important": ("important", NOT_A_LOCK_VALUE),
        "upper-case token": (token_only.upper(), NOT_A_LOCK_VALUE),
        "short token": (token_only[:39] + "|{}", NOT_A_LOCK_VALUE),
    }
    with three_nodes[0].client(decode_responses=True) as client:
        for name, (value, _) in cases.items():
            client.set(f"{PREFIX}{{{name}}}", value)
        client.hset(f"{PREFIX}{{hash}}", "field", "value")
        replies = {
            name: client.eval(scripts.FORCE_RELEASE.source, 1, f"{PREFIX}{{{name}}}")
            for name in [*cases, "hash", "absent"]
        }
        remaining = {name: client.get(f"{PREFIX}{{{name}}}") for name in cases}
    for name, (value, expected) in cases.items():
        if expected == 1:
            assert (replies[name], remaining[name]) == (1, None), name
        else:
            assert replies[name].startswith(expected), (name, replies[name])
            assert remaining[name] == value, name
    assert (replies["hash"], replies["absent"]) == ("it is a hash, not a string", 0)

    # RELEASE_IF_OWNER, through the core that runs it: only the owner's lock value goes.
    redlock = Redlock(three_nodes.urls, node_timeout=1.0)  # a busy machine must not skip a node
    resource = admin.call_key(app, TASK, [3]).resource
    key = redlock.key_for(resource)
    prefix = run_prefix("run-3", owner.pid, owner.host)
    for value in ("important", f"{'z' * 40}|{owner.to_text()}"):
        set_on(three_nodes, key, value)
        assert release_if_owner(redlock, resource, prefix) == 0
        assert values_on(three_nodes, key) == [value] * 3
    with three_nodes[0].client() as client:
        client.delete(key)
        client.hset(key, "field", "value")
    assert release_if_owner(redlock, resource, prefix) == 0  # a hash: no error, not deleted
    with three_nodes[0].client() as client:
        assert client.type(key) == b"hash"
        client.delete(key)
    set_on(three_nodes, key, lock)
    assert release_if_owner(redlock, resource, prefix) == 3
    assert values_on(three_nodes, key) == [None, None, None]
    redlock.close()
