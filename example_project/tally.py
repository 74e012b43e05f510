"""What the recorded events say: counts per key, runs, duplicates, waits, bursts and overlaps."""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis


@dataclass(frozen=True)
class Run:
    """One execution of a task body, as recorded by the body itself."""

    id: str
    key: str
    worker: str
    pid: int
    start: float
    end: float
    outcome: str
    attempt: int


@dataclass(frozen=True)
class Duplicate:
    """A run that found its key's lock held: ``policy`` is what it did about it."""

    id: str
    key: str
    policy: str
    worker: str
    pid: int
    t: float
    holder_id: str | None
    attempt: int


@dataclass(frozen=True)
class Wait:
    """A duplicate blocked on the lock from ``start`` to ``end``, when the release woke it:
    ``policy`` ``"wait"``, or ``"coalesce"`` for the pending run of a coalescing key."""

    id: str
    key: str
    worker: str
    start: float
    end: float
    policy: str = "wait"


@dataclass(frozen=True)
class Overlap:
    """Two runs of one key whose intervals intersect: the thing that must never happen."""

    key: str
    first: Run
    second: Run

    @property
    def seconds(self) -> float:
        """How long the two runs overlapped."""
        return min(self.first.end, self.second.end) - self.second.start


@dataclass
class KeyCounts:
    """One row of the table: what happened to the calls of one key (``running``: workers
    running it now)."""

    submitted: int = 0
    ran: int = 0
    skipped: int = 0
    retried: int = 0
    waited: int = 0
    coalesced: int = 0
    running: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Burst:
    """Triggers of one coalescing key sent together (``label``, e.g. ``shop-eu #2``), and how
    many of them ran: the run the burst started, plus at most one follow-up run."""

    label: str
    key: str
    triggers: int
    runs: int


DUPLICATE_COLUMNS = {
    "skip": "skipped",
    "redelivered": "skipped",
    "retry": "retried",
    "wait": "waited",
    "coalesce": "waited",  # the pending run: it waits for the release, then runs
    "coalesced": "coalesced",
}
"""The table column counting each ``lock_duplicate`` policy (others are not counted)."""

WOKEN_POLICIES = ("wait", "coalesce")
"""Duplicates that block until the release wakes them (drawn as waits)."""


