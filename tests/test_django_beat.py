"""``celery_redlock.beat:LeaderDatabaseScheduler`` (django-celery-beat's ``DatabaseScheduler``
with the beat leader lease), for real: Django, django-celery-beat and a SQLite database file.

The test Django project is `django_project` (its database is made and migrated once for this
module, in a temporary directory); the Celery app is `celery_apps.django_app`, configured from
the Django settings; the periodic tasks are rows of django-celery-beat's tables. A harness
``redis-server`` is the broker (no worker: the task messages stay in its ``celery`` queue, each
stamped with the sending beat's pid and the time) and three more are the lock nodes. Covered:

- two real ``celery beat -S celery_redlock.beat:LeaderDatabaseScheduler`` processes: only one
  sends, and writes each tick's state to the database as it goes; SIGKILL it and the other takes
  over within about one lease ttl; no tick is sent twice; every entry's ``total_run_count`` in
  the database equals the ticks sent and its ``last_run_at`` is the time of the last one;
- in this process: a beat taking the lease reads the rows again (its own copy is stale) and
  continues each entry from the newer of the row and the lock nodes' record, writing a record's
  state to the row; a change to the rows seen while the heap is rebuilt, or a row write that
  failed (the database locked), sends no tick twice; a row's state is never written back to an
  older one; without django-celery-beat the scheduler is refused with the extra to install.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import django
import pytest
from celery import Celery
from celery_apps.subprocesses import (
    TESTS_DIRECTORY,
    CeleryProcess,
    app_environment,
    celery_processes,
)
from conftest import MakeRedisNodes
from django.conf import settings as django_settings
from django.core.management import call_command
from django.db import connections
from django_project import PID_HEADER, SENT_AT_HEADER
from django_project import settings as project_settings
from redlock_support import wait_until
from robustness.interruptions import InstructionTracer, signal_can_land

from celery_redlock.testing import RedisNodes, RedisServer

APP_MODULE = "celery_apps.django_app"
SCHEDULER = "celery_redlock.beat:LeaderDatabaseScheduler"
LEASE_TTL = project_settings.LEASE_TTL
INTERVAL = 1.0
ENTRIES = ("every-second-a", "every-second-b")
EARLY = 0.2
"""Seconds by which two sends of one interval entry may come closer than the interval without
being a tick sent twice (the time to publish varies; a second copy would come at once)."""
LATE = 0.75
"""Seconds beyond a deadline that a take-over or a database write may need on a busy machine."""


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The project's SQLite database, migrated, for this process (Django set up with the
    project's settings) and for the beats (its path goes in their environment)."""
    path = tmp_path_factory.mktemp("django") / "beat.sqlite3"
    if django_settings.configured:
        pytest.skip("Django was already set up in this process with other settings")
    values = {name: getattr(project_settings, name) for name in dir(project_settings)}
    values = {name: value for name, value in values.items() if name.isupper()}
    values["DATABASES"] = {"default": {**values["DATABASES"]["default"], "NAME": str(path)}}
    # Not DJANGO_SETTINGS_MODULE: that variable would turn on Celery's Django fix-up for every
    # app the other tests of this process make.
    django_settings.configure(**values)
    django.setup()
    call_command("migrate", verbosity=0)
    try:
        yield path
    finally:
        connections.close_all()


