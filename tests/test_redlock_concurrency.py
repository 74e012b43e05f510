"""Mutual exclusion under contention (threads and processes) and blocking acquisition."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import pytest
from redlock_support import Stopwatch, pttl_on, run_together, value_on, values_on, wait_until

from celery_redlock import LockNotAcquired, Redlock

# --- no two holders, ever ----------------------------------------------------------------------


def test_threads_never_hold_the_lock_together(three_nodes):
    threads_count, cycles = 16, 12
    # node_timeout well above the default: 16 threads on a small, busy machine must not make
    # healthy nodes look hung (this test is about exclusion, the fault tests are about timing).
    dlm = Redlock(three_nodes.urls, retry_delay=0.01, node_timeout=0.5)
    guard = threading.Lock()
    inside: list[int] = []
    violations: list[str] = []
    failures: list[BaseException] = []
    counter = [0]
    acquired = [0]
    start = threading.Barrier(threads_count)

    def worker(number: int) -> None:
        try:
            start.wait()
            for _ in range(cycles):
                lock = dlm.acquire("threads", ttl=10.0, blocking=True, timeout=20.0)
                if lock is None:
                    violations.append(f"thread {number} timed out waiting")
                    return
                with guard:
                    if inside:
                        violations.append(f"thread {number} entered while {inside} inside")
                    inside.append(number)
                    acquired[0] += 1
                # Unprotected read-modify-write: only the lock keeps it from losing updates.
                seen = counter[0]
                time.sleep(0.0005)
                counter[0] = seen + 1
                with guard:
                    inside.remove(number)
                if not dlm.release(lock):
                    violations.append(f"thread {number} could not release its lock")
        except BaseException as error:
            failures.append(error)

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(threads_count)]
    with Stopwatch() as watch:
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(timeout=40)
    print(
        f"\n{threads_count} threads x {cycles} cycles on 3 nodes: {watch.elapsed:.2f} s "
        f"({watch.elapsed / (threads_count * cycles) * 1000:.1f} ms per hand-over)"
    )
    assert not any(thread.is_alive() for thread in workers)
    assert failures == []
    assert violations == []
    assert acquired[0] == threads_count * cycles
    assert counter[0] == threads_count * cycles
    # Every release reached a majority. A minority node can keep a key until its ttl only if
    # it was backed off (no reply within node_timeout on a loaded machine) when the release
    # went out: releases skip backed-off nodes. Never without an expiry.
    left = values_on(three_nodes, "redlock:{threads}")
    assert left.count(None) >= 2, left
    for server, value in zip(three_nodes, left, strict=True):
        if value is not None:
            print(f"left on a minority node: {value} (pttl {pttl_on(server, 'redlock:{threads}')})")
            assert 0 <= pttl_on(server, "redlock:{threads}") <= 10_000


_PROCESS_WORKER = r"""
import json, os, sys, time
from celery_redlock import Redlock

urls, cycles, log_path, counter_path = json.loads(sys.argv[1])
# A generous node_timeout: on a small busy machine, 4 processes must not make nodes look hung.
dlm = Redlock(urls, retry_delay=0.01, node_timeout=0.5)
print("ready", flush=True)
sys.stdin.readline()  # wait for "go", so that every process contends from the start
for _ in range(cycles):
    lock = dlm.acquire("processes", ttl=10.0, blocking=True, timeout=20.0)
    if lock is None:
        sys.exit(3)
    started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    with open(counter_path) as handle:
        seen = int(handle.read() or 0)
    time.sleep(0.002)
    with open(counter_path, "w") as handle:
        handle.write(str(seen + 1))
    ended = time.monotonic()
    with open(log_path, "a") as handle:
        handle.write(f"{os.getpid()} {started!r} {ended!r}\n")
    if not dlm.release(lock):
        sys.exit(4)
