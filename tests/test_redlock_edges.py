"""The lock core on its edge paths, against real redis-server processes: nodes that answer with
errors, split votes, a node that restarted empty, fencing counters that must outlive their
locks, owner matching for every task id, and a fork at any moment."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redlock_support import (
    commands_seen,
    exit_code_of_forked_child,
    first_calls,
    pttl_on,
    script_commands,
    slow_reactor_disposals,
    value_on,
    values_on,
    wait_until,
)

from celery_redlock import Lock, QuorumUnavailable, Redlock
from celery_redlock.lock import keyspace
from celery_redlock.lock.keeper import LockKeeper
from celery_redlock.lock.nodes import Endpoint
from celery_redlock.lock.outcomes import Record
from celery_redlock.lock.owner import Owner, claim_prefix, lock_value, owner_text_of, run_prefix
from celery_redlock.lock.redlock import Acquired, Contended, Held, Unavailable, release_if_owner
from celery_redlock.lock.scripts import FENCE_AFTER_RELEASE_MILLISECONDS
from celery_redlock.testing import RedisNodes, RedisServer
from celery_redlock.testing.redis_servers import free_port

# -- error replies are not votes ----------------------------------------------------------------


def _evalsha_calls(server: RedisServer) -> int:
    with server.client() as client:
        stats = client.info("commandstats")
    return sum(
        int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval")
    )


def test_nodes_answering_errors_count_as_not_answering(three_nodes: RedisNodes) -> None:
    # Out of memory under noeviction: the node neither grants nor refuses. A majority of such
    # nodes is "no quorum", never "held by someone" (which made a run skip its work).
    for server in three_nodes.servers[:2]:
        with server.client() as client:
            client.config_set("maxmemory", 1)
    dlm = Redlock(three_nodes.urls, retry_count=2, retry_delay=0.01, node_timeout=0.5)
    outcome = dlm.attempt("oom", ttl=5.0)
    assert isinstance(outcome, Unavailable), outcome
    assert outcome.error.answered < 2
    with pytest.raises(QuorumUnavailable):
        dlm.acquire("oom", ttl=5.0)
    # ...and an erroring node is backed off like a silent one: the next calls skip it.
    calls = [_evalsha_calls(server) for server in three_nodes.servers[:2]]
    for _ in range(3):
        with pytest.raises(QuorumUnavailable):
            dlm.acquire("oom", ttl=5.0)
    assert [_evalsha_calls(server) for server in three_nodes.servers[:2]] == calls

    for server in three_nodes.servers[:2]:
        with server.client() as client:
            client.config_set("maxmemory", 0)
    # Back within about a second (the back-off is at most 1 s, then a probe).
    assert wait_until(lambda: isinstance(dlm.attempt("oom", ttl=5.0), Acquired), timeout=3)


def test_a_read_only_minority_does_not_block_a_majority(three_nodes: RedisNodes) -> None:
    with three_nodes[0].client() as client:
        client.config_set("min-replicas-to-write", 1)  # NOREPLICAS on every write
    dlm = Redlock(three_nodes.urls, node_timeout=0.5)
    lock = dlm.acquire("minority-errors", ttl=5.0)
    assert lock is not None
    assert values_on(three_nodes.servers[1:], lock.key) == [lock.value] * 2
    assert dlm.release(lock) is True


def test_a_split_vote_is_contention_not_a_holder(three_nodes: RedisNodes) -> None:
    dlm = Redlock(three_nodes.urls, retry_count=2, retry_delay=0.01, node_timeout=0.5)
    key = dlm.key_for("split")
    with three_nodes[0].client() as client:
        client.set(key, lock_value("a" * 40, "owner A"), px=1500)
    with three_nodes[1].client() as client:
        client.set(key, lock_value("b" * 40, "owner B"), px=1500)
    outcome = dlm.attempt("split", ttl=5.0)
    assert isinstance(outcome, Contended), outcome
    assert 0.5 < outcome.retry_in <= 1.5
    assert value_on(three_nodes[2], key) is None  # the failed attempt released its own SET
    # Waiting is woken by the leftovers' expiry, not by a guess.
    started = time.monotonic()
    acquired = dlm.attempt("split", ttl=5.0, wait=5.0)
    assert isinstance(acquired, Acquired)
    assert 0.5 < time.monotonic() - started < 3.0


# -- extension heals a node that restarted empty ------------------------------------------------


def test_extension_sets_the_lock_again_on_a_node_that_restarted_empty(
    three_nodes: RedisNodes,
) -> None:
    dlm = Redlock(three_nodes.urls, node_timeout=0.5)
    keeper = LockKeeper(dlm)
    lock = dlm.acquire("healed", ttl=1.5)
    assert lock is not None
    kept = keeper.keep(lock, lambda kept: None)
    try:
        three_nodes[0].kill()
        three_nodes[0].start()  # empty, like a node without persistence after a crash
        assert value_on(three_nodes[0], lock.key) is None
        # The next extension (a third of the validity later) puts it back, counter included.
        assert wait_until(lambda: value_on(three_nodes[0], lock.key) == lock.value, timeout=3)
        fence = value_on(three_nodes[0], lock.key + ":fence")
        assert fence is not None and int(fence) == lock.fencing_token
        assert not kept.is_lost
    finally:
        keeper.stop(kept)
    assert dlm.release(lock) is True
    # The release returned on a quorum; the third node's may still be on its way.
    assert wait_until(lambda: values_on(three_nodes, lock.key) == [None] * 3, timeout=1.0)


def test_extension_never_takes_over_another_owners_key(three_nodes: RedisNodes) -> None:
    dlm = Redlock(three_nodes.urls, node_timeout=0.5)
    lock = dlm.acquire("foreign", ttl=5.0)
    assert lock is not None
    other = lock_value("c" * 40, "someone else")
    for server in three_nodes.servers[:2]:
        with server.client() as client:
            client.set(lock.key, other, px=5000)
    assert dlm.extend(lock) is False
    assert lock.remaining() <= 0  # a majority says another owner holds it
    assert values_on(three_nodes.servers[:2], lock.key) == [other, other]


# -- fencing counters outlive their locks --------------------------------------------------------


def test_the_fencing_counter_is_never_shortened(one_node: RedisNodes) -> None:
    server = one_node[0]
    dlm = Redlock(one_node.urls, node_timeout=0.5)
    lock = dlm.acquire("fenced", ttl=10.0)
    assert lock is not None
    fence = lock.key + ":fence"
    assert dlm.extend(lock, ttl=1.0) is True  # a shorter extension...
    assert pttl_on(server, fence) > 9_000  # ...keeps the counter for the longer lock
    assert dlm.release(lock, hold=0.2) is True  # a short hold...
    assert pttl_on(server, fence) > 9_000  # ...does not shorten it either
    later = dlm.acquire("fenced", ttl=10.0, blocking=True, timeout=2.0)
    assert later is not None
    assert later.fencing_token > lock.fencing_token
    dlm.release(later)


def test_a_released_lock_leaves_its_fencing_counter_one_second(one_node: RedisNodes) -> None:
    server = one_node[0]
    dlm = Redlock(one_node.urls, node_timeout=0.5)
    lock = dlm.acquire("fenced", ttl=30.0)
    assert lock is not None
    fence = lock.key + ":fence"
    assert pttl_on(server, fence) > 29_000
    assert dlm.release(lock) is True
    assert 0 < pttl_on(server, fence) <= FENCE_AFTER_RELEASE_MILLISECONDS
    later = dlm.acquire("fenced", ttl=30.0)  # within the second: the counter orders the tokens
    assert later is not None
    assert later.fencing_token > lock.fencing_token
    dlm.release(later)
    with server.client() as client:  # nothing of a finished run stays on the node
        assert wait_until(lambda: not client.exists(fence), timeout=3.0, interval=0.05)
        assert client.keys("*fenced*") == []


# -- what an acquisition costs a node ------------------------------------------------------------


def test_an_acquisition_runs_five_commands_at_most_once_the_0_2_copy_is_off(
    one_node: RedisNodes,
) -> None:
    """Issue 40: the acquire script's own commands (MONITOR) on the default path of a task (with
    its record), without the 0.2-layout copy: five (the record, the lock, the reservation, the
    lock's SET, the counter's SET ... GET), whether the counter exists or not; a counter ahead of
    the caller's clock costs one SET more, and orders the token after it."""
    server = one_node[0]
    dlm = Redlock(one_node.urls, node_timeout=0.5, compat_0_2=False)
    key = dlm.key_for("costed")
    record = Record(keyspace.records_key(key, "task-1"), "message", (0, 0), 60.0)

    def acquire(with_record: Record | None = None) -> tuple[Lock, list[str]]:
        with commands_seen([server]) as seen:
            outcome = dlm.attempt("costed", 10.0, record=with_record)
        assert isinstance(outcome, Acquired), outcome
        assert dlm.release(outcome.lock)
        return outcome.lock, script_commands(seen[0])

    first, fresh = acquire(record)  # no counter yet
    second, again = acquire(record)  # the released lock's counter lives one more second
    assert fresh == again == ["HGET", "GET", "GET", "SET", "SET"]
    assert second.fencing_token > first.fencing_token
    assert acquire()[1] == ["GET", "GET", "SET", "SET"]  # a lock without a record

    ahead = time.time_ns() // 1000 + 10**12
    with server.client() as client:
        client.set(key + ":fence", ahead, px=60_000)
    lock, commands = acquire(record)
    assert commands == ["HGET", "GET", "GET", "SET", "SET", "SET"]
    assert lock.fencing_token == ahead + 1