@pytest.fixture
def entries(database: Path) -> Iterator[Any]:
    """Two periodic tasks every `INTERVAL` seconds (names `ENTRIES`), the only rows; yields the
    ``PeriodicTask`` model."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    PeriodicTask.objects.all().delete()
    every = IntervalSchedule.objects.create(every=int(INTERVAL), period=IntervalSchedule.SECONDS)
    for name in ENTRIES:
        PeriodicTask.objects.create(name=name, task=f"django_beat.{name}", interval=every)
    try:
        yield PeriodicTask
    finally:
        PeriodicTask.objects.all().delete()
        IntervalSchedule.objects.all().delete()


@pytest.fixture
def broker(redis_nodes: MakeRedisNodes) -> RedisServer:
    """A harness node: the broker, whose ``celery`` queue keeps every task message sent."""
    return redis_nodes(1)[0]


@pytest.fixture
def locks(redis_nodes: MakeRedisNodes) -> RedisNodes:
    """Three lock nodes."""
    return redis_nodes(3)


def sent(broker: RedisServer, name: str | None = None) -> list[dict[str, Any]]:
    """The task messages waiting in the broker (of periodic task ``name``), oldest first by the
    time they were sent: each as its periodic task's name, the sending pid and the time."""
    with broker.client() as client:
        raw = client.lrange("celery", 0, -1)
    messages = [json.loads(item)["headers"] for item in raw]
    records = [
        {"name": m["periodic_task_name"], "pid": m[PID_HEADER], "at": float(m[SENT_AT_HEADER])}
        for m in messages
    ]
    return sorted(
        (record for record in records if name is None or record["name"] == name),
        key=lambda record: record["at"],
    )


def counts(broker: RedisServer) -> Counter[str]:
    """How many ticks of each periodic task were sent."""
    return Counter(record["name"] for record in sent(broker))


def database_state(model: Any) -> dict[str, tuple[datetime | None, int]]:
    """Each row's (``last_run_at``, ``total_run_count``), as the database holds them now."""
    return {
        name: (last_run_at, total)
        for name, last_run_at, total in model.objects.filter(name__in=ENTRIES).values_list(
            "name", "last_run_at", "total_run_count"
        )
    }


def logs(*processes: CeleryProcess) -> str:
    """The end of each process's output, for assertion messages."""
    return "\n".join(f"--- {p!r} ---\n{p.log_tail()}" for p in processes)


def start_beats(
    processes: list[CeleryProcess], count: int, environment: dict[str, str], directory: Path
) -> list[CeleryProcess]:
    """Start ``count`` beats with the leader database scheduler."""
    beats = []
    for index in range(count):
        # DatabaseScheduler keeps nothing in the -s file; each beat still gets its own.
        arguments = ["beat", "-S", SCHEDULER, "-s", str(directory / f"beat-{index}")]
        beat = CeleryProcess(APP_MODULE, [*arguments, "--loglevel", "INFO"], environment)
        processes.append(beat.start())
        beats.append(beat)
    return beats


def wait_for_sends(
    broker: RedisServer,
    count: int,
    alive: Sequence[CeleryProcess],
    after: float = 0.0,
    timeout: float = 30.0,
) -> None:
    """Wait until every entry was sent ``count`` times after ``after`` (time.time())."""

    def enough() -> bool:
        records = sent(broker)
        return all(
            sum(1 for r in records if r["name"] == name and r["at"] > after) >= count
            for name in ENTRIES
        )

    assert wait_until(enough, timeout=timeout, interval=0.05, alive=alive), (
        f"fewer than {count} sends of each entry: {sent(broker)}\n" + logs(*alive)
    )


