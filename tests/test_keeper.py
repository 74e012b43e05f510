"""The lock keeper on a real node: extends while a run lasts, never past its hard time limit,
and reports a lock that disappears."""

from __future__ import annotations

import threading
import time

import pytest
from redlock_support import wait_until

from celery_redlock import Redlock
from celery_redlock.lock.keeper import KeptLock, LockKeeper
from celery_redlock.testing import RedisNodes


def test_extension_stops_at_the_hard_time_limit_and_the_keeper_goes_on(
    one_node: RedisNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashes: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda info: crashes.append(info.exc_value))
    redlock = Redlock(one_node.urls, node_timeout=0.1)
    keeper = LockKeeper(redlock)
    lost: list[str] = []
    limited = redlock.acquire("limited", ttl=0.6)
    assert limited is not None
    started = time.monotonic()
    keeper.keep(limited, lambda kept: lost.append(kept.lock.key), hard_deadline=started + 1.2)
    with one_node[0].client() as client:
        while client.exists(limited.key) and time.monotonic() - started < 5:
            time.sleep(0.01)
        gone_after = time.monotonic() - started
        # Extended past its own 0.6 s ttl, and expired at the 1.2 s limit rather than later.
        assert 1.0 < gone_after < 1.5
        # The keeper, left with nothing to extend, still serves the next lock.
        later = redlock.acquire("later", ttl=0.6)
        assert later is not None
        keeper.keep(later, lambda kept: lost.append(kept.lock.key))
        time.sleep(1.0)
        assert client.pttl(later.key) > 0
    assert lost == []
    assert crashes == []


def test_a_lock_taken_over_behind_the_keepers_back_is_reported_lost(one_node: RedisNodes) -> None:
    redlock = Redlock(one_node.urls, node_timeout=0.1)
    keeper = LockKeeper(redlock)
    reported = threading.Event()
    reasons: list[str] = []

    def on_lost(kept: KeptLock) -> None:
        reasons.append(kept.lost_reason)
        reported.set()

    lock = redlock.acquire("stolen", ttl=0.9)
    assert lock is not None
    kept = keeper.keep(lock, on_lost)
    with one_node[0].client() as client:
        client.set(lock.key, "another-token|another owner", px=5000)
    assert reported.wait(2.0)
    assert kept.is_lost and "no longer hold its token" in reasons[0]


def test_a_lock_deleted_behind_the_keepers_back_is_set_again(one_node: RedisNodes) -> None:
    # What a node that restarted empty looks like: the key is missing. The next extension
    # sets it again (the lock is still valid by the holder's clock), and nothing is lost.
    redlock = Redlock(one_node.urls, node_timeout=0.1)
    keeper = LockKeeper(redlock)
    lost: list[str] = []
    lock = redlock.acquire("deleted", ttl=0.9)
    assert lock is not None
    kept = keeper.keep(lock, lambda kept: lost.append(kept.lost_reason))
    with one_node[0].client(decode_responses=True) as client:
        client.delete(lock.key)
        assert wait_until(lambda: client.get(lock.key) == lock.value, timeout=2.0)
        assert 0 < client.pttl(lock.key) <= 900
    keeper.stop(kept)
    assert not kept.is_lost and lost == []
    assert redlock.release(lock) is True


@pytest.mark.parametrize("stale", ["not-extended", "stopped-after-its-entry-ran"])
def test_stopping_other_locks_never_drops_a_running_lock_from_the_keeper(
    one_node: RedisNodes, stale: str
) -> None:
    # The keeper drops the entries of stopped locks in bulk. A stop that has no entry left in
    # the queue (a lock kept without auto-extension, or one whose entry the thread already took
    # out) must not make it drop the entry of a lock whose body still runs: that lock would
    # expire under its body, and another worker could take it.
    redlock = Redlock(one_node.urls, node_timeout=0.1)
    keeper = LockKeeper(redlock)
    lost: list[str] = []
    running = redlock.acquire("running", ttl=0.6)
    other = redlock.acquire("other", ttl=0.3)
    assert running is not None and other is not None
    if stale == "not-extended":
        keeper.keep(running, lambda kept: lost.append(kept.lock.key))
        keeper.stop(keeper.keep(other, lambda kept: lost.append(kept.lock.key), auto_extend=False))
    else:
        keeper.keep(running, lambda kept: lost.append(kept.lock.key))
        stopped = keeper.keep(other, lambda kept: lost.append(kept.lock.key))
        keeper.stop(stopped)  # its entry stays queued until it is due (0.1 s), then taken out
        time.sleep(0.25)
        third = redlock.acquire("third", ttl=5.0)
        assert third is not None
        keeper.stop(keeper.keep(third, lambda kept: lost.append(kept.lock.key)))
    time.sleep(1.2)  # twice the running lock's own 0.6 s ttl
    with one_node[0].client() as client:
        assert client.pttl(running.key) > 0, "the running lock was no longer extended"
    assert lost == []
