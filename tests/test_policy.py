"""The run's decision table (`celery_redlock.integration.policy.decide`), over every combination,
without Redis: a pure function of the outcome, the holder's relation and the task's policies."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from celery_redlock.integration.policy import OUTCOMES, RELATIONS, Action, Situation, decide
from celery_redlock.settings import DUPLICATE_POLICIES, UNAVAILABLE_POLICIES

EVERY_SITUATION = [
    Situation(outcome, relation, on_duplicate, on_unavailable, may_wait, eager)
    for outcome, relation, on_duplicate, on_unavailable, may_wait, eager in itertools.product(
        OUTCOMES, RELATIONS, DUPLICATE_POLICIES, UNAVAILABLE_POLICIES, (True, False), (True, False)
    )
]

# Actions that end a delivery without its body ever running here or from a message published
# first: allowed only for a true duplicate under a policy the user chose, or a message that ran.
ENDS_WITHOUT_RUNNING = {Action.SKIP, Action.COALESCE, Action.ACKNOWLEDGE}


def test_every_situation_has_one_lawful_action() -> None:
    assert len(EVERY_SITUATION) == 1200
    for situation in EVERY_SITUATION:
        check_lawful(situation, decide(situation))


def check_lawful(situation: Situation, action: Action) -> None:
    """Fail unless ``action`` is lawful for ``situation`` (the first rule of the product)."""
    if situation.outcome == "acquired":
        assert action is Action.RUN
    elif situation.outcome == "covered":
        assert action is Action.ACKNOWLEDGE
    if action in ENDS_WITHOUT_RUNNING - {Action.ACKNOWLEDGE}:
        assert situation.outcome == "held" and situation.relation == "other"
        assert action.value == situation.on_duplicate
    if action is Action.ACKNOWLEDGE:
        assert situation.outcome == "covered"  # only the record proves a message ran
    if action is Action.RUN_UNGUARDED:
        assert situation.outcome == "unavailable" and situation.on_unavailable == "run"
    if action is Action.WAIT:
        assert situation.may_wait  # one wait per delivery, then a fallback
    if situation.outcome == "held" and situation.relation != "other":
        # A redelivered copy or a continuation is never treated as a duplicate (a plain call,
        # which cannot defer, fails loudly instead).
        assert action in (Action.DEFER, Action.WAIT) or (
            action is Action.RAISE and not situation.can_publish
        )


@pytest.mark.parametrize(
    ("relation", "may_wait", "expected"),
    [
        ("same", True, Action.DEFER),
        ("same", False, Action.DEFER),
        ("earlier", True, Action.DEFER),
        ("earlier", False, Action.DEFER),
        ("continuation", True, Action.WAIT),
        ("continuation", False, Action.DEFER),
    ],
)
def test_copies_and_continuations_are_deferred_or_wait(
    relation: str, may_wait: bool, expected: Action
) -> None:
    for on_duplicate in DUPLICATE_POLICIES:
        situation = Situation("held", relation, on_duplicate, "retry", may_wait, eager=False)
        assert decide(situation) is expected


@pytest.mark.parametrize(
    ("on_duplicate", "may_wait", "expected"),
    [
        ("skip", True, Action.SKIP),
        ("raise", True, Action.RAISE),
        ("retry", True, Action.RETRY),
        ("wait", True, Action.WAIT),
        ("wait", False, Action.RETRY),  # waited lock_wait seconds already
        ("coalesce", True, Action.COALESCE),
        ("coalesce", False, Action.COALESCE),
    ],
)
def test_true_duplicates_follow_on_duplicate(
    on_duplicate: str, may_wait: bool, expected: Action
) -> None:
    situation = Situation("held", "other", on_duplicate, "retry", may_wait, eager=False)
    assert decide(situation) is expected


@pytest.mark.parametrize(
    ("on_unavailable", "eager", "expected"),
    [
        ("retry", False, Action.WAIT_FOR_NODES),
        ("retry", True, Action.RAISE),
        ("raise", False, Action.RAISE),
        ("run", False, Action.RUN_UNGUARDED),
        ("run", True, Action.RUN_UNGUARDED),
    ],
)
def test_no_quorum_follows_on_unavailable(
    on_unavailable: str, eager: bool, expected: Action
) -> None:
    situation = Situation("unavailable", "other", "skip", on_unavailable, True, eager)
    assert decide(situation) is expected


def test_a_split_vote_waits_once_then_defers() -> None:
    assert decide(Situation("contended", "other", "skip", "retry", True, False)) is Action.WAIT
    assert decide(Situation("contended", "other", "skip", "retry", False, False)) is Action.DEFER


@pytest.mark.parametrize("situation", EVERY_SITUATION)
def test_a_plain_call_waits_once_then_raises_where_a_delivery_would_publish(
    situation: Situation,
) -> None:
    # task(...) outside a worker: no message to defer, retry or insure. Everything else (run,
    # skip a true duplicate, raise, run unguarded) is decided as for a delivery.
    plain = dataclasses.replace(situation, can_publish=False)
    delivery_action, action = decide(situation), decide(plain)
    check_lawful(plain, action)
    publishing = {Action.DEFER, Action.RETRY, Action.COALESCE, Action.WAIT_FOR_NODES}
    if delivery_action not in publishing:
        assert action is delivery_action
    elif situation.may_wait and delivery_action is not Action.WAIT_FOR_NODES:
        assert action is Action.WAIT
    else:
        assert action is Action.RAISE


def test_an_unknown_outcome_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown outcome"):
        decide(Situation("maybe", "other", "skip", "retry", True, False))
