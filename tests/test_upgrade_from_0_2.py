"""A fleet upgraded from celery-redlock 0.2 while it runs (issue 25, problem 5). 0.2 locked
``redlock:<resource>``; today a lock lives at ``redlock:{<resource>}``. With real servers, and
0.2's locks written directly as a 0.2 worker or beat writes them (``SET key value NX PX`` with a
token and 0.2's owner text):

- a 0.2 worker's lock is in the way of today's workers (a real worker skips the call), of the
  lock core, and of today's beat leaders (a real ``celery beat`` does not lead);
- a lock taken today is written at its 0.2 key too (where a 0.2 worker's ``SET NX`` fails),
  extended and released with it, and freed with it by a forced release;
- ``celery redlock list``, ``key`` and ``status`` show 0.2 workers' locks as such, and a lock of
  today's layout once;
- and a real 0.2.0 worker (its sources from this repository's history) beside a worker of today
  never runs a key while the other does; a real 0.2.0 beat and a beat of today never both lead.
"""

from __future__ import annotations

import itertools
import json
import secrets
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery_apps import leader_app
from celery_apps.subprocesses import (
    TESTS_DIRECTORY,
    BeatProcess,
    Recorder,
    WorkerProcess,
    app_environment,
    celery_processes,
    control_app,
)
from celery_apps.support import LOCK_EVENTS, RunLog
from cli_app import create_app
from cli_support import FAST, as_json, invoke
from conftest import MakeRedisNodes
from redlock_support import commands_seen, pttls_on, values_on, wait_until

from celery_redlock import Redlock, RedlockSettings, SingletonTask, admin, testing
from celery_redlock.errors import ConfigurationError, DuplicateSkipped
from celery_redlock.lock import keyspace
from celery_redlock.lock.outcomes import Acquired, Held
from celery_redlock.lock.owner import lock_value
from celery_redlock.testing import RedisNodes, RedisServer

PREFIX = "redlock:"
LEGACY_LEASE_KEY = PREFIX + RedlockSettings.beat_lease_name
RELEASE_0_2 = "32a0ac78195097a622b47bf2239e5084895486b3"  # "Packaging and CI", version 0.2.0
LEGACY_LEASE = 4.0  # seconds the 0.2 beat's lease lasts in the beat test (it is not extended)


def legacy_value(task: str | None, task_id: str | None, role: str | None = None) -> str:
    """A stored value as 0.2 wrote it: 40 hex digits of token, ``|``, the owner as compact JSON
    with ``id``, ``queued``, ``pid`` and ``host`` first."""
    owner: dict[str, object] = {
        "id": task_id,
        "queued": False,
        "pid": 4242,
        "host": "old-host",
        "task": task,
        "retries": 0,
        "nesting": 0,
        "since": round(time.time(), 3),
    }
    if role is not None:
        owner["role"] = role
    else:
        owner["worker"] = "old@old-host"
    return secrets.token_hex(20) + "|" + json.dumps(owner, separators=(",", ":"))


def sources_of_0_2(directory: Path) -> Path:
    """``celery_redlock`` as released in 0.2.0, taken from this repository's history into
    ``directory`` (the test is skipped where the history is not there: a shallow clone)."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(TESTS_DIRECTORY.parent), "archive", RELEASE_0_2, "celery_redlock"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"0.2.0 ({RELEASE_0_2[:7]}) is not in this checkout's git history")
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True, timeout=60)
    return directory


def lock_as_0_2(nodes: Iterable[RedisServer], key: str, value: str, ttl: float = 60.0) -> None:
    """What a 0.2 worker's acquisition leaves on ``nodes``: ``SET key value NX PX ttl``."""
    for server in nodes:
        with server.client(socket_timeout=2) as client:
            assert client.set(key, value, nx=True, px=int(ttl * 1000))


def delete(nodes: Iterable[RedisServer], key: str) -> None:
    for server in nodes:
        with server.client(socket_timeout=2) as client:
            client.delete(key)


@pytest.fixture
def three(redis_nodes: MakeRedisNodes) -> RedisNodes:
    return redis_nodes(3)