def test_a_hold_keeps_the_lock_exactly_that_long(one_node: RedisNodes) -> None:
    # Holds shorter than the validity floor (about 53 ms with the defaults) work too.
    dlm = Redlock(one_node.urls)
    lock = dlm.acquire("held-briefly", ttl=30.0)
    assert lock is not None
    assert dlm.release(lock, hold=0.02) is True
    assert pttl_on(one_node[0], lock.key) <= 20  # about to expire, or gone already
    assert wait_until(lambda: value_on(one_node[0], lock.key) is None, timeout=0.5)


# -- owner texts: one format, matched exactly for every task id ---------------------------------

FIXTURE_REUSE = HealthCheck.function_scoped_fixture
TASK_IDS = st.text(min_size=1, max_size=40).filter(lambda text: "\x00" not in text)


@settings(max_examples=150, deadline=None, suppress_health_check=[FIXTURE_REUSE])
@given(task_id=TASK_IDS, other=TASK_IDS, pid=st.integers(1, 2**22), retries=st.integers(0, 99))
def test_owner_texts_round_trip_and_prefixes_match_only_their_own(
    task_id: str, other: str, pid: int, retries: int
) -> None:
    owner = Owner(id=task_id, task='t|"x"', retries=retries, host="h|ø", pid=pid, since=1.5)
    text = owner.to_text()
    assert Owner.parse(text) == owner
    assert owner_text_of(lock_value("ab" * 20, text)) == text
    assert text.startswith(run_prefix(task_id, pid, "h|ø"))
    assert not text.startswith(claim_prefix(task_id))
    claim = Owner(id=task_id, queued=True, host="h", pid=pid).to_text()
    assert claim.startswith(claim_prefix(task_id))
    if other != task_id:
        assert not text.startswith(run_prefix(other, pid, "h|ø"))
        assert not claim.startswith(claim_prefix(other))
    assert not text.startswith(run_prefix(task_id, pid + 1, "h|ø"))


