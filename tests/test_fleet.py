"""The fleet test: real prefork workers, five lock nodes, duplicates, and every fault at once.

Run alone with ``pytest -m fleet``; CI runs it in the nox ``topology`` session (the default
suite leaves it out).

`test_fleet_under_lock_node_faults`: three ``celery worker -P prefork -c 2`` processes work
through duplicate submissions on a dozen keys (``on_duplicate="retry"``) while the test

1. pauses a minority of the lock nodes (SIGSTOP) and resumes them;
2. kills one node (SIGKILL) and restarts it empty only after the lock ttl (delayed restart);
3. SIGKILLs a pool child in the middle of a run;
4. pauses a majority of the lock nodes for a while, submitting more work meanwhile.

Every run records its start and end (`celery_apps.fleet_app`). The test asserts that no two
runs of one key overlapped; that every submission ran to completion exactly once, except the
one whose process was killed; that nothing ran while the majority was away and nothing
submitted meanwhile was dropped; that the killed child's lock was freed at once (not after its
ttl); and that no lock remains one ttl after the last run.

A broker redelivering past ``visibility_timeout`` and a killed child's requeued message are
tested, more cheaply, in tests/test_celery_prefork.py and tests/test_guarantees_prefork.py.
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from celery import Celery
from celery_apps import fleet_app
from celery_apps.subprocesses import (
    Recorder,
    WorkerProcess,
    app_environment,
    celery_processes,
    control_app,
)
from celery_apps.support import lock_keys
from conftest import MakeRedisNodes
from redlock_support import values_on, wait_until

pytestmark = pytest.mark.fleet

APP_MODULE = "celery_apps.fleet_app"
KEYS = [f"key-{index:02d}" for index in range(12)]
TTL = fleet_app.FLEET_TTL


def _logs(workers: Sequence[WorkerProcess]) -> str:
    return "\n".join(f"--- {worker.hostname} ---\n{worker.log_tail(40)}" for worker in workers)


@dataclass
class Submission:
    """One call the test sent."""

    id: str
    task: str
    key: str
    wave: str
    seconds: float
    sent: float = field(default_factory=time.time)


@dataclass
class Fleet:
    """The test's view of the fleet: what it sent and when it did what."""

    app: Celery
    submissions: dict[str, Submission] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)

    def submit(self, task: str, key: str, wave: str, seconds: float) -> Submission:
        submission = Submission(f"{wave}-{uuid.uuid4().hex[:8]}", task, key, wave, seconds)
        self.submissions[submission.id] = submission
        self.app.send_task(task, args=(key, submission.id, seconds))
        return submission

    def wave(self, wave: str, copies: int, seconds: float) -> None:
        """``copies`` submissions of ``fleet.work`` on every key, one after the other."""
        for key, _ in itertools.product(KEYS, range(copies)):
            self.submit("fleet.work", key, wave, seconds)

    def mark(self, event: str) -> float:
        self.times[event] = time.time()
        return self.times[event]


