"""The Redlock core with dead, hung, restarted and script-less nodes, with time bounds.

Timings are printed (run with ``-s`` to see them) and asserted against generous but meaningful
bounds: a bound that a serial or poll-based implementation would break.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from redlock_support import Stopwatch, value_on, values_on, wait_until

from celery_redlock import QuorumUnavailable, Redlock
from celery_redlock.lock.nodes.endpoint import FIRST_BACKOFF_SECONDS
from celery_redlock.testing import RedisNodes

NODE_TIMEOUT = 0.2  # large enough to tell "waited for a hung node" from "did not"


def test_minority_killed_acquires_quickly(five_nodes):
    five_nodes[0].kill()
    five_nodes[3].kill()
    dlm = Redlock(five_nodes.urls, node_timeout=NODE_TIMEOUT)
    with Stopwatch() as watch:
        lock = dlm.acquire("minority-dead", ttl=5.0)
    print(f"\n5 nodes, 2 killed: first acquire {watch.elapsed * 1000:.1f} ms")
    assert lock is not None
    assert watch.elapsed < NODE_TIMEOUT / 2
    live = [five_nodes[1], five_nodes[2], five_nodes[4]]
    assert values_on(live, lock.key) == [lock.value] * 3
    assert dlm.release(lock) is True
    assert values_on(live, lock.key) == [None] * 3


@pytest.mark.parametrize("warm", [False, True], ids=["fresh-connections", "warm-connections"])
def test_minority_hung_acquires_within_one_node_timeout(three_nodes, warm):
    dlm = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    if warm:  # connections already open when the node hangs
        dlm.release(dlm.acquire("warm-up", ttl=1.0))
    three_nodes[2].pause()
    try:
        with Stopwatch() as first:
            lock = dlm.acquire("minority-hung", ttl=5.0)
        assert lock is not None, "one hung node out of three must not prevent acquisition"
        assert values_on(three_nodes.servers[:2], lock.key) == [lock.value] * 2
        assert first.elapsed < NODE_TIMEOUT + 0.1
        assert dlm.release(lock) is True
        later = []
        for index in range(20):
            with Stopwatch() as watch:
                lock = dlm.acquire(f"minority-hung-{index}", ttl=5.0)
            assert lock is not None
            assert dlm.release(lock) is True
            later.append(watch.elapsed)
    finally:
        three_nodes[2].resume()
    print(
        f"\n3 nodes, 1 hung ({'warm' if warm else 'fresh'}): first acquire "
        f"{first.elapsed * 1000:.1f} ms, next 20: max {max(later) * 1000:.1f} ms, "
        f"median {sorted(later)[10] * 1000:.1f} ms (node_timeout {NODE_TIMEOUT * 1000:.0f} ms)"
    )
    # Multiplexed: a quorum answered, so nobody waits for the hung node.
    assert sorted(later)[10] < NODE_TIMEOUT / 4


def test_hung_node_is_backed_off_after_one_timeout(three_nodes):
    """With a node hung and another dead, a round has to wait for the hung one: once. After
    that the hung node is backed off and calls fail fast without network waits."""
    dlm = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))
    three_nodes[0].kill()
    three_nodes[1].pause()
    try:
        with Stopwatch() as first, pytest.raises(QuorumUnavailable):
            dlm.acquire("backoff", ttl=5.0)
        with Stopwatch() as second, pytest.raises(QuorumUnavailable):
            dlm.acquire("backoff", ttl=5.0)
    finally:
        three_nodes[1].resume()
    print(
        f"\n3 nodes, 1 dead + 1 hung: first refusal {first.elapsed * 1000:.1f} ms, "
        f"second (backed off) {second.elapsed * 1000:.1f} ms"
    )
    assert NODE_TIMEOUT * 0.9 <= first.elapsed < NODE_TIMEOUT + 0.1
    assert second.elapsed < NODE_TIMEOUT / 4
    # Nothing of ours stays on the node that answered.
    assert wait_until(lambda: value_on(three_nodes[2], "redlock:{backoff}") is None, timeout=1.0)


def test_majority_killed_is_refused_quickly(three_nodes):
    dlm = Redlock(three_nodes.urls, retry_count=3, retry_delay=0.05, node_timeout=NODE_TIMEOUT)
    three_nodes[0].kill()
    three_nodes[1].kill()
    with Stopwatch() as watch, pytest.raises(QuorumUnavailable) as info:
        dlm.acquire("majority-dead", ttl=5.0)
    print(f"\n3 nodes, 2 killed, retry_count=3: refusal after {watch.elapsed * 1000:.1f} ms")
    # Two jittered retry delays (at most 1.5 x 0.05 s each) and no network waits.
    assert watch.elapsed < 2 * 1.5 * 0.05 + 0.1
    assert info.value.needed == 2
    assert "check that the redlock_urls servers are up" in str(info.value)
    assert wait_until(lambda: value_on(three_nodes[2], "redlock:{majority-dead}") is None, 1.0)


def test_majority_hung_is_refused_within_bounded_time(three_nodes):
    dlm = Redlock(three_nodes.urls, retry_count=3, retry_delay=0.05, node_timeout=NODE_TIMEOUT)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))
    three_nodes[0].pause()
    three_nodes[1].pause()
    try:
        with Stopwatch() as watch, pytest.raises(QuorumUnavailable):
            dlm.acquire("majority-hung", ttl=1.0)
        with Stopwatch() as again, pytest.raises(QuorumUnavailable):
            dlm.acquire("majority-hung", ttl=1.0)
        assert wait_until(lambda: value_on(three_nodes[2], "redlock:{majority-hung}") is None, 1.0)
    finally:
        three_nodes[0].resume()
        three_nodes[1].resume()
    print(
        f"\n3 nodes, 2 hung, retry_count=3: refusal after {watch.elapsed * 1000:.1f} ms, "
        f"again {again.elapsed * 1000:.1f} ms"
    )
    # The first round waits one node_timeout for the hung nodes; they are then backed off
    # (FIRST_BACKOFF_SECONDS), so the retries cost at most a node_timeout each and the sleeps.
    assert NODE_TIMEOUT * 0.9 <= watch.elapsed < 3 * NODE_TIMEOUT + 2 * 1.5 * 0.05 + 0.1
    assert again.elapsed < 3 * NODE_TIMEOUT + 2 * 1.5 * 0.05 + 0.1
    # SETs that were stuck in the hung nodes' buffers land late but expire with the ttl (1 s).
    assert wait_until(
        lambda: values_on(three_nodes, "redlock:{majority-hung}") == [None] * 3, timeout=2.0
    )


def test_restarted_empty_node_rejoins_after_backoff(three_nodes, caplog):
    caplog.set_level(logging.INFO, logger="celery_redlock")
    dlm = Redlock(three_nodes.urls, node_timeout=NODE_TIMEOUT)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))
    three_nodes[2].kill()
    lock = dlm.acquire("rejoin", ttl=5.0)
    assert lock is not None
    assert dlm.release(lock) is True
    assert "is unavailable" in caplog.text
    three_nodes[2].restart()
    assert value_on(three_nodes[2], "redlock:{rejoin}") is None  # came back empty

    restarted = time.monotonic()
    used_again = []

    def uses_restarted_node() -> bool:
        lock = dlm.acquire("rejoin", ttl=5.0)
        assert lock is not None
        on_node = value_on(three_nodes[2], lock.key)
        assert dlm.release(lock) is True
        if on_node == lock.value:
            used_again.append(time.monotonic() - restarted)
            return True
        return False

    assert wait_until(uses_restarted_node, timeout=FIRST_BACKOFF_SECONDS * 4 + 1.0)
    print(f"\nrestarted node used again {used_again[0] * 1000:.0f} ms after its restart")
    assert "answers again" in caplog.text
    # Its script cache was empty (NOSCRIPT) and it still takes part in release.
    assert wait_until(lambda: value_on(three_nodes[2], "redlock:{rejoin}") is None, timeout=1.0)


def flush_scripts(servers: RedisNodes) -> None:
    """Empty every server's script cache under its live connections."""
    for server in servers:
        with server.client() as client:
            client.script_flush()


