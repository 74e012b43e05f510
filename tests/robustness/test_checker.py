"""The checker on hand-written histories: each broken promise is reported, a history that keeps
them all passes (pure functions: no servers needed)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.robustness.checker import check, leftovers
from tests.robustness.history import Record


def acquire(owner: str, start: float, end: float, token: str, fence: int, **more: Any) -> Record:
    record: Record = {"op": "acquire", "owner": owner, "key": "k", "ttl": 1.0}
    record.update(start=start, end=end, outcome="acquired", token=token, fence=fence)
    record["valid_until"] = more.pop("valid_until", start + 0.99)
    return {**record, **more}


def release(owner: str, start: float, token: str, ok: bool = True) -> Record:
    return {"op": "release", "owner": owner, "key": "k", "ttl": 1.0, "token": token, "ok": ok} | {
        "start": start,
        "end": start + 0.001,
    }


def extend(owner: str, start: float, token: str, valid_until: float) -> Record:
    return {"op": "extend", "owner": owner, "key": "k", "ttl": 1.0, "token": token} | {
        "start": start,
        "end": start + 0.001,
        "ok": valid_until > 0,
        "valid_until": valid_until,
    }


def held(owner: str, start: float, holder: str) -> Record:
    return {"op": "acquire", "owner": owner, "key": "k", "ttl": 1.0, "outcome": "held"} | {
        "start": start,
        "end": start + 0.001,
        "holder": holder,
    }


def write(
    owner: str, start: float, token: str, fence: int, accepted: bool | None, stored: Any = None
) -> Record:
    return {"op": "write", "owner": owner, "key": "k", "store": "redis", "token": token} | {
        "start": start,
        "end": start + 0.001,
        "fence": fence,
        "accepted": accepted,
        "stored": stored,
    }


def task(event: str, task_id: str, start: float, end: float) -> Record:
    return {"op": "task", "owner": "w", "key": "k", "event": event, "task_id": task_id} | {
        "start": start,
        "end": end,
    }


def kinds(history: list[Record]) -> list[str]:
    return [violation.kind for violation in check(sorted(history, key=lambda r: r["start"]))]


GOOD = [
    acquire("a", 0.0, 0.01, "A", 1),
    write("a", 0.1, "A", 1, True),
    release("a", 0.2, "A"),
    held("b", 0.05, "a"),  # refused while a held it
    acquire("b", 0.3, 0.31, "B", 2),
    extend("b", 0.8, "B", 1.8),
    write("b", 1.5, "B", 2, True),  # after its first validity, within the extended one
    release("b", 1.6, "B"),
    write("a", 1.7, "A", 1, False, stored=2),  # a's late write, refused naming b's token
    held("c", 2.0, "b"),  # b's leftovers on a node that missed the release live one ttl
    acquire("c", 3.0, 3.01, "C", 3),  # after a's lock expired without a release
    task("sent", "t1", 0.0, 0.0),
    task("ran", "t1", 0.5, 0.9),
    task("sent", "t2", 0.0, 0.0),
    task("skipped", "t2", 0.6, 0.6),  # a true duplicate: t1 ran then
]


def test_a_history_that_keeps_every_promise_passes() -> None:
    assert kinds(GOOD) == []


def test_two_holders_at_once_are_an_overlap() -> None:
    history = [
        acquire("a", 0.0, 0.01, "A", 1),
        acquire("b", 0.5, 0.51, "B", 2),  # a neither released nor expired (valid until 0.99)
        release("a", 0.6, "A"),
    ]
    assert kinds(history) == ["overlap"]


def test_a_holder_that_extended_still_holds() -> None:
    history = [
        acquire("a", 0.0, 0.01, "A", 1),
        extend("a", 0.5, "A", 1.5),
        acquire("b", 1.2, 1.21, "B", 2),  # within a's extended validity
    ]
    assert kinds(history) == ["overlap"]


def test_a_hold_ends_when_its_extension_learns_it_is_lost() -> None:
    history = [
        acquire("a", 0.0, 0.01, "A", 1),
        extend("a", 0.3, "A", 0.0),  # a majority names another owner: relied on no longer
        acquire("b", 0.5, 0.51, "B", 2),
    ]
    assert kinds(history) == []


def test_a_fencing_token_going_backwards_is_reported() -> None:
    history = [
        acquire("a", 0.0, 0.01, "A", 5),
        release("a", 0.1, "A"),
        acquire("b", 0.2, 0.21, "B", 4),
    ]
    assert kinds(history) == ["fence-order"]


def test_an_equal_fencing_token_is_reported() -> None:
    history = [
        acquire("a", 0.0, 0.01, "A", 5),
        release("a", 0.1, "A"),
        acquire("b", 0.2, 0.21, "B", 5),
    ]
    assert kinds(history) == ["fence-order"]


def test_a_late_write_accepted_after_a_newer_one_is_reported() -> None:
    history = [
        acquire("a", 0.0, 0.01, "A", 1, valid_until=0.5),
        acquire("b", 0.6, 0.61, "B", 2),
        write("b", 0.7, "B", 2, True),
        write("a", 0.8, "A", 1, True),  # the paused holder's write: must have been refused
    ]
    assert kinds(history) == ["write-order"]


def test_a_refusal_naming_a_token_nobody_wrote_is_reported() -> None:
    history = [
        acquire("a", 0.0, 0.01, "A", 1),
        write("a", 0.1, "A", 1, False, stored=7),
    ]
    assert "refusal-unexplained" in kinds(history)


def test_a_write_refused_while_its_lock_was_valid_is_lost_work() -> None:
    history = [
        acquire("z", 0.0, 0.01, "Z", 9, valid_until=0.05),
        write("z", 0.02, "Z", 9, True),
        acquire("a", 0.1, 0.11, "A", 10),
        write("a", 0.2, "A", 3, False, stored=9),  # fence 3 recorded: the store saw an old one
    ]
    assert "refused-while-valid" in kinds(history)


def test_held_naming_an_owner_that_never_tried_is_false() -> None:
    assert kinds([held("b", 0.0, "ghost")]) == ["false-held"]


def test_held_naming_an_owner_long_after_its_last_attempt_is_false() -> None:
    history = [
        acquire("a", 0.0, 0.01, "A", 1),
        release("a", 0.1, "A"),
        held("b", 5.0, "a"),  # its lock and leftovers are gone for seconds
    ]
    assert kinds(history) == ["false-held"]


def test_a_task_sent_and_never_run_is_lost() -> None:
    assert kinds([task("sent", "t1", 0.0, 0.0)]) == ["lost-task"]


def test_a_task_skipped_while_nothing_ran_is_a_false_skip() -> None:
    history = [
        task("sent", "t1", 0.0, 0.0),
        task("ran", "t1", 0.1, 0.2),
        task("sent", "t2", 0.0, 0.0),
        task("skipped", "t2", 0.5, 0.5),
    ]
    assert kinds(history) == ["false-skip"]


@pytest.mark.parametrize(
    ("pttl", "released_at", "expected"),
    [
        (-1, None, ["left-locked"]),  # no expiry: locked for ever
        (5000, None, ["left-locked"]),  # longer than any ttl of the run
        (800, 8.0, ["release-lost"]),  # released 2 s before the check, still there
        (800, 9.5, []),  # released just now: the node may be getting it
        (800, None, []),  # a live lock (or one whose release was not confirmed)
    ],
)
def test_leftovers_on_the_nodes(pttl: int, released_at: float | None, expected: list[str]) -> None:
    history = [acquire("a", 0.0, 0.01, "A", 1)]
    if released_at is not None:
        history.append(release("a", released_at, "A"))
    found = leftovers([("node", "k", "A", pttl)], history, longest=2.0, checked_at=10.0)
    assert [violation.kind for violation in found] == expected


def test_two_runs_of_one_key_at_once_are_an_overlap() -> None:
    history = [
        task("sent", "t1", 0.0, 0.0),
        task("ran", "t1", 0.1, 0.5),
        task("sent", "t2", 0.0, 0.0),
        task("ran", "t2", 0.3, 0.6),
    ]
    assert kinds(history) == ["task-overlap"]


def test_a_run_told_its_lock_was_lost_may_overlap_the_next() -> None:
    history = [
        task("sent", "t1", 0.0, 0.0),
        task("ran", "t1", 0.1, 0.5),
        task("lost", "t1", 0.2, 0.2),
        task("sent", "t2", 0.0, 0.0),
        task("ran", "t2", 0.3, 0.6),
    ]
    assert kinds(history) == []


@pytest.mark.parametrize(
    ("released", "expected"), [("released", ["false-skip"]), ("released-unconfirmed", [])]
)
def test_a_skip_after_the_holder_released_is_false_unless_the_release_was_unconfirmed(
    released: str, expected: list[str]
) -> None:
    history = [
        task("sent", "t1", 0.0, 0.0),
        task("acquired", "t1", 0.05, 0.05),
        task("ran", "t1", 0.1, 0.2),
        task(released, "t1", 0.21, 0.21),
        task("sent", "t2", 0.0, 0.0),
        task("skipped", "t2", 0.5, 0.5),  # the lock may be on the nodes until 0.21 + its ttl
    ]
    assert kinds(history) == expected


@pytest.mark.parametrize(("named", "expected"), [("t1", []), ("t3", ["false-skip"])])
def test_a_skip_naming_a_run_still_acquiring_is_a_true_duplicate(
    named: str, expected: list[str]
) -> None:
    # t1's writes were on a majority when t2 looked, before t1's round returned (a slow node):
    # t2 named it, and t1 ran. Naming a run that is not of this key proves nothing.
    history = [
        task("sent", "t1", 0.0, 0.0),
        task("sent", "t2", 0.1, 0.1),
        task("skipped", "t2", 0.3, 0.3) | {"holder": named},
        task("acquired", "t1", 0.5, 0.5),
        task("ran", "t1", 0.5, 0.6),
        task("released", "t1", 0.61, 0.61),
    ]
    assert kinds(history) == expected