@pytest.mark.timeout(240)
def test_fleet_under_lock_node_faults(redis_nodes: MakeRedisNodes) -> None:
    began = time.monotonic()
    broker = redis_nodes(1)[0]
    locks = redis_nodes(5)
    recorder = Recorder(broker.url)
    environment = app_environment(broker, locks)
    fleet = Fleet(control_app(broker))
    with celery_processes() as processes:
        workers = [
            WorkerProcess(APP_MODULE, f"fleet{index}", environment, concurrency=2)
            for index in range(1, 4)
        ]
        for worker in workers:
            processes.append(worker.start())
        for worker in workers:
            worker.wait_ready(fleet.app)
        started_up = time.monotonic() - began

        # 1. A minority (2 of 5) hangs while three duplicates per key are worked through.
        fleet.wave("a", copies=3, seconds=0.8)
        fleet.mark("minority paused")
        locks[0].pause()
        locks[1].pause()
        time.sleep(2.5)
        locks[0].resume()
        locks[1].resume()
        fleet.mark("minority resumed")
        time.sleep(2.5)  # the workers' back-off from the hung nodes runs out

        # 2. One node dies; it comes back empty only after the lock ttl (delayed restart).
        locks[2].kill()
        fleet.mark("node killed")

        # 3. A pool child is killed in the middle of a run holding a 30 s lock; a duplicate
        #    waits (on_duplicate="retry") for that lock. More duplicates keep the fleet busy.
        victim = fleet.submit("fleet.long_work", "victim", "victim", seconds=8.0)
        follower = fleet.submit("fleet.long_work", "victim", "follower", seconds=0.5)
        fleet.wave("b", copies=2, seconds=0.8)
        assert wait_until(
            lambda: any(e["submission"] == victim.id for e in recorder.read("started")),
            timeout=30,
            interval=0.02,
            alive=workers,
        ), _logs(workers)
        victim_run = next(e for e in recorder.read("started") if e["submission"] == victim.id)
        children = set().union(*(worker.child_pids() for worker in workers))
        assert victim_run["pid"] in children, (victim_run, children)
        time.sleep(max(0.0, victim_run["start"] + 1.0 - time.time()))  # mid-run
        live = [locks[index] for index in (0, 1, 3, 4)]
        assert sum(v is not None for v in values_on(live, victim_run["lock"])) >= 3
        os.kill(victim_run["pid"], signal.SIGKILL)
        killed_at = fleet.mark("child killed")
        freed = wait_until(
            lambda: all(v is None for v in values_on(live, victim_run["lock"])),
            timeout=fleet_app.LONG_TTL,
            interval=0.01,
        )
        freed_after = time.time() - killed_at
        assert freed, "the killed child's lock was never freed"

        time.sleep(max(0.0, fleet.times["node killed"] + TTL + 0.5 - time.time()))
        locks[2].start()  # same port, empty
        fleet.mark("node restarted")
        time.sleep(0.5)

        # 4. A majority (3 of 5) hangs while longer runs are under way (they cannot extend
        #    their locks: they stop before the validity runs out, and retry); more duplicates
        #    are submitted meanwhile.
        fleet.wave("c", copies=1, seconds=3.0)
        time.sleep(1.0)
        fleet.mark("majority paused")
        for index in (0, 1, 2):
            locks[index].pause()
        fleet.wave("d", copies=2, seconds=0.5)
        # At least 3 s, and until a run has met the outage: on a loaded host the first slot may
        # free up (and try a lock) later than that.
        paused_at = fleet.times["majority paused"]
        noticed = wait_until(
            lambda: any(u["at"] >= paused_at for u in recorder.read("unavailable")),
            timeout=30,
            interval=0.1,
            alive=workers,
        )
        time.sleep(max(0.0, paused_at + 3.0 - time.time()))
        for index in (0, 1, 2):
            locks[index].resume()
        fleet.mark("majority resumed")
        assert noticed, "no run met the majority outage within 30 s"

        # Everything but the killed run finishes; then one ttl later no lock is left.
        expected = set(fleet.submissions) - {victim.id}

        def all_done() -> bool:
            done = {r["submission"] for r in recorder.read("runs") if r["outcome"] == "done"}
            return expected <= done

        assert wait_until(all_done, timeout=90, interval=0.2, alive=workers), _logs(workers)
        fleet.mark("all done")
        last_end = max(run["end"] for run in recorder.read("runs"))
        time.sleep(max(0.0, last_end + TTL - time.time()))
        leftovers = lock_keys(locks)
        fleet.mark("locks checked")
        for worker in workers:
            worker.check_alive()
        freed_log = "\n".join(worker.log_text() for worker in workers)

    # -- what happened ---------------------------------------------------------------------
    started = recorder.read("started")
    runs = recorder.read("runs")
    ended = {(run["id"], run["retries"], run["start"]): run for run in runs}
    times = fleet.times

    # No two runs of one key overlapped (the killed run lasted until the kill).
    spans: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for entry in started:
        run = ended.get((entry["id"], entry["retries"], entry["start"]))
        if run is None:
            assert entry["submission"] == victim.id, f"a run never ended: {entry}"
            end = killed_at
        else:
            end = run["end"]
        spans[entry["key"]].append((entry["start"], end, entry["submission"]))
    for key, key_spans in spans.items():
        key_spans.sort()
        for previous, current in itertools.pairwise(key_spans):
            assert current[0] >= previous[1], f"runs of {key} overlapped: {previous} {current}"

    # Every submission ran to completion exactly once; the killed one started once and never
    # again (its message was acknowledged; the kill is its end).
    done = Counter(run["submission"] for run in runs if run["outcome"] == "done")
    assert {s: n for s, n in done.items() if n != 1} == {}, "a submission completed twice"
    assert set(done) == expected
    assert [e["submission"] for e in started].count(victim.id) == 1
    assert done[follower.id] == 1

    # Runs cut short because their lock was about to run out happened only while the
    # majority was away (their locks could not be extended), and ended before it came back.
    lost = [run for run in runs if run["outcome"] == "lock-lost"]
    for run in lost:
        assert times["majority paused"] <= run["end"] <= times["majority resumed"] + 1.0, run

    # The fleet kept working while a minority hung and while a node was down.
    assert any(
        times["minority paused"] < e["start"] < times["minority resumed"] for e in started
    ), "nothing ran while a minority of lock nodes hung"
    assert any(times["node killed"] < e["start"] < times["node restarted"] for e in started)

    # Nothing started while the majority was away (a lock acquired just before the pause may
    # start its body a moment later); nothing submitted meanwhile was dropped, and it saw the
    # outage (lock_unavailable, policy "retry").
    outage = (times["majority paused"] + 0.5, times["majority resumed"])
    during = [e for e in started if outage[0] < e["start"] < outage[1]]
    assert during == [], f"runs started without a quorum: {during}"
    wave_d = [s for s in fleet.submissions.values() if s.wave == "d"]
    first_start = {}
    for entry in started:
        first_start.setdefault(entry["submission"], entry["start"])
    assert all(first_start[s.id] >= times["majority resumed"] for s in wave_d)
    unavailable = [
        u for u in recorder.read("unavailable") if times["majority paused"] <= u["at"] <= outage[1]
    ]
    assert unavailable, "no run noticed the majority outage"
    assert {u["policy"] for u in unavailable} == {"retry"}

    # The killed child's lock was freed by the worker's main process, long before its ttl.
    assert freed_after < fleet_app.LONG_TTL / 3, freed_after
    assert "whose process was lost" in freed_log
    # (Its duplicate ran too, as checked above; when is up to its retry back-off.)
    follower_start = first_start[follower.id]

    # One ttl after the last run, no lock is left on any node.
    assert all(not keys for keys in leftovers), leftovers

    waits = [first_start[s.id] - times["majority resumed"] for s in wave_d]
    # The pool processes that waited for the nodes (no retries spent) start at their return.
    first_back = min(e["start"] for e in started if e["start"] >= times["majority resumed"])
    duplicates = Counter(d["policy"] for d in recorder.read("duplicates"))
    deliveries = len(recorder.read("deliveries"))
    print(
        f"\nfleet: {len(fleet.submissions)} submissions on {len(KEYS)} keys + victim, "
        f"{len(started)} runs started ({len(lost)} cut short by lock loss during the majority "
        f"outage), {deliveries} deliveries, duplicates by policy {dict(duplicates)}, "
        f"{len(unavailable)} runs found no quorum during the outage\n"
        f"  start-up {started_up:.1f}s; killed child's lock freed {freed_after:.2f}s after the "
        f"kill (ttl {fleet_app.LONG_TTL:.0f}s); its duplicate started "
        f"{follower_start - killed_at:.2f}s after the kill\n"
        f"  the first run after the {outage[1] - times['majority paused']:.1f}s majority outage "
        f"started {first_back - times['majority resumed']:.2f}s after it ended; the wave "
        f"submitted during it started {min(waits):.2f}..{max(waits):.2f}s after it "
        f"(median {statistics.median(waits):.2f}s); all done "
        f"{times['all done'] - times['majority resumed']:.1f}s after it; "
        f"total {time.monotonic() - began:.1f}s"
    )