@pytest.fixture
def redlock(three: RedisNodes) -> Iterator[Redlock]:
    manager = Redlock(three.urls)
    yield manager
    manager.close()


# -- the lock core ------------------------------------------------------------------------------


def test_a_0_2_lock_is_held_for_the_lock_of_today(three: RedisNodes, redlock: Redlock) -> None:
    value = legacy_value("proj.tasks.sync", "id-of-0.2")
    lock_as_0_2(three, PREFIX + "proj.tasks.sync:abc", value)

    outcome = redlock.attempt("proj.tasks.sync:abc", 10.0)
    assert isinstance(outcome, Held), outcome
    assert json.loads(outcome.holder)["id"] == "id-of-0.2"
    assert values_on(three, "redlock:{proj.tasks.sync:abc}") == [None] * 3  # nothing taken

    # On a minority only (a 0.2 acquisition that failed), it is no lock: the lock is taken.
    delete([three[1], three[2]], PREFIX + "proj.tasks.sync:abc")
    assert isinstance(redlock.attempt("proj.tasks.sync:abc", 10.0), Acquired)


def test_a_lock_of_today_is_held_at_its_0_2_key_too(three: RedisNodes, redlock: Redlock) -> None:
    outcome = redlock.attempt("proj.tasks.report:abc", 10.0)
    assert isinstance(outcome, Acquired)
    lock, legacy = outcome.lock, PREFIX + "proj.tasks.report:abc"
    assert values_on(three, legacy) == [lock.value] * 3
    for server in three:  # what a 0.2 worker's acquisition does: it fails
        with server.client(socket_timeout=2) as client:
            assert not client.set(legacy, legacy_value("proj.tasks.report", "x"), nx=True, px=1)

    assert redlock.extend(lock, 30.0)
    assert min(pttls_on(three, legacy)) > 20_000  # extended with the lock (ttl was 10 s)
    assert redlock.release(lock)
    assert values_on(three, legacy) == [None] * 3

    # A key of 0.2's layout holding what no version writes is neither in the way nor replaced.
    for server in three:
        with server.client(socket_timeout=2) as client:
            client.set(legacy, "an application's own value")
    again = redlock.acquire("proj.tasks.report:abc", 10.0)
    assert again is not None
    assert values_on(three, legacy) == ["an application's own value"] * 3
    redlock.release(again)


def test_with_the_0_2_layout_off_locks_live_at_their_key_of_today_alone(three: RedisNodes) -> None:
    """``redlock_compat_0_2 = False``, once no 0.2 process runs: a 0.2 lock is no longer in the
    way, and nothing is written, extended or released at 0.2 keys; ``status`` says that 0.2
    locks found meanwhile are not treated as held."""
    old = PREFIX + "proj.tasks.sync:off"
    value = legacy_value("proj.tasks.sync", "id-of-0.2")
    lock_as_0_2(three, old, value)
    manager = Redlock(three.urls, compat_0_2=False)
    try:
        outcome = manager.attempt("proj.tasks.sync:off", 10.0)
        assert isinstance(outcome, Acquired), outcome
        assert manager.holder_of("proj.tasks.sync:off") is not None  # today's lock, not 0.2's
        lock = manager.acquire("proj.tasks.report:off", 10.0)
        assert lock is not None
        assert values_on(three, PREFIX + "proj.tasks.report:off") == [None] * 3
        assert manager.extend(lock, 30.0)
        assert manager.release(lock)
        assert manager.release(outcome.lock)
        assert manager.holder_of("proj.tasks.sync:off") is None  # the 0.2 lock is not held
        assert values_on(three, old) == [value] * 3  # the 0.2 lock, untouched
    finally:
        manager.close()
    app = create_app(three.urls)
    app.conf.redlock_compat_0_2 = False
    status = invoke(app, "status", *FAST)
    assert f"1 lock(s) under 0.2-layout keys ({old})" in status.stdout, status.output
    assert "do NOT treat them as held (redlock_compat_0_2 is False)" in status.stdout