@pytest.mark.topology  # two beat processes and a kill: seconds; in `nox -s topology`
def test_one_beat_sends_and_another_continues_after_a_kill_with_the_database_right(
    broker: RedisServer, locks: RedisNodes, entries: Any, database: Path, tmp_path: Path
) -> None:
    """Two beats on one database: one sends, writing each tick's state to the database; SIGKILL
    it and the other takes over within about one lease ttl and continues both entries without
    sending a tick twice; at the end each row's run count equals the ticks sent and its last
    run time is that of the last one."""
    environment = app_environment(
        broker,
        locks,
        DJANGO_SETTINGS_MODULE="django_project.settings",
        CRL_DJANGO_DATABASE=str(database),
        CRL_LEASE_TTL=str(LEASE_TTL),
    )
    with celery_processes() as processes:
        beats = start_beats(processes, 2, environment, tmp_path)
        wait_for_sends(broker, 3, beats)
        senders = {record["pid"] for record in sent(broker)}
        assert len(senders) == 1, f"more than one beat sent: {sent(broker)}\n" + logs(*beats)
        leader = next(beat for beat in beats if beat.pid in senders)
        survivor = next(beat for beat in beats if beat is not leader)
        assert wait_until(lambda: "standing by" in survivor.log_text(), timeout=10, alive=beats), (
            logs(survivor)
        )

        def written() -> bool:
            ticks = counts(broker)
            state = database_state(entries)
            return all(state[name][1] == ticks[name] for name in ENTRIES)

        # django-celery-beat's own scheduler would write every three minutes.
        assert wait_until(written, timeout=5, interval=0.02, alive=beats), (
            f"the database does not follow the ticks: {database_state(entries)} "
            f"{counts(broker)}\n" + logs(leader)
        )

        # Kill the leader just after it sent both entries' ticks of a round, so it is between
        # rounds: a SIGKILL between recording a tick and publishing it would lose a tick that
        # the records (and so the run count) count as sent.
        before = counts(broker)
        assert wait_until(
            lambda: all(counts(broker)[name] > before[name] for name in ENTRIES),
            timeout=5,
            interval=0.002,
            alive=beats,
        ), logs(leader)
        leader.kill()
        killed_at = time.time()
        wait_for_sends(broker, 3, [survivor], after=killed_at)
        # Graceful stop: the beat writes what it sent and releases the lease.
        survivor.send_signal(signal.SIGTERM)
        assert wait_until(lambda: not survivor.is_running, timeout=15), logs(survivor)
        assert "released lease" in survivor.log_text(), logs(survivor)

    records = sent(broker)
    assert {record["pid"] for record in records} == {leader.pid, survivor.pid}
    for record in records:
        expected = leader.pid if record["at"] < killed_at else survivor.pid
        assert record["pid"] == expected, f"{record} sent by the wrong beat (kill {killed_at})"
    takeover = min(r["at"] for r in records if r["pid"] == survivor.pid) - killed_at
    assert takeover <= LEASE_TTL + LATE, f"first send {takeover:.3f}s after the kill"
    gaps = {}
    for name in ENTRIES:
        times = [record["at"] for record in sent(broker, name)]
        gaps[name] = [later - earlier for earlier, later in itertools.pairwise(times)]
        assert min(gaps[name]) >= INTERVAL - EARLY, f"{name}: a tick sent twice: {gaps[name]}"
        assert max(gaps[name]) <= LEASE_TTL + INTERVAL + LATE, f"{name}: gaps {gaps[name]}"

    state = database_state(entries)
    for name in ENTRIES:
        last_run_at, total_run_count = state[name]
        assert total_run_count == len(sent(broker, name)), (name, state, counts(broker))
        assert last_run_at is not None
        last_sent = sent(broker, name)[-1]["at"]
        # last_run_at is taken when the tick is cleared to go, just before it is published.
        assert 0 <= last_sent - last_run_at.timestamp() <= LATE, (name, last_run_at, last_sent)
    print(
        f"\ndjango-celery-beat, lease ttl {LEASE_TTL}s, interval {INTERVAL}s: first send of "
        f"the survivor {takeover:.3f}s after the SIGKILL; largest gaps "
        f"{ {name: round(max(values), 3) for name, values in gaps.items()} }; ticks "
        f"{dict(counts(broker))}"
    )


def in_process_app(broker: RedisServer, locks: RedisNodes) -> Celery:
    """An app for schedulers driven in this process."""
    app = Celery("django_beat_in_process", set_as_current=False)
    app.conf.update(
        broker_url=broker.url,
        broker_connection_retry_on_startup=True,
        timezone="UTC",
        result_expires=None,  # no celery.backend_cleanup row
        redlock_urls=locks.urls,
        redlock_node_timeout=0.3,
        redlock_beat_lease_ttl=LEASE_TTL,
    )
    return app


def queued(broker: RedisServer) -> int:
    """How many task messages wait in the broker's default queue."""
    with broker.client() as client:
        return int(client.llen("celery"))