class EventReader:
    """Reads a run's event list incrementally (only what was appended since the last read)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client = client
        self.key = key
        self.position = 0

    def read_new(self) -> list[dict[str, Any]]:
        """The events appended since the last call, decoded."""
        raw = self.client.lrange(self.key, self.position, -1)
        self.position += len(raw)
        events = []
        for item in raw:
            try:
                events.append(json.loads(item))
            except ValueError:
                continue
        return events


class Tally:
    """Everything the events of one demo run say, updated as events arrive."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self.keys: list[str] = list(keys)
        self.submitted: dict[str, str] = {}  # task id -> key
        self.submitted_via: Counter[str] = Counter()
        self.burst_of: dict[str, str] = {}  # task id -> burst label
        self.published: Counter[str] = Counter()  # task id -> messages (first, retries, copies)
        self.delivered: Counter[str] = Counter()  # task id -> deliveries finished
        self.runs: list[Run] = []
        self.runs_by_id: dict[str, Run] = {}
        self.running: dict[str, dict[str, Any]] = {}  # task id -> start event
        self.duplicates: list[Duplicate] = []
        self.waits: list[Wait] = []
        self.done: dict[str, str] = {}  # task id -> final Celery state
        self.lost: list[dict[str, Any]] = []
        self._wait_starts: dict[tuple[str, int], Duplicate] = {}

    # -- input ---------------------------------------------------------------------------

    def feed(self, events: Iterable[dict[str, Any]]) -> None:
        """Take recorded events (see `example_project.recording`) into account."""
        for event in events:
            kind = event.get("e")
            key = str(event.get("key", "?"))
            task_id = str(event.get("id"))
            if kind in ("submit", "start", "run", "dup") and key not in self.keys:
                self.keys.append(key)
            if kind == "submit":
                self.submitted[task_id] = key
                self.submitted_via[str(event.get("via"))] += 1
                self.published[task_id] += 1
                if event.get("burst"):
                    self.burst_of[task_id] = str(event["burst"])
            elif kind == "again":
                self.published[task_id] += 1
            elif kind == "start":
                self.running[task_id] = event
            elif kind == "run":
                self.running.pop(task_id, None)
                run = Run(
                    task_id,
                    key,
                    str(event.get("worker")),
                    int(event.get("pid", 0)),
                    float(event["start"]),
                    float(event["end"]),
                    str(event.get("outcome")),
                    int(event.get("attempt", 0)),
                )
                self.runs.append(run)
                self.runs_by_id[task_id] = run
            elif kind == "dup":
                duplicate = Duplicate(
                    task_id,
                    key,
                    str(event.get("policy")),
                    str(event.get("worker")),
                    int(event.get("pid", 0)),
                    float(event["t"]),
                    event.get("holder_id"),
                    int(event.get("attempt", 0)),
                )
                self.duplicates.append(duplicate)
                if duplicate.policy in WOKEN_POLICIES:
                    self._wait_starts[(task_id, duplicate.attempt)] = duplicate
            elif kind == "acquired":
                started = self._wait_starts.pop((task_id, int(event.get("attempt", 0))), None)
                if started is not None:
                    self.waits.append(
                        Wait(
                            task_id,
                            started.key,
                            started.worker,
                            started.t,
                            float(event["t"]),
                            started.policy,
                        )
                    )
            elif kind == "done":
                self.done[task_id] = str(event.get("state"))
                self.delivered[task_id] += 1
            elif kind == "lost":
                self.lost.append(event)

    # -- questions -----------------------------------------------------------------------

    def pending(self) -> list[str]:
        """Submitted task ids with a message not consumed yet: not every publication (the first,
        retries, deferred copies such as a coalescing run's safety copy) was delivered."""
        return [
            task_id
            for task_id in self.submitted
            if self.delivered[task_id] < self.published[task_id]
        ]

    def counts(self) -> dict[str, KeyCounts]:
        """One `KeyCounts` per key, in display order."""
        counts = {key: KeyCounts() for key in self.keys}
        for key in self.submitted.values():
            counts[key].submitted += 1
        for run in self.runs:
            counts[run.key].ran += 1
        for duplicate in self.duplicates:
            column = DUPLICATE_COLUMNS.get(duplicate.policy)
            if column is not None:
                setattr(counts[duplicate.key], column, getattr(counts[duplicate.key], column) + 1)
        for event in self.running.values():
            counts[str(event.get("key"))].running.append(str(event.get("worker")))
        return counts

    def totals(self) -> KeyCounts:
        """The sum of every key's counts."""
        total = KeyCounts()
        for counts in self.counts().values():
            total.submitted += counts.submitted
            total.ran += counts.ran
            total.skipped += counts.skipped
            total.retried += counts.retried
            total.waited += counts.waited
            total.coalesced += counts.coalesced
            total.running += counts.running
        return total

    def overlaps(self) -> list[Overlap]:
        """Pairs of runs of the same key whose [start, end] intervals intersect."""
        found = []
        by_key: dict[str, list[Run]] = defaultdict(list)
        for run in self.runs:
            by_key[run.key].append(run)
        for key, runs in by_key.items():
            runs.sort(key=lambda run: run.start)
            latest: Run | None = None
            for run in runs:
                if latest is not None and run.start < latest.end:
                    found.append(Overlap(key, latest, run))
                if latest is None or run.end > latest.end:
                    latest = run
        return found

    def workers(self) -> list[str]:
        """The workers that ran or turned away anything, sorted."""
        names = {run.worker for run in self.runs} | {dup.worker for dup in self.duplicates}
        return sorted(names)

    def skip_destinations(self) -> tuple[int, int, int]:
        """(skipped, absorbed by a recorded run of the same key, ... of which on another worker)."""
        skipped = absorbed = elsewhere = 0
        for duplicate in self.duplicates:
            if duplicate.policy not in ("skip", "redelivered"):
                continue
            skipped += 1
            holder = self.runs_by_id.get(duplicate.holder_id or "")
            if holder is not None and holder.key == duplicate.key:
                absorbed += 1
                if holder.worker != duplicate.worker:
                    elsewhere += 1
        return skipped, absorbed, elsewhere

    def retried_then_ran(self) -> tuple[int, int]:
        """(task messages that retried at least once, of those: ran later)."""
        retried = {dup.id for dup in self.duplicates if dup.policy == "retry"}
        return len(retried), sum(1 for task_id in retried if task_id in self.runs_by_id)

    def median_wait(self, policy: str = "wait") -> float | None:
        """Median seconds from finding the lock held to the release that woke the duplicate."""
        waits = [wait.end - wait.start for wait in self.waits if wait.policy == policy]
        return statistics.median(waits) if waits else None

    def bursts(self) -> dict[str, list[Burst]]:
        """Per coalescing key (in display order), its bursts of triggers in order."""
        triggers: Counter[str] = Counter(self.burst_of.values())
        runs: Counter[str] = Counter(
            self.burst_of[run.id] for run in self.runs if run.id in self.burst_of
        )
        key_of = {label: self.submitted[task_id] for task_id, label in self.burst_of.items()}
        found: dict[str, list[Burst]] = {}
        for key in self.keys:
            labels = sorted((label for label in key_of if key_of[label] == key), key=_burst_order)
            if labels:
                found[key] = [Burst(label, key, triggers[label], runs[label]) for label in labels]
        return found

    def follow_up_gaps(self) -> list[float]:
        """For each pending run of a coalescing key that ran: seconds from the end of the run
        before it (on the same key) to its own start."""
        pending = {duplicate.id for duplicate in self.duplicates if duplicate.policy == "coalesce"}
        gaps = []
        for run in self.runs:
            if run.id not in pending:
                continue
            earlier = [
                other for other in self.runs if other.key == run.key and other.start < run.start
            ]
            if earlier:
                gaps.append(run.start - max(earlier, key=lambda other: other.start).end)
        return gaps


def _burst_order(label: str) -> tuple[str, int]:
    """``shop-eu #10`` after ``shop-eu #9``."""
    name, _, number = label.rpartition("#")
    return (name, int(number)) if number.isdigit() else (label, 0)
