"""One beat leader among several ``celery beat`` processes (celery_redlock.beat), for real.

Real ``celery beat`` subprocesses (`celery_apps.leader_app`) on real ``redis-server`` harness
nodes: a broker node where every beat records each task it published (no worker needed), and
three lock nodes holding the lease. Covered:

- three beats: only the lease holder sends, each tick once;
- the leader SIGKILLed (twice in a row): another beat takes over within one lease ttl, no tick is
  sent twice, at most one interval is missed; the fail-over times are printed;
- the leader stopped gracefully (SIGTERM): it releases the lease and a follower takes over at
  once, long before the lease would have expired;
- a majority of lock nodes frozen: the leader stops sending, nobody sends during the outage,
  sending resumes after it;
- `LeaderMixin` on a custom scheduler class;
- in this process: a new leader continues crontab and interval entries from the last recorded
  tick instead of its own stale state; the settings are validated.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab
from celery_apps import leader_app
from celery_apps.subprocesses import (
    BeatProcess,
    CeleryProcess,
    Recorder,
    app_environment,
    celery_processes,
)
from conftest import MakeRedisNodes
from redlock_support import pttls_on, values_on, wait_until

from celery_redlock import ConfigurationError, RedlockSettings
from celery_redlock.beat import LeaderScheduler
from celery_redlock.testing import RedisNodes, RedisServer

APP_MODULE = "celery_apps.leader_app"
LEASE_KEY = "redlock:{" + RedlockSettings.beat_lease_name + "}"
INTERVAL = leader_app.INTERVAL
LEASE_TTL = leader_app.LEASE_TTL
EARLY = 0.2
"""Seconds by which two sends of one interval entry may come closer than the interval without
being a tick sent twice (the time to publish varies; a second copy would come at once)."""
LATE = 0.5
"""Seconds beyond the deadline a measured take-over or gap may need (scheduling, polling)."""


def sent(recorder: Recorder, task: str | None = None) -> list[dict[str, Any]]:
    """The published tasks (of ``task``), in the order they were published."""
    return sorted(
        (r for r in recorder.read(leader_app.SENT) if task is None or r["task"] == task),
        key=lambda record: float(record["at"]),
    )


def lease_holder(locks: RedisNodes | Sequence[RedisServer]) -> int | None:
    """The process id of the beat whose lease a majority of ``locks`` hold, if any."""
    values = [value for value in values_on(locks, LEASE_KEY) if value is not None]
    for value in set(values):
        if values.count(value) * 2 > len(locks):
            return int(json.loads(value.partition("|")[2])["pid"])
    return None


def leader_of(locks: RedisNodes, beats: Sequence[CeleryProcess]) -> CeleryProcess:
    """The beat holding the lease (fails the test when none of ``beats`` does)."""
    holder = lease_holder(locks)
    for beat in beats:
        if beat.pid == holder:
            return beat
    raise AssertionError(f"the lease is held by {holder}, none of the beats:\n" + logs(*beats))


def assert_sent_only_by_leaders(
    records: Sequence[dict[str, Any]], terms: Sequence[tuple[int, float, float]]
) -> None:
    """Every publish was made by a beat during its term as leader: ``terms`` holds (pid, from,
    to) in time.time(); a term starts when its predecessor began to die."""
    for record in records:
        matching = [pid for pid, begin, end in terms if begin <= record["at"] <= end]
        assert record["pid"] in matching, f"{record} was sent outside its sender's term: {terms}"


def wait_for_new_holder(
    locks: RedisNodes, candidates: set[int], timeout: float, alive: Sequence[CeleryProcess]
) -> tuple[int, float]:
    """Wait until one of ``candidates`` holds the lease; (its pid, the time.time() it was seen)."""
    found: list[int] = []

    def taken() -> bool:
        holder = lease_holder(locks)
        if holder in candidates:
            found.append(holder)
            return True
        return False

    assert wait_until(taken, timeout=timeout, interval=0.005, alive=alive), (
        f"none of {candidates} took the lease within {timeout}s:\n" + logs(*alive)
    )
    return found[0], time.time()


def logs(*processes: CeleryProcess) -> str:
    """The end of each process's output, for assertion messages."""
    return "\n".join(f"--- {p!r} ---\n{p.log_tail()}" for p in processes)


