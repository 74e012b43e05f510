"""Beat jobs that must not overlap, with real ``celery beat`` and ``celery worker`` processes.

- A periodic task whose runs outlast its interval never overlaps itself: the ticks that arrive
  while a run is under way are skipped.
- Two beat processes running by mistake send every tick twice; ``lock_hold`` keeps each tick
  from running twice, while the same job without ``lock_hold`` runs twice per tick.

The app is `celery_apps.beat_app`; the broker, result back-end and run records live on a
harness Redis node of their own, the locks on three other harness nodes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

from celery_apps import beat_app
from celery_apps.subprocesses import (
    BeatProcess,
    Recorder,
    WorkerProcess,
    app_environment,
    celery_processes,
    control_app,
)
from conftest import MakeRedisNodes
from redlock_support import wait_until

APP_MODULE = "celery_apps.beat_app"
BEAT_DISTANCE = 0.6
"""Seconds between the two beats' ticks of one slot: longer than a run, shorter than the hold."""


def _logs(*processes: WorkerProcess | BeatProcess) -> str:
    return "\n".join(f"--- {p.label} ---\n{p.log_tail()}" for p in processes)


def test_periodic_task_outlasting_its_interval_never_overlaps(
    redis_nodes: MakeRedisNodes, tmp_path: Path
) -> None:
    """Every second a tick, each run 2.5 s: runs never overlap, ticks in between are skipped."""
    harness, locks = redis_nodes(1), redis_nodes(3)
    broker = harness[0]
    environment = app_environment(broker, locks, CRL_BEAT_SCENARIO="overlap")
    recorder = Recorder(broker.url)
    with celery_processes() as processes:
        worker = WorkerProcess(APP_MODULE, "beatslow", environment, concurrency=2)
        processes.append(worker.start())
        worker.wait_ready(control_app(broker))
        beat = BeatProcess(APP_MODULE, tmp_path / "schedule", environment)
        processes.append(beat.start())

        # Two full runs take at least 2 x 2.5 s; the ticks between them must be skipped.
        assert wait_until(
            lambda: recorder.count("slow:runs") >= 2, timeout=30, interval=0.02, alive=processes
        ), _logs(worker, beat)
        beat.check_alive()
        worker.check_alive()

    started = recorder.read("slow:started")
    runs = {run["start"]: run for run in recorder.read("slow:runs")}
    spans = sorted((entry["start"], runs.get(entry["start"], {}).get("end")) for entry in started)
    for (_, previous_end), (start, _) in itertools.pairwise(spans):
        assert previous_end is not None, f"a run was still going when the next began: {spans}"
        assert start >= previous_end, f"runs overlapped: {spans}"
    duplicates = [d for d in recorder.read("duplicates") if d["task"] == "beat.slow"]
    deliveries = [d for d in recorder.read("deliveries") if d["task"] == "beat.slow"]
    assert duplicates, f"no tick was skipped: {deliveries}"
    assert {d["policy"] for d in duplicates} == {"skip"}
    # Every delivery either ran or was skipped as a duplicate, but for the (at most two, one
    # per pool child) that were still being decided when the processes were stopped.
    decided = len(started) + len(duplicates)
    assert decided <= len(deliveries) <= decided + 2, (deliveries, started, duplicates)
    print(
        f"\nbeat overlap: {len(deliveries)} ticks delivered, {len(started)} runs, "
        f"{len(duplicates)} skipped; gaps between runs "
        f"{[round(b[0] - a[1], 2) for a, b in itertools.pairwise(spans) if a[1]]}"
    )


def test_two_beats_lock_hold_runs_each_tick_once(
    redis_nodes: MakeRedisNodes, tmp_path: Path
) -> None:
    """Two beat processes send every tick twice, the second copy `BEAT_DISTANCE` seconds after
    the first, when the first run (0.1 s) is long over: with lock_hold each tick runs once;
    the same task without lock_hold (the control) runs twice per tick."""
    harness, locks = redis_nodes(1), redis_nodes(3)
    broker = harness[0]
    recorder = Recorder(broker.url)
    with celery_processes() as processes:
        environment = app_environment(broker, locks, CRL_BEAT_SCENARIO="double")
        worker = WorkerProcess(APP_MODULE, "beatdouble", environment, concurrency=3)
        processes.append(worker.start())
        worker.wait_ready(control_app(broker))
        for index, offset in enumerate((0.0, BEAT_DISTANCE)):
            offset_environment = environment | {"CRL_BEAT_OFFSET": str(offset)}
            beat = BeatProcess(APP_MODULE, tmp_path / f"schedule-{index}", offset_environment)
            processes.append(beat.start())

        def doubled_slots() -> list[int]:
            """Slots in which both beats' ticks of the control task ran."""
            slots = Counter(
                beat_app.slot_of(run["start"]) for run in recorder.read("fast_unheld:runs")
            )
            return sorted(slot for slot, count in slots.items() if count >= 2)

        assert wait_until(
            lambda: len(doubled_slots()) >= 3, timeout=40, interval=0.02, alive=processes
        ), _logs(*processes)
        # The last slot's held run may still be under way: let it finish.
        wait_until(
            lambda: recorder.count("fast_held:runs") == recorder.count("fast_held:started"),
            timeout=5,
            interval=0.02,
        )
        for process in processes:
            process.check_alive()

    unheld = Counter(beat_app.slot_of(run["start"]) for run in recorder.read("fast_unheld:runs"))
    held_runs = recorder.read("fast_held:runs")
    held = Counter(beat_app.slot_of(run["start"]) for run in held_runs)
    deliveries = Counter(
        beat_app.slot_of(d["at"])
        for d in recorder.read("deliveries")
        if d["task"] == "beat.fast_held"
    )
    duplicates = [d for d in recorder.read("duplicates") if d["task"] == "beat.fast_held"]
    doubled = doubled_slots()

    # Both beats really ticked: without lock_hold the task ran twice in those slots (its first
    # run was over when the second tick came), and the held task was delivered twice in them.
    assert len(doubled) >= 3, unheld
    assert all(deliveries[slot] >= 2 for slot in doubled), (deliveries, doubled)
    # ... yet each tick of the held task ran exactly once; the second copy was skipped.
    assert all(count == 1 for count in held.values()), f"a tick ran twice: {held}"
    assert all(held[slot] == 1 for slot in doubled), f"a tick did not run: {held}, {doubled}"
    assert len(duplicates) >= len(doubled), duplicates
    assert {d["policy"] for d in duplicates} == {"skip"}
    # Runs are at least lock_hold apart (end of one to start of the next).
    spans = sorted((run["start"], run["end"]) for run in held_runs)
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    assert all(gap >= beat_app.HOLD_SECONDS for gap in gaps), gaps
    print(
        f"\ntwo beats: {len(doubled)} doubled slots; runs per slot without lock_hold "
        f"{sorted(unheld.values())}, with lock_hold {sorted(held.values())}; "
        f"{len(duplicates)} held duplicates skipped; gaps {[round(gap, 2) for gap in gaps]}"
    )