@pytest.fixture(scope="module")
def shared_node() -> RedisServer:
    with RedisServer() as server:
        yield server


@settings(max_examples=60, deadline=None, suppress_health_check=[FIXTURE_REUSE])
@given(task_id=TASK_IDS, other=TASK_IDS)
def test_lua_matches_owners_of_any_task_id_exactly(
    shared_node: RedisServer, task_id: str, other: str
) -> None:
    dlm = Redlock([shared_node.url], node_timeout=1.0)
    host, pid = "worker-host", 4242
    # The run of another process (or another task id) is never freed by a lost process's match.
    lock = dlm.acquire("owners", ttl=5.0, owner=Owner(id=task_id, host=host, pid=pid).to_text())
    assert lock is not None
    assert release_if_owner(dlm, "owners", run_prefix(task_id, pid + 1, host)) == 0
    if other != task_id:
        assert release_if_owner(dlm, "owners", run_prefix(other, pid, host)) == 0
    assert release_if_owner(dlm, "owners", run_prefix(task_id, pid, host)) == 1
    # An enqueue-time claim is taken over by its own task id's run, and by no other.
    claim = dlm.acquire("owners", ttl=5.0, owner=Owner(id=task_id, queued=True).to_text())
    assert claim is not None
    if other != task_id:
        assert isinstance(dlm.attempt("owners", 5.0, replaces=claim_prefix(other)), Held)
    taken = dlm.attempt("owners", 5.0, replaces=claim_prefix(task_id))
    assert isinstance(taken, Acquired)
    assert dlm.release(taken.lock) is True


# -- a fork at any moment ------------------------------------------------------------------------