def start_beats(
    processes: list[CeleryProcess],
    count: int,
    environment: dict[str, str],
    directory: Path,
    scheduler: str | None = None,
) -> list[CeleryProcess]:
    """Start ``count`` beats, each with its own schedule file; ``scheduler`` is given by ``-S``."""
    beats: list[CeleryProcess] = []
    for index in range(count):
        schedule_file = directory / f"schedule-{index}"
        beat: CeleryProcess
        if scheduler is None:
            beat = BeatProcess(APP_MODULE, schedule_file, environment)
        else:
            arguments = ["beat", "-S", scheduler, "-s", str(schedule_file), "--loglevel", "INFO"]
            beat = CeleryProcess(APP_MODULE, arguments, environment)
        processes.append(beat.start())
        beats.append(beat)
    return beats


def wait_for_sends(
    recorder: Recorder,
    count: int,
    after: float,
    alive: Sequence[CeleryProcess],
    tasks: Sequence[str] = (leader_app.INTERVAL_TASK, leader_app.SLOT_TASK),
    timeout: float = 20.0,
) -> None:
    """Wait until each of ``tasks`` was published ``count`` times after ``after`` (time.time())."""

    def enough() -> bool:
        return all(
            sum(1 for record in sent(recorder, task) if record["at"] > after) >= count
            for task in tasks
        )

    assert wait_until(enough, timeout=timeout, interval=0.05, alive=alive), (
        f"fewer than {count} sends of each of {tasks}: {sent(recorder)}\n" + logs(*alive)
    )


