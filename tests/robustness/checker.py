"""The promises, checked on a merged history (`history`), whatever fault was injected.

- **No overlap.** A hold runs from its acquisition's return to the first of its release's start
  and the end of the validity its holder last relied on; two holds of one key never overlap.
- **Fencing tokens grow.** A hold granted after another's acquisition returned carries a larger
  fencing token.
- **Fenced writes in token order.** A write accepted after another accepted write of the same
  key and store returned carries a larger token; every refusal is a `StaleFence` naming a token
  that was accepted; no write is refused while its holder's lock was valid (a false refusal is
  lost work).
- **No false "held".** A refusal that names a holder is right: that owner attempted or held the
  key at that moment, or less than one of its ttls before (a failed attempt's leftovers live
  that long on a node that missed its release).
- **No lost task, no overlap** (the Celery workload): every task sent ran, or was skipped as a
  duplicate while a run of the same key held its lock (from taking it to its release, or to
  its expiry when no majority confirmed the release: the nodes know no better until then); two
  runs of one key never ran at once unless one was told its lock was lost.
- **Nothing left behind** (`leftovers`): after the run, no lock key without an expiry or with one
  longer than the longest ttl, and no released lock still on a node that answered.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .history import Record

PAID_WITHIN = 1.0
"""Seconds within which a node that answers again gets the releases it missed."""

LOCK_TTL = 2.0
"""The Celery workload's lock ttl (`celery_app.LOCK_TTL`)."""

SLACK = 0.05
"""Seconds of tolerance for timing judgements that compare two processes' records (the moment
a record is taken is a few instructions after the event)."""


@dataclass
class Violation:
    """One broken promise: what (``kind``), where (``key``), why, and the records involved."""

    kind: str
    key: str
    message: str
    records: list[Record] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.kind} on {self.key!r}: {self.message}"


@dataclass
class Hold:
    """A lock its holder relied on: from ``granted`` to ``ended``."""

    key: str
    token: str
    owner: str
    fence: int
    granted: float
    started: float  # when its acquisition started
    ended: float
    acquire: Record
    release: Record | None = None
    valid_until: float = 0.0


def holds_in(history: Sequence[Record]) -> list[Hold]:
    """The holds of ``history``: every acquisition that returned a lock, with its extensions
    and release."""
    holds: dict[str, Hold] = {}
    later: dict[str, list[Record]] = defaultdict(list)
    for record in history:
        operation = record["op"]
        if operation == "acquire" and record["outcome"] == "acquired":
            holds[record["token"]] = Hold(
                key=record["key"],
                token=record["token"],
                owner=record["owner"],
                fence=record["fence"],
                granted=record["end"],
                started=record["start"],
                ended=record["valid_until"],
                acquire=record,
                valid_until=record["valid_until"],
            )
        elif operation in ("extend", "release"):
            later[record["token"]].append(record)
    for token, records in later.items():
        hold = holds.get(token)
        if hold is None:
            continue
        believed = hold.valid_until
        lost_at = math.inf
        release_at = math.inf
        for record in sorted(records, key=lambda record: record["end"]):
            if record["op"] == "release":
                hold.release = record
                release_at = min(release_at, record["start"])
            elif record["valid_until"] > 0:
                believed = max(believed, record["valid_until"])
            else:  # the extension learned that the lock is gone: relied on no longer
                lost_at = min(lost_at, record["end"])
        hold.valid_until = believed
        hold.ended = min(believed, lost_at, release_at)
    return list(holds.values())


def check(history: Sequence[Record]) -> list[Violation]:
    """Every violation of the promises in ``history`` (the module's docstring lists them)."""
    holds = holds_in(history)
    by_key: dict[str, list[Hold]] = defaultdict(list)
    for hold in holds:
        by_key[hold.key].append(hold)
    violations: list[Violation] = []
    for key in sorted(by_key):
        violations += overlaps(key, by_key[key])
        violations += fences_out_of_order(key, by_key[key])
    violations += writes_out_of_order(history, {hold.token: hold for hold in holds})
    violations += false_helds(history)
    violations += lost_tasks(history)
    violations += task_overlaps(history)
    return violations


def overlaps(key: str, holds: Iterable[Hold]) -> list[Violation]:
    """Pairs of holds of ``key`` that were relied on at the same time."""
    violations: list[Violation] = []
    latest: Hold | None = None  # of the holds granted so far, the one relied on longest
    for hold in sorted(holds, key=lambda hold: hold.granted):
        if latest is not None and hold.granted < latest.ended:
            both = f"{latest.owner} (fence {latest.fence}) and {hold.owner} (fence {hold.fence})"
            violations.append(
                Violation(
                    "overlap",
                    key,
                    f"{both} held it together for {latest.ended - hold.granted:.3f}s "
                    f"from {hold.granted:.3f}",
                    [latest.acquire, hold.acquire],
                )
            )
        if latest is None or hold.ended > latest.ended:
            latest = hold
    return violations


