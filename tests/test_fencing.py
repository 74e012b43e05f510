"""Fencing tokens on real nodes: they grow with every acquisition of a resource, under contention,
and across a node that restarts empty or missed acquisitions."""

from __future__ import annotations

import itertools
import threading
import time

from celery_redlock import Lock, Redlock
from celery_redlock.lock.redlock import FENCE_SUFFIX
from celery_redlock.testing import RedisNodes


def make_redlock(nodes: RedisNodes) -> Redlock:
    return Redlock(nodes.urls, node_timeout=0.5, retry_delay=0.01)


def acquire_within(redlock: Redlock, resource: str, seconds: float = 10.0) -> Lock | None:
    """Acquire ``resource`` (ttl 5 s), trying again until a quorum grants it or time is up."""
    deadline = time.monotonic() + seconds
    while True:
        lock = redlock.acquire(resource, ttl=5)
        if lock is not None or time.monotonic() >= deadline:
            return lock


def test_tokens_grow_with_each_acquisition(three_nodes: RedisNodes) -> None:
    redlock = make_redlock(three_nodes)
    tokens = []
    for _ in range(20):
        lock = redlock.acquire("fenced", ttl=5)
        assert lock is not None
        tokens.append(lock.fencing_token)
        assert redlock.release(lock)
    assert all(later > earlier for earlier, later in itertools.pairwise(tokens))
    # Different resources have their own counters, and a token is a plain positive integer.
    other = redlock.acquire("other", ttl=5)
    assert other is not None and isinstance(other.fencing_token, int) and other.fencing_token > 0


def test_tokens_follow_the_order_of_holders_under_contention(three_nodes: RedisNodes) -> None:
    redlock = make_redlock(three_nodes)
    seen: list[int] = []  # appended while holding the lock: the order of holders
    guard = threading.Lock()

    def contend() -> None:
        for _ in range(15):
            lock = redlock.acquire("contended", ttl=5, blocking=True, timeout=20)
            assert lock is not None
            with guard:
                seen.append(lock.fencing_token)
            redlock.release(lock)

    threads = [threading.Thread(target=contend) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(seen) == 90
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


def test_a_node_restarted_empty_never_lowers_the_token(three_nodes: RedisNodes) -> None:
    redlock = make_redlock(three_nodes)
    first = redlock.acquire("restart", ttl=5)
    assert first is not None
    redlock.release(first)
    three_nodes[0].kill()
    three_nodes[0].restart()
    second = acquire_within(redlock, "restart")
    assert second is not None
    assert second.fencing_token > first.fencing_token


def test_lagging_nodes_are_raised_to_the_token(three_nodes: RedisNodes) -> None:
    redlock = make_redlock(three_nodes)
    key = redlock.key_for("lagging") + FENCE_SUFFIX
    ahead = (time.time_ns() // 1000) + 10**12  # node 0 saw far more acquisitions than node 1
    with three_nodes[0].client() as client:
        client.set(key, ahead, px=60_000)
    three_nodes[2].pause()  # the quorum is nodes 0 and 1, which disagree
    try:
        lock = redlock.acquire("lagging", ttl=5)
        assert lock is not None
        assert lock.fencing_token == ahead + 1
        counters = []
        for server in three_nodes.servers[:2]:
            with server.client() as client:
                counters.append(int(client.get(key) or 0))
        # Both now hold the token, so any later majority contains a node handing out more.
        assert counters == [ahead + 1, ahead + 1]
        redlock.release(lock)
    finally:
        three_nodes[2].resume()
    later = acquire_within(redlock, "lagging")
    assert later is not None and later.fencing_token > lock.fencing_token


def test_counter_lives_with_the_lock_and_is_not_left_behind(three_nodes: RedisNodes) -> None:
    redlock = make_redlock(three_nodes)
    lock = redlock.acquire("short", ttl=1)
    assert lock is not None
    key = lock.key + FENCE_SUFFIX
    with three_nodes[0].client() as client:
        assert 0 < client.pttl(key) <= 1000
        assert redlock.extend(lock, 3)
        assert 2000 < client.pttl(key) <= 3000