def test_with_the_0_2_copy_off_no_0_2_layout_key_is_read_or_written(three: RedisNodes) -> None:
    """Every command the nodes ran (MONITOR, scripts' own commands included) while a lock was
    taken, refused, extended, held, released and looked up: with ``compat_0_2=False`` none names
    a 0.2-layout key; with it on, the same calls read and write them, and a 0.2 lock held there
    is in the way."""
    resource = "proj.tasks.monitored:1"
    legacy = PREFIX + resource
    other = lock_value("c" * 40, "another worker of today")

    def lock_calls(manager: Redlock) -> Acquired | Held:
        outcome = manager.attempt(resource, 10.0)
        if isinstance(outcome, Acquired):
            lock = outcome.lock
            assert manager.extend(lock, 20.0)
            assert manager.holder_of(resource) is not None
            assert manager.release(lock, hold=0.5)
            assert isinstance(manager.attempt(resource, 10.0), Held)  # held for 0.5 s more
            again = manager.acquire(resource, 10.0, blocking=True, timeout=5.0)
            assert again is not None and manager.release(again)
        for server in three:  # someone else's lock of today: refused, nothing written
            with server.client(socket_timeout=2) as client:
                client.set(manager.key_for(resource), other, px=10_000)
        assert isinstance(manager.attempt(resource, 10.0), Held)
        delete(three, manager.key_for(resource))
        assert isinstance(outcome, (Acquired, Held)), outcome
        return outcome

    lock_as_0_2(three, legacy, legacy_value("proj.tasks.monitored", "id-of-0.2"))
    off = Redlock(three.urls, compat_0_2=False)
    try:
        with commands_seen(three.servers) as seen:
            assert isinstance(lock_calls(off), Acquired)
    finally:
        off.close()
    commands = [command["command"] for commands in seen for command in commands]
    assert sum("EVALSHA" in command for command in commands) >= 5 * 3, commands
    assert any(f"GET {PREFIX}{{{resource}}}" in command for command in commands), commands
    # Not at the 0.2-layout lock key, nor at its reservation (the key plus ":pending").
    named = [part for command in commands for part in command.split(" ")]
    assert [part for part in named if part.startswith(legacy)] == []

    on = Redlock(three.urls)  # the default: compat_0_2=True
    try:
        with commands_seen(three.servers) as seen:
            assert isinstance(lock_calls(on), Held)  # the 0.2 worker's lock is in the way
        assert all(
            f"GET {legacy}" in [command["command"] for command in commands] for commands in seen
        )
        delete(three, legacy)
        with commands_seen(three.servers) as seen:
            assert isinstance(lock_calls(on), Acquired)
        written = [command["command"] for command in seen[0] if command["client_type"] == "lua"]
        assert any(command.startswith(f"SET {legacy} ") for command in written), written
        assert any(command.startswith(f"PEXPIRE {legacy} ") for command in written), written
        assert f"DEL {legacy}" in written, written
    finally:
        on.close()


def test_holder_of_names_a_0_2_lock_held_on_a_majority(three: RedisNodes, redlock: Redlock) -> None:
    """Issue 39: where only the 0.2-layout key is held (a 0.2 worker's lock), `holder_of` names
    its holder as `attempt` does (it said nobody); on a minority it is no lock."""
    resource = "proj.tasks.sync:holder"
    lock_as_0_2(three.servers[:2], PREFIX + resource, legacy_value("proj.tasks.sync", "id-0.2"))
    attempted = redlock.attempt(resource, 10.0)
    assert isinstance(attempted, Held), attempted
    holder = redlock.holder_of(resource)
    assert holder is not None and json.loads(holder.holder)["id"] == "id-0.2"
    assert holder.holder == attempted.holder and 0 < holder.expires_in <= 60

    # A lock of today's layout comes first, as it does for an acquisition.
    ours = lock_value("d" * 40, "a worker of today")
    for server in three.servers[:2]:
        with server.client(socket_timeout=2) as client:
            client.set(redlock.key_for(resource), ours, px=10_000)
    today = redlock.holder_of(resource)
    assert today is not None and today.holder == "a worker of today"
    delete(three, redlock.key_for(resource))

    delete(three.servers[1:2], PREFIX + resource)
    assert redlock.holder_of(resource) is None
    assert isinstance(redlock.attempt(resource, 10.0), Acquired)