def test_new_leader_continues_from_the_newer_of_row_and_record(
    broker: RedisServer, locks: RedisNodes, entries: Any
) -> None:
    """Beat B loads the rows while A leads; A sends both entries and stops. Then one row loses
    A's write (as when a leader dies before writing) and the other is changed to a newer state.
    B takes the lease: it reads the rows again, continues the first from A's record (and writes
    it back) and the second from the row, and sends nothing."""
    from django_celery_beat.models import IntervalSchedule

    from celery_redlock.beat import LeaderDatabaseScheduler

    lagging, edited = ENTRIES
    IntervalSchedule.objects.update(every=3600)  # sent once, then not due again in the test
    app = in_process_app(broker, locks)
    long_ago = datetime.now().astimezone() - timedelta(hours=2)
    entries.objects.update(last_run_at=long_ago)

    first = LeaderDatabaseScheduler(app=app)
    second = LeaderDatabaseScheduler(app=app)  # holds the rows as they are now
    try:
        passes = [first.tick() for _ in range(4)]
        assert first.is_leader
        assert queued(broker) == 2, passes
        sent_state = database_state(entries)
        assert all(sent_state[name][1] == 1 for name in ENTRIES), sent_state
    finally:
        first.close()
    entries.objects.filter(name=lagging).update(last_run_at=long_ago, total_run_count=0)
    edited_at = datetime.now().astimezone()
    entries.objects.filter(name=edited).update(last_run_at=edited_at, total_run_count=7)

    try:
        delay = second.tick()
        assert second.is_leader
        assert delay > 0
        assert queued(broker) == 2, "the new leader sent a tick the old one had sent"
        state = database_state(entries)
        assert state[lagging] == sent_state[lagging], "the record was not written to the row"
        assert state[edited] == (edited_at, 7), "the newer row was overwritten by the record"
        schedule = second.schedule
        assert schedule[lagging].total_run_count == 1
        assert schedule[edited].total_run_count == 7
        assert not any(schedule[name].is_due().is_due for name in ENTRIES)
    finally:
        second.close()