def interval_gaps(records: Sequence[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive sends."""
    times = [float(record["at"]) for record in records]
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def assert_each_tick_once(
    recorder: Recorder, interval_task: str = leader_app.INTERVAL_TASK, at_most_missed: int = 1
) -> None:
    """No tick sent twice and at most ``at_most_missed`` intervals missed in a row: consecutive
    sends of the interval entry are one to ``1 + at_most_missed`` intervals apart, and the slot
    entry is sent once per slot with no more than ``at_most_missed`` slots skipped in a row."""
    gaps = interval_gaps(sent(recorder, interval_task))
    assert gaps, "the interval entry was sent at most once"
    assert min(gaps) >= INTERVAL - EARLY, f"an interval tick was sent twice: gaps {gaps}"
    assert max(gaps) <= (1 + at_most_missed) * INTERVAL + LATE, f"ticks were missed: gaps {gaps}"
    slots = Counter(
        leader_app.slot_of(float(r["at"])) for r in sent(recorder, leader_app.SLOT_TASK)
    )
    assert slots, "the slot entry was never sent"
    assert max(slots.values()) == 1, f"a slot was sent twice: {sorted(slots.items())}"
    ordered = sorted(slots)
    skipped = [later - earlier - 1 for earlier, later in itertools.pairwise(ordered)]
    assert max(skipped, default=0) <= at_most_missed, f"slots were missed: {ordered}"


@pytest.fixture
def broker(redis_nodes: MakeRedisNodes) -> RedisServer:
    """A harness node: broker and the record of what the beats published."""
    return redis_nodes(1)[0]


@pytest.fixture
def locks(redis_nodes: MakeRedisNodes) -> Iterator[RedisNodes]:
    """Three lock nodes; any node a test froze is thawed at teardown."""
    nodes = redis_nodes(3)
    try:
        yield nodes
    finally:
        for server in nodes:
            if server.is_paused:
                server.resume()


def test_only_the_leader_sends_and_each_tick_once(
    broker: RedisServer, locks: RedisNodes, tmp_path: Path
) -> None:
    """Three beats on one schedule: every tick is published once, all by the lease holder."""
    recorder = Recorder(broker.url)
    with celery_processes() as processes:
        beats = start_beats(processes, 3, app_environment(broker, locks), tmp_path)
        wait_for_sends(recorder, 3, 0.0, beats)
        leader = leader_of(locks, beats)
        for beat in beats:
            beat.check_alive()
        followers = [beat for beat in beats if beat is not leader]
        # Read now: the logs go with the processes.
        assert all("standing by" in beat.log_text() for beat in followers), logs(*followers)

    senders = Counter(record["pid"] for record in sent(recorder))
    assert set(senders) == {leader.pid}, f"beats other than the leader {leader.pid} sent: {senders}"
    assert_each_tick_once(recorder, at_most_missed=0)
    print(f"\nthree beats: {dict(senders)} publishes, all by the leader {leader.pid}")


def test_killed_leader_is_replaced_within_one_lease_ttl(
    broker: RedisServer, locks: RedisNodes, tmp_path: Path
) -> None:
    """SIGKILL the leader, then the next one: each time another beat takes the lease within one
    lease ttl, sends nothing before the old leader is dead, continues the schedule from the last
    recorded tick, and no tick is sent twice."""
    recorder = Recorder(broker.url)
    figures: list[str] = []
    terms: list[tuple[int, float, float]] = []
    with celery_processes() as processes:
        beats = start_beats(processes, 3, app_environment(broker, locks), tmp_path)
        wait_for_sends(recorder, 3, 0.0, beats)
        leader, term_began = leader_of(locks, beats), 0.0
        for _ in range(2):
            expires_in = max(pttls_on(locks, LEASE_KEY)) / 1000
            kill_started = time.time()
            leader.kill()
            terms.append((leader.pid, term_began, time.time()))
            beats.remove(leader)
            successor, taken_at = wait_for_new_holder(
                locks, {beat.pid for beat in beats}, timeout=LEASE_TTL + 5, alive=beats
            )
            failover = taken_at - kill_started
            assert failover <= LEASE_TTL + LATE, (
                f"take-over after {failover:.3f}s, lease ttl {LEASE_TTL}s\n" + logs(*beats)
            )
            wait_for_sends(recorder, 3, taken_at, beats)
            interval_sends = sent(recorder, leader_app.INTERVAL_TASK)
            last_old = [r for r in interval_sends if r["pid"] == leader.pid][-1]
            first_new = next(r for r in interval_sends if r["pid"] == successor)
            figures.append(
                f"fail-over {failover:.3f}s (the lease had {expires_in:.3f}s left at the kill); "
                f"interval entry gap across it {first_new['at'] - last_old['at']:.3f}s"
            )
            leader, term_began = next(beat for beat in beats if beat.pid == successor), kill_started
        terms.append((leader.pid, term_began, float("inf")))

    assert_sent_only_by_leaders(sent(recorder), terms)
    assert_each_tick_once(recorder)
    print(f"\nleader SIGKILLed, lease ttl {LEASE_TTL}s, interval {INTERVAL}s:")
    for figure in figures:
        print("  " + figure)


def test_gracefully_stopped_leader_releases_the_lease_at_once(
    broker: RedisServer, locks: RedisNodes, tmp_path: Path
) -> None:
    """SIGTERM the leader (``celery beat -S celery_redlock.beat:LeaderScheduler``): it releases
    the lease on its way out and the follower takes over within a fraction of the lease ttl,
    continuing the schedule without missing or repeating a tick."""
    lease_ttl = 4.0
    recorder = Recorder(broker.url)
    environment = app_environment(broker, locks, CRL_LEASE_TTL=str(lease_ttl))
    with celery_processes() as processes:
        beats = start_beats(
            processes, 2, environment, tmp_path, scheduler="celery_redlock.beat:LeaderScheduler"
        )
        wait_for_sends(recorder, 2, 0.0, beats)
        leader = leader_of(locks, beats)
        follower = next(beat for beat in beats if beat is not leader)
        stopped_at = time.time()
        os.kill(leader.pid, signal.SIGTERM)
        _, taken_at = wait_for_new_holder(
            locks, {follower.pid}, timeout=lease_ttl, alive=[follower]
        )
        leader.wait(10)
        exited_at = time.time()
        assert "released lease" in leader.log_text(), leader.log_tail()
        wait_for_sends(recorder, 2, taken_at, [follower])

    takeover = taken_at - stopped_at
    assert takeover < lease_ttl / 4, f"take-over after {takeover:.3f}s: the lease was not released"
    terms = [(leader.pid, 0.0, exited_at), (follower.pid, stopped_at, float("inf"))]
    assert_sent_only_by_leaders(sent(recorder), terms)
    interval_sends = sent(recorder, leader_app.INTERVAL_TASK)
    last_old = [r for r in interval_sends if r["pid"] == leader.pid][-1]
    first_new = next(r for r in interval_sends if r["pid"] == follower.pid)
    assert_each_tick_once(recorder, at_most_missed=0)
    print(
        f"\nleader stopped (SIGTERM), lease ttl {lease_ttl}s: the follower took over after "
        f"{takeover:.3f}s; interval entry gap across the hand-over "
        f"{first_new['at'] - last_old['at']:.3f}s"
    )


def test_lock_node_majority_outage_stops_sending_until_it_ends(
    broker: RedisServer, locks: RedisNodes, tmp_path: Path
) -> None:
    """Freeze two of the three lock nodes: the leader cannot extend or confirm its lease and
    stops sending; no beat sends while the outage lasts; once the nodes are back one beat leads
    and sending resumes, each tick still sent once."""
    recorder = Recorder(broker.url)
    with celery_processes() as processes:
        beats = start_beats(processes, 2, app_environment(broker, locks), tmp_path)
        wait_for_sends(recorder, 3, 0.0, beats)
        leader = leader_of(locks, beats)
        paused_at = time.time()
        locks[1].pause()
        locks[2].pause()

        def both_noticed() -> bool:
            return "lost lease" in leader.log_text() and all(
                "cannot seek lease" in beat.log_text() for beat in beats
            )

        assert wait_until(both_noticed, timeout=10, interval=0.05, alive=beats), logs(*beats)
        # A window of silence to observe: two more intervals without a quorum.
        time.sleep(2 * INTERVAL)
        locks[1].resume()
        locks[2].resume()
        resumed_at = time.time()
        wait_for_sends(recorder, 2, resumed_at, beats, timeout=20)

    records = sent(recorder)
    during = [r for r in records if paused_at + LEASE_TTL < r["at"] < resumed_at]
    assert not during, f"sent while a majority of lock nodes was down: {during}"
    last_before = max(r["at"] for r in records if r["at"] < resumed_at)
    first_after = min(r["at"] for r in records if r["at"] > resumed_at)
    senders_after = {r["pid"] for r in records if r["at"] > resumed_at}
    assert len(senders_after) == 1, f"two beats sent after the outage: {senders_after}"
    assert_each_tick_once(recorder, at_most_missed=100)
    print(
        f"\nmajority outage: last send {last_before - paused_at:+.3f}s after the nodes froze "
        f"(lease ttl {LEASE_TTL}s); silent for {resumed_at - last_before:.3f}s; first send "
        f"{first_after - resumed_at:.3f}s after they came back (node back-off included)"
    )


def test_mixin_on_a_custom_scheduler(
    broker: RedisServer, locks: RedisNodes, tmp_path: Path
) -> None:
    """`LeaderMixin` in front of a custom scheduler class (in-memory entries, one entry of its
    own): only the leader sends, and after the leader is killed the other beat continues every
    entry, its own included, from the last recorded tick although it kept no state itself."""
    recorder = Recorder(broker.url)
    tasks = (leader_app.INTERVAL_TASK, leader_app.SLOT_TASK, leader_app.CUSTOM_TASK)
    with celery_processes() as processes:
        beats = start_beats(
            processes,
            2,
            app_environment(broker, locks),
            tmp_path,
            scheduler="celery_apps.leader_app:LeaderMemoryScheduler",
        )
        wait_for_sends(recorder, 3, 0.0, beats, tasks)
        leader = leader_of(locks, beats)
        survivor = next(beat for beat in beats if beat is not leader)
        kill_started = time.time()
        leader.kill()
        killed_at = time.time()
        _, taken_at = wait_for_new_holder(
            locks, {survivor.pid}, timeout=LEASE_TTL + 5, alive=[survivor]
        )
        wait_for_sends(recorder, 3, taken_at, [survivor], tasks)

    terms = [(leader.pid, 0.0, killed_at), (survivor.pid, kill_started, float("inf"))]
    assert_sent_only_by_leaders(sent(recorder), terms)
    assert_each_tick_once(recorder)
    assert_each_tick_once(recorder, interval_task=leader_app.CUSTOM_TASK)
    gaps = interval_gaps(sent(recorder, leader_app.CUSTOM_TASK))
    print(f"\ncustom scheduler: custom entry gaps {[round(gap, 3) for gap in gaps]}")


def in_process_app(broker: RedisServer, locks: RedisNodes, schedule: dict[str, Any]) -> Celery:
    """An app for schedulers driven in this process: ``schedule`` is its beat schedule."""
    app = Celery("leader_in_process", set_as_current=False)
    app.conf.update(
        broker_url=broker.url,
        broker_connection_retry_on_startup=True,
        timezone="UTC",
        redlock_urls=locks.urls,
        redlock_node_timeout=0.3,
        redlock_beat_lease_ttl=2.0,
        beat_schedule=schedule,
    )
    return app


def queued(broker: RedisServer) -> int:
    """How many task messages wait in the broker's default queue (no worker consumes them)."""
    with broker.client() as client:
        return int(client.llen("celery"))


def test_new_leader_continues_crontab_and_interval_entries_from_the_last_recorded_tick(
    broker: RedisServer, locks: RedisNodes, tmp_path: Path
) -> None:
    """Leader A sends a crontab and an interval entry and shuts down; beat B, whose own schedule
    file says both are long overdue, takes the lease and sends nothing: it continues from A's
    recorded ticks (same last run, same run count), and both entries are not due again yet."""
    now = Celery(set_as_current=False, config_source={"timezone": "UTC"}).now()
    schedule = {
        # Once an hour, half an hour from now: due when its last run is two hours old.
        "cron": {"task": "leader.cron", "schedule": crontab(minute=(now.minute + 30) % 60)},
        "hourly": {"task": "leader.hourly", "schedule": 3600.0},
    }
    app = in_process_app(broker, locks, schedule)
    stale = now - timedelta(hours=2)

    first = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "a"))
    try:
        for name in schedule:
            first.schedule[name].last_run_at = stale
        passes = [first.tick() for _ in range(4)]
        assert first.is_leader
        assert queued(broker) == 2, passes
        sent_by_first = {
            name: (first.schedule[name].last_run_at, first.schedule[name].total_run_count)
            for name in schedule
        }
    finally:
        first.close()
    assert lease_holder(locks) is None, "the lease was not released"

    second = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "b"))
    try:
        for name in schedule:
            second.schedule[name].last_run_at = stale
        assert all(second.schedule[name].is_due().is_due for name in schedule)
        delay = second.tick()
        assert second.is_leader
        assert delay > 0
        assert queued(broker) == 2, "the new leader sent a tick the old one had sent"
        for name in schedule:
            entry = second.schedule[name]
            assert (entry.last_run_at, entry.total_run_count) == sent_by_first[name]
            assert entry.last_run_at > stale and entry.total_run_count == 1
            assert not entry.is_due().is_due, name
    finally:
        second.close()