def test_the_old_name_of_the_setting_still_works_with_a_warning(
    three: RedisNodes, caplog: pytest.LogCaptureFixture
) -> None:
    """``redlock_legacy_layout`` / ``Redlock(legacy_layout=...)``, deprecated: each works as the
    new name, warns naming it, and set beside the new name to another value is an error."""
    app = create_app(three.urls)
    app.conf.redlock_legacy_layout = False
    with caplog.at_level("WARNING", logger="celery_redlock.settings"):
        assert RedlockSettings.from_conf(app.conf).compat_0_2 is False
    assert [record.getMessage() for record in caplog.records] == [
        "redlock_legacy_layout is deprecated: name it redlock_compat_0_2 (the same setting); "
        "the old name will go"
    ]
    app.conf.redlock_compat_0_2 = False
    assert RedlockSettings.from_conf(app.conf).compat_0_2 is False
    app.conf.redlock_compat_0_2 = True
    with pytest.raises(ConfigurationError) as raised:
        RedlockSettings.from_conf(app.conf)
    assert str(raised.value) == (
        "redlock_legacy_layout (deprecated) and redlock_compat_0_2 are one setting, set to False "
        "and True: remove redlock_legacy_layout"
    )

    with pytest.deprecated_call(match=r"legacy_layout=.*deprecated: pass compat_0_2="):
        manager = Redlock(three.urls, legacy_layout=False)
    try:
        old = PREFIX + "proj.tasks.sync:alias"
        lock_as_0_2(three, old, legacy_value("proj.tasks.sync", "id-of-0.2"))
        assert isinstance(manager.attempt("proj.tasks.sync:alias", 10.0), Acquired)
    finally:
        manager.close()
    with pytest.deprecated_call(), pytest.raises(ConfigurationError, match="remove legacy_layout"):
        Redlock(three.urls, compat_0_2=True, legacy_layout=False)


# -- a real worker -------------------------------------------------------------------------------


SLEEPER = "celery_apps.prefork_app.sleeper"


def sleeper_lock_key(locks: RedisNodes, *args: object) -> str:
    """The lock key of a call of the worker's ``sleeper`` (celery_apps.prefork_app), from the
    same definition in an app of the test's own: importing the worker's module here would add
    its tasks to every app finalized later in this session (they are shared tasks)."""
    app = Celery("upgrade_keys", set_as_current=False)
    app.conf.redlock_urls = locks.urls

    @app.task(base=SingletonTask, name=SLEEPER, shared=False, lock_args=("key",), lock_ttl=30)
    def sleeper(key: str, seconds: float) -> None: ...

    try:
        return str(sleeper.lock_key_for(*args))
    finally:
        app.close()


def test_a_worker_skips_a_call_whose_0_2_lock_is_held(redis_nodes: MakeRedisNodes) -> None:
    broker, locks = redis_nodes(1)[0], redis_nodes(3)
    key = sleeper_lock_key(locks, "upgrade-key", 0.05)
    legacy = PREFIX + key[len(PREFIX) + 1 : -1]  # the braces dropped
    lock_as_0_2(locks, legacy, legacy_value(SLEEPER, "held-by-0.2"))
    client = control_app(broker, result_backend=broker.url)
    log = RunLog(broker.url)
    worker = WorkerProcess("celery_apps.prefork_app", "upgraded", app_environment(broker, locks))
    try:
        with celery_processes() as processes:
            processes.append(worker.start())
            worker.wait_ready(client)
            skipped = client.send_task(SLEEPER, args=("upgrade-key", 0.05))
            with pytest.raises(DuplicateSkipped, match=r"sleeper\[held-by-0\.2\] on old@old-host"):
                skipped.get(timeout=30)

            events = log.read(LOCK_EVENTS)
            duplicates = [event for event in events if event["signal"] == "lock_duplicate"]
            assert [(event["key"], event["policy"]) for event in duplicates] == [(key, "skip")]
            assert "held-by-0.2" in str(duplicates[0]["holder"])
            assert log.started() == []

            delete(locks, legacy)  # the 0.2 worker is done: the next call runs
            ran = client.send_task(SLEEPER, args=("upgrade-key", 0.05))
            assert ran.get(timeout=30)["key"] == key
            assert len(log.started()) == 1
    finally:
        client.close()