def test_a_change_seen_while_the_heap_is_built_sends_no_tick_twice(
    broker: RedisServer, locks: RedisNodes, entries: Any
) -> None:
    """Another beat's write (a beat starting writes its default rows) that the leader sees while
    it rebuilds its heap, after the pass's own check for changes: the pass sends from the rows
    read then, and the next pass rebuilds the heap from the schedule again. The sent tick must
    be in that schedule, or it is due again and sent twice (it was, once in CI)."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTasks

    from celery_redlock.beat import LeaderDatabaseScheduler

    class WrittenToWhileBuildingTheHeap(LeaderDatabaseScheduler):  # type: ignore[misc]
        write_on_next_build = False

        def populate_heap(self, *args: Any, **kwargs: Any) -> None:
            if self.write_on_next_build:
                self.write_on_next_build = False
                PeriodicTasks.update_changed()
            super().populate_heap(*args, **kwargs)

    IntervalSchedule.objects.update(every=3600)  # each entry is due once in the test
    entries.objects.update(last_run_at=datetime.now().astimezone() - timedelta(hours=2))
    scheduler = WrittenToWhileBuildingTheHeap(app=in_process_app(broker, locks))
    try:
        scheduler.tick()  # takes the lease and sends one entry
        assert scheduler.is_leader
        assert queued(broker) == 1
        PeriodicTasks.update_changed()  # seen by the next pass's check: it rebuilds the heap
        scheduler.write_on_next_build = True  # seen while it does: the rows are read again
        passes = [scheduler.tick() for _ in range(4)]
        assert not scheduler.write_on_next_build
        assert queued(broker) == 2, f"a tick was sent twice: {passes}"
        state = database_state(entries)
        assert all(state[name][1] == 1 for name in ENTRIES), state
    finally:
        scheduler.close()


def test_a_row_write_that_failed_sends_no_tick_twice_when_the_rows_are_read_again(
    broker: RedisServer,
    locks: RedisNodes,
    entries: Any,
    database: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The leader's write of a tick's state fails (the database is locked by another writer):
    django-celery-beat logs it and drops the write. When the rows are read again (a change, or
    its sync every five minutes), the row is behind the tick sent; the leader continues the
    entry from the tick it recorded, writes that to the row, and sends nothing twice."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTasks

    from celery_redlock.beat import LeaderDatabaseScheduler

    IntervalSchedule.objects.update(every=3600)  # each entry is due once in the test
    entries.objects.update(last_run_at=datetime.now().astimezone() - timedelta(hours=2))
    before = database_state(entries)
    # Connections made from now on wait 50 ms for a lock another connection holds, not 20 s.
    options = connections["default"].settings_dict["OPTIONS"]
    monkeypatch.setitem(options, "timeout", 0.05)
    connections["default"].close()
    scheduler = LeaderDatabaseScheduler(app=in_process_app(broker, locks))
    blocker = sqlite3.connect(database, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # others read, no one else writes
        passes = [scheduler.tick() for _ in range(3)]
        assert scheduler.is_leader
        assert queued(broker) == 2, passes
        assert database_state(entries) == before, "the writes were meant to fail"
        blocker.execute("COMMIT")
        PeriodicTasks.update_changed()  # the next pass reads the rows again
        passes += [scheduler.tick() for _ in range(3)]
        assert queued(broker) == 2, f"a tick was sent twice: {passes}"
        state = database_state(entries)
        assert all(state[name][1] == 1 for name in ENTRIES), state
    finally:
        blocker.close()
        scheduler.close()
        connections["default"].close()  # the next one waits 20 s again


class ShutdownSignal:
    """A trace function (`sys.settrace`) that does what beat's SIGTERM handler does (the
    scheduler's ``close()``, then ``SystemExit``) at the first instruction of the tick-state
    write (`TICK_WRITE`) where a signal handler can run (`signal_can_land`) and it never did
    before. ``landed`` lists where it did, in order."""

    def __init__(
        self, scheduler: Any, codes: frozenset[CodeType], done: set[tuple[CodeType, int]]
    ) -> None:
        self.scheduler = scheduler
        self.codes = codes
        self.landed: list[tuple[str, int]] = []
        self.done = done  # where it landed in earlier runs, shared with them

    def on_call(self, frame: FrameType, event: str, argument: Any) -> Any:
        if frame.f_code not in self.codes:
            return None
        frame.f_trace_opcodes = True
        return InstructionTracer(self.at)

    def at(self, frame: FrameType, previous: int | None) -> None:
        where = (frame.f_code, frame.f_lasti)
        if where in self.done or not signal_can_land(frame.f_code, previous, frame.f_lasti):
            return
        self.done.add(where)
        self.landed.append((frame.f_code.co_qualname, frame.f_lineno))
        sys.settrace(None)
        self.scheduler.close()  # calls from a trace function are not traced
        raise SystemExit


def tick_write_codes() -> frozenset[CodeType]:
    """The code that writes a sent tick's state: Celery's sync after a publish and the leader
    database scheduler's sync and row write."""
    from celery.beat import Scheduler

    from celery_redlock.beat.django import LeaderDatabaseScheduler, LeaderModelEntry

    functions = [Scheduler._do_sync, LeaderDatabaseScheduler.sync, LeaderModelEntry.save]
    return frozenset(function.__code__ for function in functions)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="reads CPython 3.11's exception table")
