"""The Redlock core against real redis-server processes: quorum, validity, ownership, clean-up.

Fault timing (hung and dead nodes), concurrency, blocking waits and configuration live in the
sibling tests/test_redlock_*.py modules.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
from redlock_support import pttl_on, value_on, values_on, wait_until

from celery_redlock import Lock, LockNotAcquired, QuorumUnavailable, Redlock
from celery_redlock.lock.nodes.channel import hung_after
from celery_redlock.lock.redlock import Held, drift
from celery_redlock.testing import RedisNodes, RedisServer

# --- quorum ------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_quorum_needs_a_majority_of_nodes(redis_nodes, caplog, count):
    caplog.set_level(logging.WARNING, logger="celery_redlock")
    nodes: RedisNodes = redis_nodes(count)
    dlm = Redlock(nodes.urls, retry_count=1)
    quorum = count // 2 + 1
    assert dlm.quorum == quorum
    warned_even = any("even number" in record.getMessage() for record in caplog.records)
    assert warned_even == (count % 2 == 0), caplog.text

    # Exactly a quorum of nodes up: acquisition succeeds and the key is on each of them.
    for server in nodes.servers[quorum:]:
        server.kill()
    live = nodes.servers[:quorum]
    lock = dlm.acquire("quorum", ttl=5.0)
    assert lock is not None
    assert values_on(live, lock.key) == [lock.value] * quorum
    assert dlm.release(lock) is True
    assert values_on(live, lock.key) == [None] * quorum

    # One node fewer: a clean refusal that names what was needed.
    nodes[quorum - 1].kill()
    with pytest.raises(QuorumUnavailable) as info:
        dlm.acquire("quorum", ttl=5.0)
    assert info.value.needed == quorum
    assert info.value.answered < quorum
    assert info.value.key == dlm.key_for("quorum")
    # Nothing of ours stays behind on the nodes that are still up.
    assert wait_until(
        lambda: values_on(nodes.servers[: quorum - 1], "redlock:{quorum}") == [None] * (quorum - 1)
    )


def test_two_nodes_need_both(redis_nodes, caplog):
    caplog.set_level(logging.WARNING, logger="celery_redlock")
    nodes = redis_nodes(2)
    dlm = Redlock(nodes.urls, retry_count=1)
    assert "even number" in caplog.text
    assert "use an odd number" in caplog.text
    lock = dlm.acquire("pair", ttl=5.0)
    assert lock is not None
    dlm.release(lock)
    nodes[1].pause()
    try:
        with pytest.raises(QuorumUnavailable):
            dlm.acquire("pair", ttl=5.0)
    finally:
        nodes[1].resume()


# --- validity ----------------------------------------------------------------------------------


def test_validity_accounting_and_pttl_on_every_node(three_nodes):
    dlm = Redlock(three_nodes.urls)
    ttl = 2.0
    before = time.monotonic()
    lock = dlm.acquire("validity", ttl=ttl)
    took = time.monotonic() - before
    assert isinstance(lock, Lock)
    assert lock.resource == "validity"
    assert lock.key == "redlock:{validity}"
    assert len(lock.token) == 40 and int(lock.token, 16) >= 0
    assert lock.ttl == ttl
    # validity = ttl - elapsed - drift: never more than ttl - drift, positive, and not much less
    # than that on a local machine (elapsed is the round trip).
    assert 0 < lock.validity <= ttl - drift(dlm, ttl)
    assert lock.validity >= ttl - drift(dlm, ttl) - took - 0.001
    first = lock.remaining()
    assert 0 < first <= lock.validity
    time.sleep(0.02)
    second = lock.remaining()
    assert second < first - 0.015
    # The acquisition returned on a quorum; the third SET may still be on its way.
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [lock.token] * 3)
    for server in three_nodes:
        remaining_ms = pttl_on(server, lock.key)
        # Set with the whole ttl during the acquisition: it expires no sooner than that.
        elapsed_ms = (time.monotonic() - before) * 1000
        assert ttl * 1000 - elapsed_ms - 5 < remaining_ms <= ttl * 1000

    # Extending resets the ttl on every node and the validity accordingly.
    assert dlm.extend(lock, ttl=4.0) is True
    assert lock.ttl == 4.0
    assert 4.0 - drift(dlm, 4.0) - 0.25 < lock.validity <= 4.0 - drift(dlm, 4.0)
    assert lock.remaining() > 3.5
    for server in three_nodes:
        assert 3750 < pttl_on(server, lock.key) <= 4000
    assert dlm.release(lock) is True
    assert lock.remaining() == 0  # not minus the machine's uptime (issue 25, problem 7)
    assert values_on(three_nodes, lock.key) == [None, None, None]


def test_ttl_too_small_or_invalid_raises_configuration_error(one_node):
    from celery_redlock.errors import ConfigurationError

    dlm = Redlock(one_node.urls, node_timeout=0.05)
    for ttl in (0.05, 0.01, 0.0, -1.0, float("nan"), float("inf"), "10", None, True):
        with pytest.raises(ConfigurationError, match="ttl") as info:
            dlm.acquire("small", ttl=ttl)
        assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigurationError, match=r"few tenths of a second"):
        dlm.acquire("small", ttl=0.05)
    # Nothing was written for any of the refused calls.
    assert value_on(one_node[0], "redlock:{small}") is None
    # The smallest sensible ttl works.
    lock = dlm.acquire("small", ttl=0.2)
    assert lock is not None and 0 < lock.validity < 0.2


def test_expired_lock_is_not_returned_as_valid_and_frees_the_resource(three_nodes):
    dlm = Redlock(three_nodes.urls)
    lock = dlm.acquire("short", ttl=0.3)
    assert lock is not None
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [None] * 3, timeout=2.0)
    assert lock.remaining() == 0
    assert dlm.extend(lock) is False
    other = dlm.acquire("short", ttl=5.0)
    assert other is not None and other.token != lock.token


# --- ownership ---------------------------------------------------------------------------------


def test_only_the_owner_can_release_or_extend(three_nodes):
    dlm = Redlock(three_nodes.urls)
    stranger = Redlock(three_nodes.urls)
    lock = dlm.acquire("owned", ttl=5.0)
    assert lock is not None
    # The acquisition returned on a quorum; wait for the third SET (an extension sets a key
    # again where it is missing, so a forged one racing that SET could plant its value there).
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [lock.value] * 3)
    forged = dataclasses.replace(lock, token="x" * 40)

    assert stranger.release(forged) is False
    assert dlm.release(forged) is False
    assert stranger.extend(forged, ttl=30.0) is False
    assert values_on(three_nodes, lock.key) == [lock.value] * 3
    for server in three_nodes:
        assert pttl_on(server, lock.key) <= 5000  # the forged extension changed nothing

    # A second acquisition by anyone else sees the lock as held.
    assert stranger.acquire("owned", ttl=5.0) is None
    assert values_on(three_nodes, lock.key) == [lock.value] * 3

    assert dlm.release(lock) is True
    assert values_on(three_nodes, lock.key) == [None] * 3


def test_owner_metadata_is_stored_beside_the_token(three_nodes):
    dlm = Redlock(three_nodes.urls)
    lock = dlm.acquire("meta", ttl=5.0, owner="host-1:pid-42")
    assert lock is not None
    assert lock.value == f"{lock.token}|host-1:pid-42"
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [lock.value] * 3)
    forged = dataclasses.replace(lock, owner="host-2:pid-7")
    assert dlm.release(forged) is False
    held = dlm.attempt("meta", ttl=5.0)
    assert isinstance(held, Held) and held.holder == "host-1:pid-42"
    assert 4.0 < held.expires_in <= 5.0
    assert dlm.release(lock) is True


def test_stale_holder_cannot_release_or_extend_the_next_holders_lock(three_nodes):
    first = Redlock(three_nodes.urls)
    second = Redlock(three_nodes.urls)
    old = first.acquire("handover", ttl=0.3)
    assert old is not None
    # The old holder stalls past its ttl; the keys expire on every node.
    assert wait_until(lambda: values_on(three_nodes, old.key) == [None] * 3, timeout=2.0)
    new = second.acquire("handover", ttl=10.0)
    assert new is not None
    # Decided at quorum: the third node (connected last by this new client) may set it after.
    assert wait_until(lambda: values_on(three_nodes, new.key) == [new.value] * 3)

    assert first.release(old) is False
    # Even with validity left on paper (a clock that says otherwise), the token decides.
    revived = dataclasses.replace(old, valid_until=time.monotonic() + 10)
    assert first.extend(revived, ttl=10.0) is False
    assert first.release(dataclasses.replace(old)) is False
    assert values_on(three_nodes, new.key) == [new.value] * 3
    assert second.release(new) is True


# --- clean-up of nodes that did not (visibly) acquire ------------------------------------------


def test_failed_acquisition_leaves_our_token_on_no_node(three_nodes):
    dlm = Redlock(three_nodes.urls, retry_count=3, retry_delay=0.01)
    key = dlm.key_for("contended")
    # Somebody else holds the lock on a majority (0 and 1); node 2 is free, so each of our
    # attempts does get its SET accepted there and must take it back.
    for server in three_nodes.servers[:2]:
        with server.client() as client:
            client.set(key, "someone-else", px=10_000)
    assert dlm.acquire("contended", ttl=5.0) is None
    assert wait_until(lambda: value_on(three_nodes[2], key) is None, timeout=1.0), value_on(
        three_nodes[2], key
    )
    assert values_on(three_nodes.servers[:2], key) == ["someone-else"] * 2


def test_failed_acquisition_with_a_dead_node_cleans_up_the_live_one(three_nodes):
    dlm = Redlock(three_nodes.urls, retry_count=2, retry_delay=0.01)
    key = dlm.key_for("split")
    with three_nodes[2].client() as client:
        client.set(key, "someone-else", px=10_000)
    three_nodes[1].kill()
    # Node 0 accepts our SET, node 1 is dead, node 2 is held: a majority answered but did not
    # agree, so the lock is not ours (None) and not "unavailable" either.
    for _ in range(10):
        assert dlm.acquire("split", ttl=5.0) is None
        assert wait_until(lambda: value_on(three_nodes[0], key) is None, timeout=1.0)
    assert value_on(three_nodes[2], key) == "someone-else"
    three_nodes[2].kill()
    with pytest.raises(QuorumUnavailable):
        dlm.acquire("split", ttl=5.0)
    assert wait_until(lambda: value_on(three_nodes[0], key) is None, timeout=1.0)


def test_a_held_lock_with_a_minority_down_is_reported_as_held_not_unavailable(three_nodes):
    """A lock held on the two live nodes while the third is dead is *held*: returning None
    (or LockNotAcquired) is right, QuorumUnavailable is not (a policy such as
    on_unavailable="run" would then run a duplicate)."""
    holder = Redlock(three_nodes.urls)
    lock = holder.acquire("held", ttl=30.0)
    assert lock is not None
    three_nodes[0].kill()
    dlm = Redlock(three_nodes.urls, retry_count=1)
    outcomes = []
    for _ in range(30):
        try:
            outcomes.append(dlm.acquire("held", ttl=5.0))
        except QuorumUnavailable as error:
            outcomes.append(error)
    assert outcomes == [None] * 30
    with pytest.raises(LockNotAcquired), dlm.lock("held", ttl=5.0):
        pass


def test_release_reaches_a_node_whose_set_landed_late(three_nodes):
    dlm = Redlock(three_nodes.urls, node_timeout=0.2)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))  # open connections: the SET gets sent
    three_nodes[0].pause()
    try:
        lock = dlm.acquire("late", ttl=10.0)
        assert lock is not None
        assert values_on(three_nodes.servers[1:], lock.key) == [lock.value] * 2
    finally:
        three_nodes[0].resume()
    # The hung node executes the SET it had in its socket buffer once it runs again...
    assert wait_until(lambda: value_on(three_nodes[0], lock.key) == lock.value, timeout=2.0)
    assert pttl_on(three_nodes[0], lock.key) <= 10_000
    # ...and the release removes it there too, although that node never answered in time.
    assert dlm.release(lock) is True
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [None] * 3, timeout=1.0), (
        values_on(three_nodes, lock.key)
    )


def test_a_release_of_a_set_a_stalled_node_still_holds_removes_it(three_nodes):
    # A node stalled past node_timeout is backed off (though every round decided at quorum
    # without it); the release owes it the clean-up, and once it runs again — the late SET first,
    # on the connection it came on — the clean-up follows and removes it within a second.
    dlm = Redlock(three_nodes.urls, node_timeout=0.05)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))  # open connections: the SET gets sent
    three_nodes[0].pause()
    try:
        lock = dlm.acquire("queued", ttl=10.0)
        assert lock is not None
        time.sleep(0.1)  # longer than node_timeout, shorter than hung_after
        assert dlm.release(lock) is True
    finally:
        three_nodes[0].resume()
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [None] * 3, timeout=1.0)

    # Back in the rounds (by a late reply or by the probe): a lock is on every node again.
    def on_every_node() -> bool:
        again = dlm.acquire("queued", ttl=10.0)
        assert again is not None
        everywhere = values_on(three_nodes, again.key) == [again.value] * 3
        assert dlm.release(again) is True
        return everywhere

    assert wait_until(on_every_node, timeout=3.0)


def connections_received(server: RedisServer) -> int:
    """Connections the server has accepted so far (asking opens one more)."""
    with server.client(socket_timeout=2) as client:
        return int(client.info("stats")["total_connections_received"])


def test_a_set_landing_after_the_release_expires_within_the_ttl(three_nodes):
    # A node silent for longer than hung_after is hung: its connection is closed, so the
    # release cannot reach it, and the SET it had in its socket buffer lands after the release.
    node_timeout = 0.05
    hang = hung_after(node_timeout) + 0.1
    ttl = hang + 0.5
    dlm = Redlock(three_nodes.urls, node_timeout=node_timeout)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))  # open connections: the SET gets sent
    three_nodes[0].pause()
    try:
        lock = dlm.acquire("later", ttl=ttl)
        assert lock is not None
        time.sleep(hang)
        assert dlm.release(lock) is True
        assert values_on(three_nodes.servers[1:], lock.key) == [None, None]
    finally:
        three_nodes[0].resume()
    resumed = time.monotonic()
    # Whatever the hung node executes late, it never keeps our key longer than the ttl.
    seen = []

    def gone() -> bool:
        with three_nodes[0].client(socket_timeout=2, decode_responses=True) as client:
            value, remaining_ms = client.get(lock.key), client.pttl(lock.key)
        if value is not None:
            seen.append((value, remaining_ms))
        return value is None and time.monotonic() - resumed > 0.05

    assert wait_until(gone, timeout=ttl + 1.0)
    assert time.monotonic() - resumed <= ttl + 0.5
    # The release gave up on the hung node, so the SET did land there after the release: it
    # was seen, with our value and at most the ttl.
    assert seen
    for value, remaining_ms in seen:
        assert value == lock.value
        assert remaining_ms != -1  # always with an expiry...
        assert remaining_ms <= ttl * 1000  # ...of at most the ttl