def test_a_0_2_worker_and_a_worker_of_today_never_run_one_key_at_once(
    redis_nodes: MakeRedisNodes, tmp_path: Path
) -> None:
    """celery-redlock 0.2.0 itself (from this repository's history) beside today's: 120 calls
    on 4 keys, every overlap of two runs of one key counted (before today's 0.2-layout keys:
    dozens, each version running beside the other)."""
    old = sources_of_0_2(tmp_path)
    broker, locks = redis_nodes(1)[0], redis_nodes(3)
    environment = {"CRL_BROKER_URL": broker.url, "CRL_LOCK_URLS": ",".join(locks.urls)}
    workers = [
        testing.CeleryWorker(
            "celery_apps.upgrade_app",
            name,
            pool="threads",
            concurrency=4,
            environment=environment,
            python_path=[*first, TESTS_DIRECTORY],
            working_directory=TESTS_DIRECTORY,
        )
        for name, first in (("version-0-2", [old]), ("version-today", []))
    ]
    client = control_app(broker, result_backend=broker.url)
    try:
        with celery_processes() as processes:
            for worker in workers:
                processes.append(worker.start())
            testing.wait_for_workers(client, workers)
            calls = [(f"key-{index % 4}", 0.02 + index % 3 * 0.03) for index in range(120)]
            results = [client.send_task("upgrade.job", args=call) for call in calls]
            for result in results:  # each ran, or was skipped as a duplicate (REVOKED)
                result.get(timeout=60, propagate=False)
        with broker.client() as records:
            runs = [json.loads(entry) for entry in records.lrange("upgrade:runs", 0, -1)]
    finally:
        client.close()
    assert {version for *_, version in runs} == {"0.2.0", "today"}, runs
    overlaps = []
    for key in {key for key, *_ in runs}:
        spans = sorted((start, end, version) for other, start, end, version in runs if other == key)
        overlaps += [(key, a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]
    assert overlaps == [], f"{len(overlaps)} overlapping runs of one key: {overlaps[:3]}"


def test_a_0_2_beat_and_a_beat_of_today_never_lead_at_once(
    redis_nodes: MakeRedisNodes, tmp_path: Path
) -> None:
    """celery-redlock 0.2.0's `LeaderScheduler` beside today's: only one of them sends, until it
    is killed; then only the other."""
    old = sources_of_0_2(tmp_path)
    broker, locks = redis_nodes(1)[0], redis_nodes(3)
    environment = {"CRL_BROKER_URL": broker.url, "CRL_LOCK_URLS": ",".join(locks.urls)}
    beats = {
        version: testing.CeleryBeat(
            "celery_apps.upgrade_app",
            tmp_path / f"schedule-{version}",
            environment=environment,
            python_path=[*first, TESTS_DIRECTORY],
            working_directory=TESTS_DIRECTORY,
        )
        for version, first in (("0.2.0", [old]), ("today", []))
    }
    with broker.client() as records, celery_processes() as processes:

        def sent() -> list[tuple[float, str]]:
            return [tuple(json.loads(entry))[:2] for entry in records.lrange("upgrade:sent", 0, -1)]

        for beat in beats.values():
            processes.append(beat.start())
        alive = list(beats.values())
        assert wait_until(lambda: len(sent()) >= 8, timeout=30, alive=alive), sent()
        leader = sent()[0][1]
        beats[leader].kill()
        killed_at = time.time()
        follower = next(version for version in beats if version != leader)
        after = wait_until(
            lambda: sum(at > killed_at for at, _ in sent()) >= 4,
            timeout=30,
            alive=[beats[follower]],
        )
        ticks = sent()
    assert after, ticks
    assert {version for at, version in ticks if at <= killed_at} == {leader}, ticks
    assert {version for at, version in ticks if at > killed_at} == {follower}, ticks


# -- the operators' tools -----------------------------------------------------------------------


def test_list_key_and_status_show_a_0_2_lock_and_a_lock_of_today_once(three: RedisNodes) -> None:
    app = create_app(three.urls)
    call_key = admin.call_key(app, "cli_app.sync_account", [7])
    legacy = PREFIX + call_key.resource
    lock_as_0_2(three, legacy, legacy_value("cli_app.sync_account", "id-of-0.2"))
    today = Redlock(three.urls)
    try:
        ours = today.acquire("proj.today", 30.0)
        assert ours is not None

        listed = invoke(app, "list", *FAST)
        assert listed.exit_code == 0, listed.output
        assert listed.stdout.startswith("2 lock(s) held (3 of 3 lock nodes answered")
        assert f"{legacy}\n    layout    {admin.LEGACY_NOTE}\n" in listed.stdout
        assert listed.stdout.count("proj.today") == 1  # its 0.2-layout copy is the same lock
        records = {
            record["key"]: record for record in as_json(invoke(app, "list", "--json"))["locks"]
        }
        assert records[legacy]["legacy_layout"] is True
        assert records[legacy]["task_id"] == "id-of-0.2"
        assert records["redlock:{proj.today}"]["legacy_layout"] is False

        shown = invoke(app, "key", "cli_app.sync_account", "7", *FAST)
        assert shown.exit_code == 0, shown.output
        assert "state     held by task cli_app.sync_account" in shown.stdout
        assert admin.LEGACY_NOTE in shown.stdout
        holder = admin.holder(app, "cli_app.sync_account", 7)
        assert holder is not None and holder.task_id == "id-of-0.2" and holder.legacy_layout

        status = invoke(app, "status", *FAST)
        assert f"1 lock(s) under 0.2-layout keys ({legacy})" in status.stdout, status.output

        # A forced release of today's lock frees its 0.2-layout copy too; a 0.2 key may be named.
        assert admin.force_release(app, "redlock:{proj.today}").deleted_on
        assert values_on(three, PREFIX + "proj.today") == [None] * 3
        released = invoke(app, "release", legacy, "--force", "--yes", *FAST)
        assert released.exit_code == 0, released.output
        assert values_on(three, legacy) == [None] * 3
    finally:
        today.close()


# -- beat ---------------------------------------------------------------------------------------


def test_a_beat_does_not_lead_while_a_0_2_beat_holds_the_lease(
    redis_nodes: MakeRedisNodes, tmp_path: Path
) -> None:
    broker, locks = redis_nodes(1)[0], redis_nodes(3)
    written_at = time.time()
    lock_as_0_2(locks, LEGACY_LEASE_KEY, legacy_value(None, None, role="beat"), ttl=LEGACY_LEASE)
    recorder = Recorder(broker.url)
    lease_key = keyspace.lock_key(PREFIX, RedlockSettings.beat_lease_name)
    beat = BeatProcess(leader_app.__name__, tmp_path / "schedule", app_environment(broker, locks))
    with celery_processes() as processes:
        processes.append(beat.start())
        assert wait_until(lambda: "standing by" in beat.log_text(), timeout=30, alive=[beat])
        assert recorder.read(leader_app.SENT) == []
        assert values_on(locks, lease_key) == [None] * 3

        # The 0.2 beat's lease ends (it stopped): this beat leads, at both keys.
        assert wait_until(lambda: recorder.read(leader_app.SENT), timeout=15, alive=[beat])
        first_send = min(float(record["at"]) for record in recorder.read(leader_app.SENT))
        lease = values_on(locks, lease_key)
        assert lease[0] is not None and values_on(locks, LEGACY_LEASE_KEY) == lease
    assert first_send >= written_at + LEGACY_LEASE  # not one tick while the 0.2 beat led