def test_a_shutdown_at_any_point_of_a_ticks_write_leaves_the_rows_right(
    broker: RedisServer, locks: RedisNodes, entries: Any
) -> None:
    """Beat's SIGTERM handler writes the schedule (the scheduler's ``close()``) and raises
    SystemExit wherever the main thread is; right after a publish that is often the write of the
    tick's state (the two-beat test above caught it once in CI: a row one tick behind). At every
    instruction of that write where a signal handler can run, the shutdown leaves each row's
    ``total_run_count`` equal to the ticks sent and its ``last_run_at`` that of the last."""
    from django_celery_beat.models import IntervalSchedule

    from celery_redlock.beat import LeaderDatabaseScheduler

    IntervalSchedule.objects.update(every=3600)  # each entry is due once in the test
    app = in_process_app(broker, locks)
    codes = tick_write_codes()
    done: set[tuple[CodeType, int]] = set()
    landed: list[tuple[str, int]] = []
    for attempt in range(1000):
        # A lease of its own each time: no records of the ticks sent before.
        app.conf.redlock_beat_lease_name = f"shutdown-{attempt}"
        long_ago = datetime.now().astimezone() - timedelta(hours=2)
        entries.objects.update(last_run_at=long_ago, total_run_count=0)
        with broker.client() as client:
            client.delete("celery")
        scheduler = LeaderDatabaseScheduler(app=app)
        shutdown = ShutdownSignal(scheduler, codes, done)
        sys.settrace(shutdown.on_call)
        try:
            for _ in range(4):
                scheduler.tick()
        except SystemExit:
            pass
        finally:
            sys.settrace(None)
        landed += shutdown.landed
        if not shutdown.landed:
            scheduler.close()
        sent_names = Counter(published_names(broker))
        state = database_state(entries)
        for name in ENTRIES:
            count = state[name][1]
            assert count == sent_names[name], f"after a shutdown at {shutdown.landed}: {state}"
            assert (state[name][0] == long_ago) == (count == 0), (shutdown.landed, state)
        if not shutdown.landed:
            break
    assert len(landed) >= 15, landed  # 17 in CPython 3.11


def published_names(broker: RedisServer) -> list[str]:
    """The periodic task name of each message in the broker's default queue."""
    with broker.client() as client:
        raw = client.lrange("celery", 0, -1)
    return [json.loads(item)["headers"]["periodic_task_name"] for item in raw]


def test_a_row_is_never_written_back_to_an_older_state(entries: Any) -> None:
    """An entry saved with an older ``last_run_at`` than its row's (a leader paused past its
    lease, writing late) leaves the row alone; a newer one is written; a disabled row is not."""
    from celery_redlock.beat.django import LeaderModelEntry

    app = Celery("django_beat_rows", set_as_current=False, config_source={"timezone": "UTC"})
    name = ENTRIES[0]
    now = datetime.now().astimezone()
    entries.objects.filter(name=name).update(last_run_at=now, total_run_count=5)

    stale = LeaderModelEntry(entries.objects.get(name=name), app=app)
    stale.model.last_run_at, stale.model.total_run_count = now - timedelta(seconds=3), 3
    stale.save()
    assert database_state(entries)[name] == (now, 5)

    newer = LeaderModelEntry(entries.objects.get(name=name), app=app)
    newer.model.last_run_at, newer.model.total_run_count = now + timedelta(seconds=1), 6
    newer.save()
    assert database_state(entries)[name] == (now + timedelta(seconds=1), 6)

    entries.objects.filter(name=name).update(enabled=False, last_run_at=None)
    newer.model.last_run_at, newer.model.total_run_count = now + timedelta(seconds=2), 7
    newer.save()
    assert database_state(entries)[name] == (None, 6)


def test_without_django_celery_beat_the_scheduler_names_the_extra() -> None:
    """celery_redlock.beat imports without Django's ORM; asking it for LeaderDatabaseScheduler
    where django-celery-beat is missing raises ImportError naming it and the extra to install."""
    code = (
        "import sys\n"
        "sys.modules['django_celery_beat'] = None\n"
        "import celery_redlock.beat as beat\n"
        "assert 'django.db' not in sys.modules, 'celery_redlock.beat imported the ORM'\n"
        "assert beat.LeaderScheduler\n"
        "try:\n"
        "    beat.LeaderDatabaseScheduler\n"
        "except ImportError as error:\n"
        "    print(error)\n"
        "else:\n"
        "    sys.exit('no ImportError')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TESTS_DIRECTORY.parent,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIRECTORY.parent)},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "celery-redlock[django]" in result.stdout, result.stdout
    assert "django_celery_beat" in result.stdout, result.stdout
