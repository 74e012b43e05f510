"""`celery redlock`: status, list, key, release and reap, against real Redis servers.

Two tests run the installed command in a subprocess (``python -m celery -A tests.cli_app redlock
...``: the ``celery.commands`` entry point, the app loaded by ``-A``); the others invoke the same
click group in-process with click's `CliRunner` and a `CLIContext`, the object Celery's own
command hands to its subcommands.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from cli_app import GATE, create_app
from cli_support import FAST, as_json, invoke, run_celery
from redlock_support import value_on, values_on, wait_until

from celery_redlock import Lock, Redlock
from celery_redlock.lock import keyspace
from celery_redlock.lock.owner import Owner
from celery_redlock.settings import RedlockSettings
from celery_redlock.testing import RedisNodes


def take_lock(
    nodes: RedisNodes, resource: str, task_id: str, ttl: float = 30.0, owner: Owner | None = None
) -> Lock:
    """A lock as a worker takes it (with the owner description a task run stores: by default a
    run of ``task_id`` in this process), returned once every node has it: an acquisition
    returns as soon as a majority has."""
    owner = owner or Owner.here(resource.partition(":")[0], task_id, 2)
    redlock = Redlock(nodes.urls, node_timeout=1.0)  # a busy machine must not skip a node
    lock = redlock.acquire(resource, ttl, owner=owner.to_text())
    assert lock is not None
    if not wait_until(lambda: values_on(nodes, lock.key) == [lock.value] * len(nodes), 1.0):
        # A node the acquisition skipped (too slow on a loaded machine): the test wants the
        # lock on all of them, as a worker's usually is.
        for server, value in zip(nodes, values_on(nodes, lock.key), strict=True):
            if value is None:
                with server.client() as client:
                    client.set(lock.key, lock.value, px=int(ttl * 1000))
    redlock.close()
    return lock


def aof_written(client: Any) -> bool:
    """True once a server that just turned AOF on has written its initial AOF."""
    persistence = client.info("persistence")
    return bool(
        persistence["aof_enabled"]
        and not persistence["aof_rewrite_in_progress"]
        and not persistence["aof_rewrite_scheduled"]
    )


# -- status -------------------------------------------------------------------------------------


def test_status_from_the_celery_command_reports_a_killed_node(three_nodes: RedisNodes) -> None:
    three_nodes[2].kill()

    result = run_celery(three_nodes.urls, "status", "--json", *FAST)

    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["configured"], report["reachable"], report["quorum"]) == (3, 2, 2)
    assert report["has_quorum"] is True
    up, down = report["nodes"][:2], report["nodes"][2]
    for node, server in zip(up, three_nodes, strict=False):
        with server.client() as client:
            assert node["redis_version"] == client.info("server")["redis_version"]
        assert node["reachable"] and node["role"] == "master"
        assert 0 < node["round_trip_milliseconds"] < 300
        assert node["aof_enabled"] is False
        assert any("delayed restart" in warning for warning in node["warnings"])
    assert down["node"] == three_nodes[2].url and down["reachable"] is False
    assert "Connection refused" in down["error"] or "connecting" in down["error"]
    # The largest ttl a key can live: cli_app.nightly_cleanup holds its lock 45 s after a run.
    assert report["largest_lock_ttl_seconds"] == 45.0


def test_status_exits_1_without_a_majority(three_nodes: RedisNodes) -> None:
    app = create_app(three_nodes.urls)
    three_nodes[0].kill()
    three_nodes[1].pause()  # hung: answers nothing, costs one timeout

    started = time.monotonic()
    result = invoke(app, "status", *FAST)

    assert time.monotonic() - started < 3
    assert result.exit_code == 1
    assert "1 of 3 reachable, a majority is 2: NO QUORUM" in result.stdout
    assert result.stdout.count("DOWN") == 2
    assert "Timeout" in result.stdout and "Connection refused" in result.stdout
    assert "only 1 of 3 lock nodes answered" in result.stderr

    three_nodes[1].resume()
    result = invoke(app, "status", *FAST)
    assert result.exit_code == 0
    assert "2 of 3 reachable, a majority is 2: OK" in result.stdout
    assert "1 of 3 lock nodes unreachable: locks still work, but 1 more" in result.stdout


def test_status_warns_about_settings_that_weaken_safety(redis_nodes: Any) -> None:
    first, second = redis_nodes(2)
    with first.client() as client:
        client.config_set("appendonly", "yes")
        client.config_set("appendfsync", "always")
        client.config_set("maxmemory", "100mb")
        client.config_set("maxmemory-policy", "volatile-lru")
        if int(client.info("server")["redis_version"].split(".")[0]) >= 7:
            client.config_set("shutdown-timeout", 0)  # at teardown, do not wait for the replica
        # Redis refuses SIGTERM while it writes the initial AOF: let it finish first.
        assert wait_until(lambda: aof_written(client), timeout=5)
        client.execute_command("ACL", "SETUSER", "operator", "on", ">s3cret", "~*", "&*", "+@all")
        client.execute_command("ACL", "SETUSER", "operator", "-config")
    with second.client() as client:
        client.execute_command("REPLICAOF", "127.0.0.1", first.port)

    report = as_json(invoke(create_app([first.url, second.url]), "status", "--json", *FAST))

    primary, replica = report["nodes"]
    assert primary["role"] == "master" and primary["appendfsync"] == "always"
    assert primary["aof_enabled"] is True
    assert primary["warnings"] == [
        "maxmemory-policy volatile-lru with maxmemory set: under memory pressure Redis may evict "
        "lock keys (they have a ttl) and hand a lock out twice; use noeviction on lock nodes"
    ]
    assert replica["role"] == "slave" and replica["master"] == first.address
    assert any("Redlock needs independent masters" in text for text in replica["warnings"])
    assert any(text.startswith("no AOF (appendonly no)") for text in replica["warnings"])
    assert (
        "2 lock nodes configured: an even number tolerates no more failed nodes than 1 would "
        "(2 of 2 must agree), while adding a node that can fail; use an odd number such as 3 or 5"
    ) in report["warnings"]
    assert not any("no more failures than" in text for text in report["warnings"])

    # A user without CONFIG (ACL): appendfsync is unknown, and the password is never shown.
    operator_url = f"redis://operator:s3cret@{first.address}/0"
    same_server = f"redis://{first.address}/1"
    result = invoke(create_app([operator_url, same_server, second.url]), "status", *FAST)
    assert result.exit_code == 0
    assert "s3cret" not in result.output
    assert f"redis://operator:***@{first.address}/0" in result.stdout
    assert "AOF on, appendfsync unknown (CONFIG GET not allowed)" in result.stdout
    assert (
        "could not read appendfsync (CONFIG GET): the node's user may not run 'config|get'; "
        "grant it with ACL SETUSER operator +config|get"
    ) in result.stdout
    assert "are the same Redis server (same run_id)" in result.stdout
    assert "an even number" not in result.stdout


# -- list ---------------------------------------------------------------------------------------


def test_list_shows_the_holder_and_never_the_token(three_nodes: RedisNodes) -> None:
    app = create_app(three_nodes.urls)
    lock = take_lock(three_nodes, "cli_app.sync_account:abc", "task-123")
    leftover = keyspace.lock_key(RedlockSettings.key_prefix, "leftover")
    with three_nodes[0].client() as client:  # a leftover of a failed acquisition: one node only
        client.set(leftover, "f" * 40 + '|{"task":"cli_app.rebuild_report"}', px=5000)

    result = invoke(app, "list", "--json", *FAST)

    assert result.exit_code == 0, result.output
    report = as_json(result)
    assert [entry["key"] for entry in report["locks"]] == [lock.key]
    entry = report["locks"][0]
    assert entry["resource"] == "cli_app.sync_account:abc"
    assert (entry["task"], entry["task_id"], entry["retries"]) == (
        "cli_app.sync_account",
        "task-123",
        2,
    )
    assert (entry["host"], entry["pid"]) == (socket.gethostname(), os.getpid())
    assert (entry["nodes_holding"], entry["nodes_total"]) == (3, 3)
    assert 25 < entry["time_left_seconds"] <= 30
    assert [entry["key"] for entry in report["minority"]] == [leftover]
    assert report["minority"][0]["nodes_holding"] == 1
    assert lock.token not in result.output

    three_nodes[1].kill()
    result = invoke(app, "list", "--all", *FAST)
    assert result.exit_code == 0
    assert lock.token not in result.output and "f" * 40 not in result.output
    assert "1 lock(s) held (2 of 3 lock nodes answered, a majority is 2)" in result.stdout
    assert f"unreachable: {three_nodes[1].url}" in result.stdout
    assert "task      cli_app.sync_account  id task-123  retries 2" in result.stdout
    assert f"host {socket.gethostname()}, pid {os.getpid()}" in result.stdout
    assert "on 2/3 nodes" in result.stdout
    assert f"{leftover}  (NOT held)" in result.stdout
    assert ":fence" not in result.stdout

    three_nodes[2].kill()
    result = invoke(app, "list", *FAST)
    assert result.exit_code == 1
    assert "a majority (2) is needed to tell which locks are held" in result.stderr


# -- key ----------------------------------------------------------------------------------------


def test_key_is_the_key_a_worker_locks(three_nodes: RedisNodes) -> None:
    app = create_app(three_nodes.urls)
    blocking = app.tasks["cli_app.blocking"]
    GATE.clear()
    outcome: dict[str, Any] = {}
    run = threading.Thread(
        target=lambda: outcome.update(
            key=blocking.apply(args=(7,), task_id="run-7").get(disable_sync_subtasks=False)
        )
    )
    run.start()
    try:
        assert wait_until(lambda: as_json(invoke(app, "list", "--json"))["locks"], timeout=5)

        held = as_json(invoke(app, "key", "cli_app.blocking", "7", "--json"))
        by_keyword = as_json(invoke(app, "key", "cli_app.blocking", "account_id=7", "--json"))
    finally:
        GATE.set()
        run.join(10)
    assert held["key"] == by_keyword["key"] == outcome["key"]
    assert held["held"] is True
    assert (held["lock"]["task"], held["lock"]["task_id"]) == ("cli_app.blocking", "run-7")
    after = invoke(app, "key", "cli_app.blocking", "7")  # released by task_postrun
    assert "state     free (no node has it)" in after.stdout

    # The same derivation as the worker's, whatever the way of keying.
    cases = [
        ("cli_app.sync_account", ["42", "full=true"], [42], {"full": True}),
        ("cli_app.rebuild_report", ["7", "2024-05-01", '{"b": [1, 2], "a": null}'], None, None),
        ("cli_app.by_template", ["account_id=-3"], [], {"account_id": -3}),
        ("cli_app.nightly_cleanup", [], [], {}),
    ]
    for name, words, args, kwargs in cases:
        if args is None:
            args, kwargs = [7, "2024-05-01", {"a": None, "b": [1, 2]}], {}
        task = app.tasks[name]
        report = as_json(invoke(app, "key", name, *words, "--json"))
        assert report["key"] == task.lock_key_for(*args, **kwargs), name
        assert report["held"] is False
    assert (
        as_json(invoke(app, "key", "cli_app.sync_account", "-1", "full=false", "--json"))["key"]
        == as_json(invoke(app, "key", "cli_app.sync_account", "account_id=-1", "--json"))["key"]
    )


def test_key_from_the_celery_command_and_its_errors(three_nodes: RedisNodes) -> None:
    app = create_app(three_nodes.urls)
    lock = take_lock(three_nodes, "cli_app.nightly_cleanup", "nightly-1")

    result = run_celery(three_nodes.urls, "key", "cli_app.nightly_cleanup")

    assert result.returncode == 0, result.stderr
    assert f"key       {lock.key}" in result.stdout
    assert "locks on  task name alone (lock_args=())" in result.stdout
    assert "state     held by task cli_app.nightly_cleanup[nightly-1]" in result.stdout
    assert "on 3/3 nodes" in result.stdout and lock.token not in result.stdout

    unknown = invoke(app, "key", "cli_app.sync_acount", "1")
    assert unknown.exit_code == 1
    assert "unknown task 'cli_app.sync_acount'; did you mean cli_app.sync_account?" in (
        unknown.stderr
    )
    plain = invoke(app, "key", "cli_app.plain")
    assert plain.exit_code == 1 and "is not a SingletonTask" in plain.stderr
    mismatch = invoke(app, "key", "cli_app.sync_account", "1", "2", "3")
    assert mismatch.exit_code == 1 and "does not match its signature" in mismatch.stderr


# -- release ------------------------------------------------------------------------------------


def test_release_requires_force_confirms_and_deletes_everywhere(three_nodes: RedisNodes) -> None:
    app = create_app(three_nodes.urls)
    lock = take_lock(three_nodes, "cli_app.sync_account:stuck", "stuck-1")

    refused = invoke(app, "release", lock.key)
    assert refused.exit_code == 2 and "refusing to release without --force" in refused.stderr
    declined = invoke(app, "release", lock.key, "--force", input="n\n")
    assert declined.exit_code == 1
    assert "held by task cli_app.sync_account[stuck-1]" in declined.stderr
    assert lock.token not in declined.output
    assert all(value == lock.value for value in values_on(three_nodes, lock.key))

    # A waiter blocked on the lock is woken by the release notification, not by the ttl.
    waiter = Redlock(three_nodes.urls)
    acquired: list[Lock | None] = []
    wait = threading.Thread(
        target=lambda: acquired.append(waiter.acquire(lock.resource, 5, blocking=True, timeout=10))
    )
    wait.start()
    time.sleep(0.2)
    released_at = time.monotonic()
    result = invoke(app, "release", lock.key, "--force", input="y\n")
    wait.join(10)

    assert result.exit_code == 0, result.output
    assert f"Released {lock.key}: deleted on 3 of 3 nodes." in result.stdout
    assert acquired and acquired[0] is not None
    assert time.monotonic() - released_at < 3  # the old lock had ~30 s to live
    waiter.release(acquired[0])
    assert values_on(three_nodes, lock.key) == [None, None, None]

    # By resource (no prefix), for scripts, with a node down.
    lock = take_lock(three_nodes, "cli_app.sync_account:stuck", "stuck-2")
    three_nodes[0].kill()
    result = invoke(app, "release", lock.resource, "--force", "--yes", "--json", *FAST)
    assert result.exit_code == 0, result.output
    report = as_json(result)
    assert (report["key"], report["resource"]) == (lock.key, lock.resource)
    assert report["deleted"] == 2 and report["deleted_on"] == three_nodes.urls[1:]
    assert [node["node"] for node in report["unreachable"]] == [three_nodes[0].url]
    assert lock.token not in result.output
    assert [value_on(server, lock.key) for server in three_nodes.servers[1:]] == [None, None]

    gone = invoke(app, "release", lock.key, "--force", "--yes", *FAST)
    assert gone.exit_code == 0
    assert "is on none of the 2 reachable nodes: nothing to release" in gone.stdout


# -- reap ---------------------------------------------------------------------------------------


def test_reap_frees_only_the_lock_of_a_process_that_is_gone(three_nodes: RedisNodes) -> None:
    app = create_app(three_nodes.urls)
    exited = subprocess.Popen([sys.executable, "-c", ""])
    exited.wait()
    gone = Owner(
        "dead-1", "cli_app.sync_account", host=socket.gethostname(), pid=exited.pid, since=1.0
    )
    dead = take_lock(three_nodes, "cli_app.sync_account:dead", "dead-1", owner=gone)
    live = take_lock(three_nodes, "cli_app.sync_account:live", "live-1")  # this process

    dry = invoke(app, "reap", "--dry-run", "--grace", "0", "--json", *FAST)

    assert dry.exit_code == 0, dry.output
    report = as_json(dry)
    assert (report["dry_run"], report["freed"]) == (True, 1)
    decisions = {entry["lock"]["key"]: entry for entry in report["results"]}
    assert decisions[dead.key]["action"] == "would-free"
    assert decisions[dead.key]["proof"] == "process-gone"
    assert decisions[live.key]["action"] == "kept"
    assert values_on(three_nodes, dead.key) == [dead.value] * 3

    result = invoke(app, "reap", "--grace", "0", *FAST)

    assert result.exit_code == 0, result.output
    assert "Freed 1 of 2 held lock(s)" in result.stdout
    assert f"freed      {dead.key}  task cli_app.sync_account[dead-1]" in result.stdout
    assert f"proof process-gone: process {exited.pid} no longer exists" in result.stdout
    assert f"kept       {live.key}" in result.stdout
    assert dead.token not in result.output and live.token not in result.output
    assert values_on(three_nodes, dead.key) == [None, None, None]
    assert values_on(three_nodes, live.key) == [live.value] * 3

    three_nodes[0].kill()
    three_nodes[1].kill()
    refused = invoke(app, "reap", *FAST)
    assert refused.exit_code == 1 and "nothing was reaped" in refused.stderr