def connected_then_flushed(three_nodes: RedisNodes) -> Redlock:
    """A `Redlock` (node timeout 2 s) whose connections are open, the scripts then flushed."""
    dlm = Redlock(three_nodes.urls, node_timeout=2.0)
    dlm.release(dlm.acquire("warm-up", ttl=5.0))
    flush_scripts(three_nodes)
    return dlm


def test_a_noscript_read_after_the_round_decided_is_followed_in_order(three_nodes):
    # Every node lost its scripts; the third answers its NOSCRIPT only after the round decided
    # at quorum on the other two (it was hung for a moment) and the caller left.
    dlm = connected_then_flushed(three_nodes)
    three_nodes[2].pause()
    try:
        lock = dlm.acquire("late-noscript", ttl=30.0)
    finally:
        three_nodes[2].resume()
    assert lock is not None
    # Nothing was sent to the third node after the acquisition: it runs the call anyway, with
    # the source, and holds what the others hold.
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [lock.value] * 3)
    # Its NOSCRIPT was no fault of the server's: it is not backed off, and the next lock
    # reaches it too.
    second = dlm.acquire("after-the-late-noscript", ttl=30.0)
    assert second is not None
    assert values_on(three_nodes, second.key) == [second.value] * 3
    assert dlm.release(second) is True
    assert dlm.release(lock) is True
    assert values_on(three_nodes, lock.key) == [None] * 3