"""


def test_processes_never_hold_the_lock_together(three_nodes, tmp_path: Path):
    processes_count, cycles = 4, 15
    log_path = tmp_path / "intervals.log"
    counter_path = tmp_path / "counter"
    counter_path.write_text("0")
    log_path.write_text("")
    argument = json.dumps([three_nodes.urls, cycles, str(log_path), str(counter_path)])
    with Stopwatch() as watch:
        errors = run_together(_PROCESS_WORKER, argument, processes_count, timeout=40)
    print(f"\n{processes_count} processes x {cycles} cycles: {watch.elapsed:.2f} s")
    assert not errors, errors

    intervals = []
    for line in log_path.read_text().splitlines():
        pid, started, ended = line.split()
        intervals.append((float(started), float(ended), int(pid)))
    assert len(intervals) == processes_count * cycles
    assert len({pid for _, _, pid in intervals}) == processes_count
    intervals.sort()
    for (_, previous_end, previous_pid), (next_start, _, next_pid) in itertools.pairwise(intervals):
        assert previous_end <= next_start, (
            f"process {next_pid} entered at {next_start} before {previous_pid} left at "
            f"{previous_end}"
        )
    assert int(counter_path.read_text()) == processes_count * cycles


# --- blocking acquisition ----------------------------------------------------------------------


def _subscribers(nodes, channel: str) -> list[int]:
    counts = []
    for server in nodes:
        with server.client() as client:
            counts.append(int(dict(client.pubsub_numsub(channel)).get(channel.encode(), 0)))
    return counts


def test_blocking_waiter_is_woken_by_the_release(three_nodes):
    holder_dlm = Redlock(three_nodes.urls)
    # A long retry delay and a long ttl: only the release notification can wake the waiter soon.
    waiter_dlm = Redlock(three_nodes.urls, retry_delay=2.0)
    held = holder_dlm.acquire("wake", ttl=30.0)
    assert held is not None
    result = {}

    def waiter() -> None:
        result["lock"] = waiter_dlm.acquire("wake", ttl=30.0, blocking=True, timeout=5.0)
        result["at"] = time.monotonic()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        # Wait for the waiter to listen on every node (an event, not a guess).
        assert wait_until(lambda: _subscribers(three_nodes, held.key) == [1, 1, 1], timeout=3.0)
        assert "lock" not in result  # still waiting: the lock is held
        released_at = time.monotonic()
        assert holder_dlm.release(held) is True
    finally:
        thread.join(timeout=10)
    assert not thread.is_alive()
    lock = result["lock"]
    delay = result["at"] - released_at
    print(f"\nblocking waiter got the lock {delay * 1000:.1f} ms after the release")
    assert lock is not None
    assert delay < 0.3
    # On a majority at least: the waiter's SET may reach a node just before the release does.
    assert values_on(three_nodes, lock.key).count(lock.value) >= 2
    # The waiter's subscriptions are gone once it has the lock.
    assert wait_until(lambda: _subscribers(three_nodes, held.key) == [0, 0, 0], timeout=1.0)
    assert waiter_dlm.release(lock) is True


def test_blocking_waiter_gets_an_expired_lock_without_a_release(three_nodes):
    holder = Redlock(three_nodes.urls)
    held = holder.acquire("expiring", ttl=0.5)
    assert held is not None
    waiter = Redlock(three_nodes.urls, retry_delay=0.05)
    with Stopwatch() as watch:
        lock = waiter.acquire("expiring", ttl=5.0, blocking=True, timeout=5.0)
    print(f"\nblocking waiter got an abandoned (0.5 s ttl) lock after {watch.elapsed:.3f} s")
    assert lock is not None
    assert 0.3 < watch.elapsed < 1.0
    # A majority at least (the old key may outlive the others by a millisecond on one node).
    assert values_on(three_nodes, lock.key).count(lock.value) >= 2


def test_blocking_acquire_times_out_with_none(three_nodes):
    dlm = Redlock(three_nodes.urls)
    held = dlm.acquire("busy", ttl=30.0)
    assert held is not None
    with Stopwatch() as watch:
        assert dlm.acquire("busy", ttl=5.0, blocking=True, timeout=0.5) is None
    print(f"\nblocking acquire with timeout=0.5 gave up after {watch.elapsed:.3f} s")
    assert 0.5 <= watch.elapsed < 0.5 + 0.3
    assert values_on(three_nodes, held.key) == [held.value] * 3
    assert _subscribers(three_nodes, held.key) == [0, 0, 0]


def test_non_blocking_acquire_of_a_held_lock_returns_none_at_once(three_nodes):
    dlm = Redlock(three_nodes.urls, retry_delay=1.0)
    held = dlm.acquire("busy-now", ttl=30.0)
    assert held is not None
    with Stopwatch() as watch:
        assert dlm.acquire("busy-now", ttl=5.0) is None
    # A majority named one holder: no retry sleeps.
    assert watch.elapsed < 0.1
    assert values_on(three_nodes, held.key) == [held.value] * 3


def test_context_manager_releases_and_raises_when_held(three_nodes):
    dlm = Redlock(three_nodes.urls)
    with dlm.lock("ctx", ttl=5.0) as lock:
        assert values_on(three_nodes, lock.key) == [lock.value] * 3
        with pytest.raises(LockNotAcquired) as info, dlm.lock("ctx", ttl=5.0):
            pytest.fail("entered a held lock")
        assert info.value.key == "redlock:{ctx}"
        assert "redlock:{ctx}" in str(info.value)
        assert values_on(three_nodes, lock.key) == [lock.value] * 3  # the holder's lock is intact
    assert values_on(three_nodes, lock.key) == [None] * 3

    with pytest.raises(RuntimeError, match="boom"), dlm.lock("ctx", ttl=5.0) as lock:
        raise RuntimeError("boom")
    assert value_on(three_nodes[0], lock.key) is None  # released on the way out of an error