def fences_out_of_order(key: str, holds: Sequence[Hold]) -> list[Violation]:
    """Holds granted after another hold's acquisition returned, with a fencing token that is
    not larger."""
    by_grant = sorted(holds, key=lambda hold: hold.granted)
    grants = [hold.granted for hold in by_grant]
    violations: list[Violation] = []
    best: Hold | None = None  # the largest fence among the holds granted before `done`
    done = 0
    for hold in sorted(holds, key=lambda hold: hold.started):
        reach = bisect.bisect_left(grants, hold.started)
        while done < reach:
            earlier = by_grant[done]
            if best is None or earlier.fence > best.fence:
                best = earlier
            done += 1
        if best is not None and hold.fence <= best.fence:
            violations.append(
                Violation(
                    "fence-order",
                    key,
                    f"{hold.owner} was granted fence {hold.fence} after {best.owner} had been "
                    f"granted fence {best.fence}",
                    [best.acquire, hold.acquire],
                )
            )
    return violations


def writes_out_of_order(history: Sequence[Record], holds: dict[str, Hold]) -> list[Violation]:
    """Fenced writes accepted out of token order, refusals without an accepted larger token, and
    writes refused while their holder's lock was valid."""
    writes: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for record in history:
        if record["op"] == "write":
            writes[(record["store"], record["key"])].append(record)
    violations: list[Violation] = []
    for (store, key), records in sorted(writes.items()):
        accepted = [record for record in records if record["accepted"]]
        first_accepted: dict[int, float] = {}
        for record in accepted:
            first_accepted[record["fence"]] = min(
                first_accepted.get(record["fence"], math.inf), record["start"]
            )
        by_end = sorted(accepted, key=lambda record: record["end"])
        ends = [record["end"] for record in by_end]
        best: Record | None = None
        done = 0
        for record in sorted(accepted, key=lambda record: record["start"]):
            reach = bisect.bisect_left(ends, record["start"])
            while done < reach:
                if best is None or by_end[done]["fence"] > best["fence"]:
                    best = by_end[done]
                done += 1
            if best is not None and record["fence"] <= best["fence"]:
                violations.append(
                    Violation(
                        "write-order",
                        key,
                        f"{store} accepted fence {record['fence']} after fence {best['fence']}",
                        [best, record],
                    )
                )
        for record in records:
            if record["accepted"] is not False:
                continue
            stored = record["stored"]
            if stored is None or first_accepted.get(stored, math.inf) > record["end"] + SLACK:
                violations.append(
                    Violation(
                        "refusal-unexplained",
                        key,
                        f"{store} refused fence {record['fence']} naming fence {stored}, which "
                        "no write had been accepted with",
                        [record],
                    )
                )
            hold = holds.get(record["token"])
            if hold is not None and record["end"] < hold.ended - SLACK:
                violations.append(
                    Violation(
                        "refused-while-valid",
                        key,
                        f"{store} refused {hold.owner}'s write (fence {record['fence']}, stored "
                        f"{stored}) while its lock was valid for {hold.ended - record['end']:.3f}s "
                        "more: work lost",
                        [hold.acquire, record],
                    )
                )
    return violations


def false_helds(history: Sequence[Record]) -> list[Violation]:
    """Refusals naming a holder that had no attempt or hold of the key at that moment, nor less
    than one of its ttls before."""
    # Per (owner, key): when each of its attempts started, and until when its leftovers may live.
    windows: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for record in history:
        if record["op"] in ("acquire", "extend", "release"):
            ttl = record.get("ttl", 0.0)
            windows[(record["owner"], record["key"])].append((record["start"], record["end"] + ttl))
    violations: list[Violation] = []
    cover: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for pair, spans in windows.items():
        spans.sort()
        starts = [start for start, _ in spans]
        reach: list[float] = []
        furthest = -math.inf
        for _, until in spans:
            furthest = max(furthest, until)
            reach.append(furthest)
        cover[pair] = (starts, reach)
    longest_ttl = max((record.get("ttl", 0.0) for record in history), default=0.0)
    for record in history:
        if record["op"] != "acquire" or record["outcome"] != "held":
            continue
        holder = record["holder"]
        pair = (holder, record["key"])
        if pair not in cover:
            violations.append(
                Violation(
                    "false-held",
                    record["key"],
                    f"{record['owner']} was told {holder!r} holds it; that owner never tried",
                    [record],
                )
            )
            continue
        starts, reach = cover[pair]
        before = bisect.bisect_right(starts, record["end"] + SLACK)
        # Its leftovers live one ttl after its record ended (a hold's extension: one longest ttl).
        if before == 0 or reach[before - 1] + longest_ttl < record["start"] - SLACK:
            violations.append(
                Violation(
                    "false-held",
                    record["key"],
                    f"{record['owner']} was told {holder!r} holds it at {record['start']:.3f}; "
                    "that owner had no attempt or hold of it then",
                    [record],
                )
            )
    return violations