def test_a_fork_while_a_node_is_being_probed_leaves_the_child_working(
    one_node: RedisNodes,
) -> None:
    # Another thread keeps starting probes of a backed-off node while this one forks: a lock
    # held by that thread at the fork would stay held for ever in the child.
    node = Endpoint.from_url(one_node.urls[0], node_timeout=0.2)
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            node.mark_down(time.monotonic() - 10, "test")
            node.is_backed_off(time.monotonic())

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    try:
        for _ in range(30):
            child = os.fork()
            if child == 0:  # the child: must not hang starting a probe of its own
                signal.alarm(3)
                node.mark_down(time.monotonic() - 10, "child")
                node.is_backed_off(time.monotonic())
                node.wait_for_probe(1.0)
                os._exit(0)
            _, status = os.waitpid(child, 0)
            assert os.waitstatus_to_exitcode(status) == 0
    finally:
        stop.set()
        thread.join()


@pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"
)
def test_a_forked_childs_threads_share_one_new_lock_over_the_clean_ups() -> None:
    """Another thread holds an endpoint's lock over its clean-ups at the fork. In the child, 16
    threads owe clean-ups at once, switching as often as the interpreter lets them: none waits
    for the parent's lock, all take the same new one (each replacing it would let two threads
    change the clean-ups at once), and each clean-up is owed once (nothing listens on the
    server's port: nothing is paid meanwhile)."""
    endpoint = Endpoint.from_url(f"redis://127.0.0.1:{free_port()}/0", node_timeout=0.2)
    endpoint.owe(b"parent", b"packed", time.monotonic() + 60.0, "source")
    guard_at_fork = endpoint._debts()
    guard_at_fork.acquire()  # as by another thread of the parent, at the fork

    def child() -> bool:
        sys.setswitchinterval(1e-6)
        start = threading.Barrier(16)
        guards: list[int] = []

        def owe(number: int) -> None:
            start.wait()
            endpoint.owe(f"child-{number}".encode(), b"packed", time.monotonic() + 60.0, "source")
            guards.append(id(endpoint._debts()))

        threads = [threading.Thread(target=owe, args=(number,)) for number in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return len(set(guards)) == 1 and endpoint.owed == 17

    try:
        assert exit_code_of_forked_child(child, timeout=10.0) == 0
    finally:
        guard_at_fork.release()


@pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"
)
def test_a_forked_childs_16_first_calls_dispose_of_the_parents_connections_once(
    three_nodes: RedisNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As over TLS (tests/test_tls.py): each disposal of the parent's connections (by every
    thread of the child's first calls, and again when the child dropped the group) closed the
    wake-up pipe's descriptor numbers again, by then the child's new connections': replies went
    missing and members were backed off ("no reply within 0.5s"). The parent is not hurt: the
    child closes only its own descriptors."""
    # Held by the list alone: the child drops it (its finalizer disposes of the connections).
    redlocks = [Redlock(three_nodes.urls, node_timeout=0.5)]
    try:
        first_calls(redlocks[0], 1, "fork:parent")

        def child() -> bool:
            closes = slow_reactor_disposals(monkeypatch, 0.2)
            first_calls(redlocks[0], 16, "fork:child")
            first_calls(redlocks[0], 16, "fork:child-again")
            redlocks.clear()
            gc.collect()
            # The parent's reactor and the child's (its thread closes its sockets on its way out),
            # each once (and those of other dropped groups).
            wait_until(lambda: len(closes) >= 2, timeout=2.0)
            return len(closes) == len(set(closes)) >= 2

        assert exit_code_of_forked_child(child) == 0
        first_calls(redlocks[0], 1, "fork:parent-again")
    finally:
        redlocks[0].close()


def test_a_probe_start_cut_short_by_an_exception_is_made_again(
    one_node: RedisNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that claims a server's probe and is interrupted before the probe's thread starts
    (a soft time limit raising there) does not leave the server backed off for good: past
    PROBE_START_SECONDS, the next caller starts the probe, and the server answers again."""
    endpoint = Endpoint.from_url(one_node.urls[0], node_timeout=0.05)
    endpoint.mark_down(time.monotonic() - 1.0, "backed off for the test")  # its probe is due
    start = threading.Thread.start

    def interrupted_start(self: threading.Thread) -> None:
        monkeypatch.setattr(threading.Thread, "start", start)  # once
        raise KeyboardInterrupt("as a signal handler raises")

    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        endpoint.is_backed_off(time.monotonic())
    assert wait_until(lambda: not endpoint.is_backed_off(time.monotonic()), timeout=3.0)
