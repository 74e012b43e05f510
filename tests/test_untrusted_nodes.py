"""A node's reply is untrusted input: a reply the script cannot give is no vote, no holder and no
record — it counts as no answer, like an error reply. Real redis-server processes beside fake
RESP servers (tests/fake_resp.py) that answer garbage."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery_apps.support import embedded_worker, make_app
from fake_resp import FakeRedisServer, always

from celery_redlock import QuorumUnavailable, Redlock, singleton_task
from celery_redlock.lock.redlock import Acquired, Unavailable, acquire_judge
from celery_redlock.testing import RedisNodes, RedisServer

pytest_plugins = ["celery_apps.fixtures"]

GARBAGE = {
    "one": b":1\r\n",  # a fencing token below the caller's clock
    "ok": b"+OK\r\n",
    "completed": b"+COMPLETED\r\n",
    "covered": b"+COVERED\r\n",
    "pair-of-text": b"*2\r\n$1\r\na\r\n$1\r\nb\r\n",  # a pttl that is not a number
    "empty-array": b"*0\r\n",
    "nil": b"$-1\r\n",
    "negative-pttl": b"*2\r\n$4\r\nsome\r\n:-7\r\n",
}


@pytest.fixture(params=sorted(GARBAGE))
def garbage(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[str, FakeRedisServer, FakeRedisServer]]:
    """Two fake nodes answering the same garbage to every command."""
    raw = GARBAGE[request.param]
    with FakeRedisServer(always(raw)) as first, FakeRedisServer(always(raw)) as second:
        yield request.param, first, second


def test_garbage_from_a_majority_is_no_quorum_never_a_lock(
    one_node: RedisNodes, garbage: tuple[str, FakeRedisServer, FakeRedisServer]
) -> None:
    name, first, second = garbage
    redlock = Redlock([one_node.urls[0], first.url, second.url], node_timeout=0.5, retry_count=1)
    outcome = redlock.attempt("guarded", ttl=5.0)
    assert isinstance(outcome, Unavailable), (name, outcome)
    assert outcome.error.answered == 1  # the one real node; garbage is no answer
    assert "cannot give" in str(outcome.error)
    with pytest.raises(QuorumUnavailable):
        redlock.holder_of("guarded")
    # Nothing trusted the fakes: the real node holds nothing (the failed round was released).
    with one_node[0].client() as client:
        assert client.get(redlock.key_for("guarded")) is None


def test_garbage_from_a_minority_leaves_the_majority_in_charge(
    three_nodes: RedisNodes, garbage: tuple[str, FakeRedisServer, FakeRedisServer]
) -> None:
    name, first, _ = garbage
    urls = [three_nodes.urls[0], three_nodes.urls[1], first.url]
    redlock = Redlock(urls, node_timeout=0.5, retry_count=1)
    outcome = redlock.attempt("guarded", ttl=5.0)
    assert isinstance(outcome, Acquired), (name, outcome)
    lock = outcome.lock
    assert redlock.extend(lock) is True  # two real confirmations are a majority of three
    assert redlock.release(lock) is True


def test_a_completed_status_is_only_an_answer_to_a_record_question(
    three_nodes: RedisNodes,
) -> None:
    # Two real nodes and one that says COVERED (or the COMPLETED of 0.2) to everything.
    with FakeRedisServer(always(b"+COVERED\r\n")) as liar:
        redlock = Redlock([*three_nodes.urls[:2], liar.url], node_timeout=0.5, retry_count=1)
        # No record asked: the status is no possible reply, and two real grants win.
        outcome = redlock.attempt("asked-nothing", ttl=5.0)
        assert isinstance(outcome, Acquired)
        assert redlock.release(outcome.lock)


def test_what_the_acquire_script_can_answer() -> None:
    clock = 1_700_000_000_000_000
    asked, not_asked = acquire_judge(clock, True), acquire_judge(clock, False)
    assert asked(clock) is True and asked(clock + 5) is True  # a fencing token
    assert asked(clock - 1) is None and asked(True) is None  # below the clock; not an integer
    assert asked([b"token|owner", 1500]) is False and asked([b"token", -1]) is False  # a holder
    assert asked([b"", 10]) is None and asked([b"x", "10"]) is None and asked([b"x"]) is None
    assert asked(b"COVERED") is False  # the record decides
    assert not_asked(b"COVERED") is None and not_asked(b"OK") is None


def test_a_fencing_token_below_the_callers_clock_is_refused(one_node: RedisNodes) -> None:
    # A node answering a small integer to everything would otherwise grant every lock.
    with FakeRedisServer(always(b":42\r\n")) as liar:
        redlock = Redlock([one_node.urls[0], liar.url, liar.url], node_timeout=0.5, retry_count=1)
        outcome = redlock.attempt("fenced", ttl=5.0)
        assert isinstance(outcome, Unavailable)


def test_extension_and_release_ignore_impossible_replies(one_node: RedisNodes) -> None:
    with FakeRedisServer(always(b":7\r\n")) as first, FakeRedisServer(always(b":7\r\n")) as second:
        real = Redlock(one_node.urls, node_timeout=0.5)
        lock = real.acquire("mixed", ttl=5.0)
        assert lock is not None
        mixed = Redlock([one_node.urls[0], first.url, second.url], node_timeout=0.5)
        assert mixed.extend(lock) is False  # one real confirmation of three: no majority
        assert mixed.release(lock) is False
        with one_node[0].client() as client:
            assert client.get(lock.key) is None  # the real node released it all the same


def test_a_task_facing_garbage_nodes_fails_at_the_unavailable_timeout(
    broker: RedisServer, one_node: RedisNodes
) -> None:
    # With one real node of three and two answering "+OK" to everything, no quorum ever answers:
    # the run waits for one and fails loudly at redlock_unavailable_timeout, instead of being
    # deferred for ever as a split vote.
    with (
        FakeRedisServer(always(b"+OK\r\n")) as first,
        FakeRedisServer(always(b"+OK\r\n")) as second,
    ):
        urls = [one_node.urls[0], first.url, second.url]
        app = make_app(broker, urls, redlock_unavailable_timeout=1.0)

        @singleton_task(app=app, shared=False, name="untrusted.job")
        def job() -> str:
            return "ran"

        with embedded_worker(app):
            result = job.delay()
            with pytest.raises(QuorumUnavailable, match=r"1 lock node\(s\) answered"):
                result.get(timeout=20)