def lost_tasks(history: Sequence[Record]) -> list[Violation]:
    """Celery workload: tasks sent that never ran, and tasks skipped while no run of their key
    held its lock (from taking it to its release; a release no majority confirmed, to the lock's
    expiry: until then the nodes know no better)."""
    sent: dict[str, Record] = {}
    ran: dict[str, list[Record]] = defaultdict(list)
    skipped: dict[str, Record] = {}
    locked_at: dict[str, float] = {}
    released_at: dict[str, float] = {}
    for record in history:
        if record["op"] != "task":
            continue
        event = record["event"]
        if event == "sent":
            sent[record["task_id"]] = record
        elif event == "ran":
            ran[record["key"]].append(record)
            ran[record["task_id"]].append(record)
        elif event == "skipped":
            skipped[record["task_id"]] = record
        elif event == "acquired":
            locked_at[record["task_id"]] = record["start"]
        elif event == "released":
            released_at[record["task_id"]] = record["start"]
        elif event == "released-unconfirmed":
            released_at[record["task_id"]] = record["start"] + record.get("ttl", LOCK_TTL)
    violations: list[Violation] = []
    for task_id, record in sorted(sent.items()):
        if ran.get(task_id):
            continue
        skip = skipped.get(task_id)
        if skip is None:
            violations.append(
                Violation("lost-task", record["key"], f"task {task_id} was sent and never ran")
            )
            continue
        holding = [
            run
            for run in ran.get(record["key"], [])
            if run["task_id"] != task_id
            and held_from(run, skip, locked_at, sent) - SLACK <= skip["end"]
            and max(run["end"], released_at.get(run["task_id"], 0.0)) + SLACK >= skip["start"]
        ]
        if not holding:
            violations.append(
                Violation(
                    "false-skip",
                    record["key"],
                    f"task {task_id} was skipped as a duplicate while no run of its key held it",
                    [record, skip],
                )
            )
    return violations


def held_from(
    run: Record, skip: Record, locked_at: dict[str, float], sent: dict[str, Record]
) -> float:
    """When ``run`` held its lock at the latest, as far as ``skip`` can tell: once its
    acquisition returned, or its body started; for the run the skip named as the holder, once it
    was sent (its lock is on the nodes as soon as its round's writes land there, before the
    round returns)."""
    held = min(run["start"], locked_at.get(run["task_id"], math.inf))
    if skip.get("holder") == run["task_id"] and run["task_id"] in sent:
        held = min(held, sent[run["task_id"]]["start"])
    return held


def task_overlaps(history: Sequence[Record]) -> list[Violation]:
    """Celery workload: two runs of one key at once, neither of which was told its lock was
    lost."""
    lost = {
        record["task_id"]
        for record in history
        if record["op"] == "task" and record["event"] == "lost"
    }
    runs: dict[str, list[Record]] = defaultdict(list)
    for record in history:
        if record["op"] == "task" and record["event"] == "ran":
            runs[record["key"]].append(record)
    violations: list[Violation] = []
    for key, records in sorted(runs.items()):
        latest: Record | None = None
        for record in sorted(records, key=lambda record: record["start"]):
            if (
                latest is not None
                and record["start"] < latest["end"]
                and not {record["task_id"], latest["task_id"]} & lost
            ):
                violations.append(
                    Violation(
                        "task-overlap",
                        key,
                        f"tasks {latest['task_id']} and {record['task_id']} ran together "
                        f"for {latest['end'] - record['start']:.3f}s",
                        [latest, record],
                    )
                )
            if latest is None or record["end"] > latest["end"]:
                latest = record
    return violations


def leftovers(
    keys_on_nodes: Sequence[tuple[str, str, str, int]],
    history: Sequence[Record],
    longest: float,
    checked_at: float,
) -> list[Violation]:
    """What a run left on its nodes: ``keys_on_nodes`` holds ``(node, key, token hash, pttl in
    ms)`` for every lock key read at ``checked_at``, after the run and its healthy tail
    (``token hash`` empty when the value is no lock). A key without an expiry, or with more than
    ``longest`` seconds left, is locked for ever; a key whose release a majority confirmed more
    than `PAID_WITHIN` seconds before is a clean-up never paid to a node that answered again."""
    released = {
        record["token"]: record["end"]
        for record in history
        if record["op"] == "release" and record["ok"]
    }
    violations: list[Violation] = []
    for node, key, token, pttl in keys_on_nodes:
        if pttl < 0 or pttl > longest * 1000:
            violations.append(
                Violation(
                    "left-locked", key, f"{node} keeps it with pttl {pttl} ms (longest {longest}s)"
                )
            )
        elif token in released and released[token] < checked_at - PAID_WITHIN:
            violations.append(
                Violation(
                    "release-lost",
                    key,
                    f"{node} still holds a lock whose release a majority confirmed "
                    f"{checked_at - released[token]:.1f}s before ({pttl} ms left)",
                )
            )
    return violations