def test_lease_settings_are_validated() -> None:
    """Defaults when unset; wrong values are refused with the setting's name and a fix."""
    urls = {"redlock_urls": ["redis://127.0.0.1:1/0"]}
    defaults = RedlockSettings.from_conf(
        {**urls, "redlock_beat_lease_ttl": None, "redlock_beat_lease_name": None}
    )
    assert (defaults.beat_lease_ttl, defaults.beat_lease_name) == (30.0, "celery-beat-leader")
    chosen = {**urls, "redlock_beat_lease_ttl": 5, "redlock_beat_lease_name": "b"}
    assert RedlockSettings.from_conf(chosen).beat_lease_ttl == 5
    for wrong in (0, -1, "30", True, float("nan"), float("inf")):
        with pytest.raises(ConfigurationError, match="redlock_beat_lease_ttl must be a positive"):
            RedlockSettings.from_conf({**urls, "redlock_beat_lease_ttl": wrong})
    for wrong_name in ("", "  ", 7):
        with pytest.raises(ConfigurationError, match="redlock_beat_lease_name must be a non-empty"):
            RedlockSettings.from_conf({**urls, "redlock_beat_lease_name": wrong_name})


def test_lease_ttl_too_short_for_the_lock_nodes_is_refused(tmp_path: Path) -> None:
    """A lease that could never be valid (ttl below one node timeout) stops beat at start-up."""
    app = Celery("leader_settings", set_as_current=False)
    app.conf.update(
        broker_url="redis://127.0.0.1:1/0",
        redlock_urls=["redis://127.0.0.1:1/0"],
        redlock_node_timeout=0.5,
        redlock_beat_lease_ttl=0.4,
    )
    with pytest.raises(ConfigurationError, match=r"redlock_beat_lease_ttl=0.4s leaves no validity"):
        LeaderScheduler(app=app, schedule_filename=str(tmp_path / "s"), lazy=True)


def test_lease_owner_names_host_and_process(
    broker: RedisServer, locks: RedisNodes, tmp_path: Path
) -> None:
    """The lease's owner text (shown to operators) says it is a beat, on which host, which pid."""
    app = in_process_app(broker, locks, {})
    scheduler = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "owner"))
    try:
        scheduler.tick()
        assert scheduler.is_leader
        # A majority holds the lease; the last node's copy may still be on its way.
        values = [value for value in values_on(locks, LEASE_KEY) if value is not None]
        assert len(values) >= 2, values
        owner = json.loads(values[0].partition("|")[2])
        assert owner["role"] == "beat leader" and owner["pid"] == os.getpid() and owner["host"]
    finally:
        scheduler.close()