def test_a_late_noscript_is_not_followed_behind_a_later_command(three_nodes):
    # The same, but the caller releases while the third node is still hung: the release is
    # queued behind the acquisition on that node's connection, so resending the acquisition when
    # its NOSCRIPT arrives would set the lock again after its release. It must not.
    dlm = connected_then_flushed(three_nodes)
    three_nodes[2].pause()
    try:
        lock = dlm.acquire("released-while-hung", ttl=30.0)
        assert lock is not None
        assert dlm.release(lock) is True  # a majority: the first two nodes
    finally:
        three_nodes[2].resume()
    time.sleep(0.2)  # the third node's late replies are read and handled meanwhile
    assert values_on(three_nodes, lock.key) == [None] * 3


def test_scripts_are_resent_after_script_flush(three_nodes):
    dlm = Redlock(three_nodes.urls)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))
    flush_scripts(three_nodes)
    lock = dlm.acquire("flushed", ttl=5.0)
    assert lock is not None
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [lock.value] * 3)
    flush_scripts(three_nodes)
    assert dlm.extend(lock, ttl=6.0) is True
    flush_scripts(three_nodes)
    assert dlm.release(lock) is True
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [None] * 3, timeout=1.0)


def test_a_node_that_answers_after_the_round_decided_still_sets_the_key(three_nodes):
    """A new connection loads the scripts with its first command: a node whose script cache is
    empty and whose reply comes only after a quorum decided still holds the key, instead of
    answering a NOSCRIPT that nobody reads."""
    flush_scripts(three_nodes)
    dlm = Redlock(three_nodes.urls, node_timeout=1.0)
    three_nodes[2].pause()
    try:
        lock = dlm.acquire("late-node", ttl=10.0)
        assert lock is not None  # decided by nodes 0 and 1
    finally:
        three_nodes[2].resume()
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [lock.value] * 3)
    assert dlm.release(lock) is True


def test_release_cleans_a_node_whose_script_cache_was_flushed(three_nodes):
    """The node whose cache is empty answers NOSCRIPT after the other two already made the
    quorum: its release must still happen (not wait for the ttl)."""
    dlm = Redlock(three_nodes.urls)
    leftovers = []
    for index in range(15):
        with three_nodes[2].client() as client:
            client.script_flush()
        lock = dlm.acquire(f"flush-{index}", ttl=30.0)
        assert lock is not None
        assert dlm.release(lock) is True
        if not wait_until(lambda lock=lock: values_on(three_nodes, lock.key) == [None] * 3, 0.5):
            leftovers.append(lock.key)
    assert leftovers == []


def test_failed_acquisition_cleans_up_on_nodes_with_flushed_scripts(three_nodes):
    dlm = Redlock(three_nodes.urls, retry_count=1)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))
    key = dlm.key_for("flushed-contended")
    flush_scripts(three_nodes)
    for server in three_nodes.servers[:2]:
        with server.client() as client:
            client.set(key, "someone-else", px=10_000)
    assert dlm.acquire("flushed-contended", ttl=5.0) is None
    assert wait_until(lambda: value_on(three_nodes[2], key) is None, timeout=1.0), (
        "our token stayed on the free node after a failed acquisition"
    )


def test_a_late_set_of_an_earlier_attempt_does_not_block_the_retry(three_nodes):
    # Node 2 is hung for good, so nodes 0 and 1 must both agree. Node 1 stalls longer than
    # node_timeout during the first attempt: its SET lands late, after the clean-up skipped the
    # backed-off node. The retry must recognise that key as its own (same token), not as a
    # stranger's lock that would block the resource for a whole ttl.
    # Enough attempts to outlast node 1's back-off (0.25 s) whatever the jitter.
    dlm = Redlock(three_nodes.urls, node_timeout=0.05, retry_delay=0.2, retry_count=8)
    dlm.release(dlm.acquire("warm", 10.0))
    three_nodes[2].pause()
    try:
        dlm.release(dlm.acquire("warm-again", 10.0))
        three_nodes[1].pause()
        resume = threading.Timer(0.08, three_nodes[1].resume)
        resume.start()
        lock = dlm.acquire("job", 10.0)
        resume.join()
        assert lock is not None
        assert values_on(three_nodes.servers[:2], lock.key) == [lock.value, lock.value]
        assert dlm.release(lock)
    finally:
        three_nodes[1].resume()
        three_nodes[2].resume()
