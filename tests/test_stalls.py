"""Nodes that stall for a moment (SIGSTOP for 50-200 ms, then SIGCONT) leave nothing behind.

A stalled server still holds the commands it was sent, and runs them once it resumes: a SET of an
attempt that failed meanwhile, an extension that timed out. Whatever clean-up the caller sent
after that (the failed attempt's release, the lock's release) must reach that server too, even
though it was backed off when the clean-up was sent: another caller then takes the lock within a
second of the servers answering again, not after the whole ttl.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from celery_apps.subprocesses import WorkerProcess, app_environment, control_app
from celery_apps.support import RunLog
from redlock_support import collect_results_while_the_broker_is_up, value_on, wait_until
from reply_faults import FaultyProxy

from celery_redlock import QuorumUnavailable, Redlock
from celery_redlock.lock.nodes import Endpoint
from celery_redlock.lock.nodes.resp import pack_command
from celery_redlock.lock.outcomes import Acquired
from celery_redlock.lock.scripts import RELEASE
from celery_redlock.testing import RedisNodes, RedisServer, celery_processes

NODE_TIMEOUT = 0.05  # the default
TTL = 30.0


def _resume(servers, stall: float) -> float:
    time.sleep(stall)
    for server in servers:
        server.resume()
    return time.monotonic()


def _taken_within(other: Redlock, resource: str, seconds: float) -> float | None:
    """Seconds until ``other`` takes ``resource`` (trying every 20 ms), None if it never does."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        lock = other.acquire(resource, ttl=5.0)
        if lock is not None:
            other.release(lock)
            return time.monotonic() - started
        time.sleep(0.02)
    return None


@pytest.mark.parametrize("stalled", [1, 2], ids=["minority", "majority"])
@pytest.mark.parametrize("stall", [0.05, 0.2])
def test_a_stall_during_an_acquisition_leaves_no_lock_behind(three_nodes, stalled, stall):
    caller = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    other = Redlock(three_nodes.urls, retry_count=1, node_timeout=0.5)
    caller.release(caller.acquire("warm-up", ttl=1.0))  # connections open, scripts loaded
    frozen = three_nodes.servers[3 - stalled :]
    for server in frozen:
        server.pause()
    try:
        lock = caller.acquire("stalled-attempt", ttl=TTL) if stalled == 1 else None
        if stalled == 2:
            with pytest.raises(QuorumUnavailable):
                caller.acquire("stalled-attempt", ttl=TTL)
        else:
            assert lock is not None
            caller.release(lock, confirm=False)  # what a finished run does
    finally:
        resumed = _resume(frozen, stall)
    # The frozen servers now run the SET (and, for the minority, the lock's release) they held.
    waited = _taken_within(other, "stalled-attempt", 3.0)
    print(f"\n{stalled} of 3 stalled {stall * 1000:.0f} ms: taken again after {waited} s")
    assert waited is not None and waited < 1.0, "the stalled attempt's SET outlived it"
    key = caller.key_for("stalled-attempt")
    assert wait_until(lambda: all(value_on(s, key) is None for s in three_nodes.servers), 1.0)
    assert time.monotonic() - resumed < 2.0


@pytest.mark.parametrize("stall", [0.05, 0.15])
def test_a_release_after_a_timed_out_extension_reaches_the_stalled_nodes(three_nodes, stall):
    caller = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    other = Redlock(three_nodes.urls, retry_count=1, node_timeout=0.5)
    lock = caller.acquire("stalled-release", ttl=TTL)
    assert lock is not None
    frozen = three_nodes.servers[1:]
    for server in frozen:
        server.pause()
    try:
        assert caller.extend(lock) is False  # timed out: both stalled nodes are backed off
        caller.release(lock, confirm=False)
    finally:
        _resume(frozen, stall)
    waited = _taken_within(other, "stalled-release", 3.0)
    print(f"\nrelease during a {stall * 1000:.0f} ms stall: taken again after {waited} s")
    assert waited is not None and waited < 1.0, "the release never reached the stalled nodes"


def test_a_confirmed_release_reaches_nodes_that_were_backed_off(three_nodes):
    caller = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    lock = caller.acquire("confirmed-release", ttl=TTL)
    assert lock is not None
    frozen = three_nodes.servers[1:]
    for server in frozen:
        server.pause()
    try:
        assert caller.extend(lock) is False
        assert caller.release(lock) is False  # skipped the backed-off nodes: unconfirmed
    finally:
        _resume(frozen, 0.1)
    assert wait_until(lambda: all(value_on(s, lock.key) is None for s in frozen), 1.0)


def test_a_clean_up_owed_to_a_dead_node_is_dropped_once_its_keys_expired(three_nodes):
    """Nothing is kept for ever for a node that never comes back: the clean-up is owed only as
    long as what it removes could live."""
    caller = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    caller.release(caller.acquire("warm-up", ttl=1.0))
    frozen = three_nodes.servers[1:]
    for server in frozen:
        server.pause()
    try:
        with pytest.raises(QuorumUnavailable):
            caller.acquire("short", ttl=0.3)
        endpoints = [node.endpoint_for("x") for node in caller.nodes[1:]]
        assert all(endpoint is not None and endpoint.owed for endpoint in endpoints)
        assert wait_until(lambda: not any(e.owed for e in endpoints if e is not None), 2.0)
    finally:
        for server in frozen:
            server.resume()


def test_a_node_down_is_owed_only_the_releases_of_locks_it_may_hold(three_nodes):
    """A node that is down costs rounds nothing but its vote: locks taken while it was backed
    off never reached it, and their releases owe it nothing (on a4a6924 every call owed it one,
    thousands within seconds, and scanned them all on every acquisition). A lock it granted
    before it stopped is still owed its release."""
    caller = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    before = caller.acquire("granted-before-the-stall", ttl=TTL)
    assert before is not None
    three_nodes[2].pause()
    try:
        assert caller.extend(before) is True  # two of three extend it: node 2 backed off
        endpoint = caller.nodes[2].endpoint_for(before.key)
        assert endpoint is not None
        assert wait_until(lambda: endpoint.is_backed_off(time.monotonic()))
        owed_at_stall = endpoint.owed
        for number in range(200):
            lock = caller.acquire(f"while-down:{number}", ttl=TTL)
            assert lock is not None and lock.unreached == frozenset({2})
            assert caller.release(lock)
        assert endpoint.owed == owed_at_stall
        assert caller.release(before)
        assert endpoint.owed == owed_at_stall + 1
    finally:
        three_nodes[2].resume()
    assert wait_until(lambda: value_on(three_nodes[2], before.key) is None, 2.0)


def test_a_worker_never_skips_a_call_for_a_holder_that_failed_during_a_stall() -> None:
    """A real worker (threads pool): a run fails with no quorum while two of three nodes stall;
    the nodes resume and run its SET; the next call with the same key a second later runs
    instead of being skipped as a duplicate of the failed run."""
    with (
        RedisServer() as broker,
        RedisNodes(3) as nodes,
        celery_processes() as processes,
    ):
        environment = app_environment(broker, nodes)
        client = control_app(broker, result_backend=broker.url)
        worker = WorkerProcess(
            "celery_apps.stall_app", "stalls", environment, 4, extra_arguments=("-P", "threads")
        )
        try:
            processes.append(worker.start())
            worker.wait_ready(client)
            job = "celery_apps.stall_app.job"
            assert client.send_task(job, args=("warm-up",)).get(timeout=10) == "warm-up"
            for server in nodes.servers[1:]:
                server.pause()
            try:
                failed = client.send_task(job, args=("stalled",))
                with pytest.raises(Exception, match="no quorum for lock"):
                    failed.get(timeout=10, propagate=True)
            finally:
                for server in nodes.servers[1:]:
                    server.resume()
            time.sleep(1.0)  # the "a second after": the resumed nodes ran the SET
            again = client.send_task(job, args=("stalled",))
            assert again.get(timeout=10) == "stalled", "skipped for a holder that failed"
            RunLog(broker.url).assert_no_overlap()
        finally:
            collect_results_while_the_broker_is_up()
            client.close()


def test_nodes_that_answer_late_are_waited_for_not_given_up() -> None:
    """Every node answers, 80 ms late, with a 50 ms node timeout: the client learns how late its
    replies come and waits that long, instead of backing every node off for good (on a busy host
    the lateness is the host's, not the nodes')."""
    with (
        RedisNodes(3) as nodes,
        contextlib.ExitStack() as proxies,
    ):
        late = [
            proxies.enter_context(FaultyProxy(("127.0.0.1", server.port), delay=0.08))
            for server in nodes.servers
        ]
        dlm = Redlock([proxy.url for proxy in late], retry_count=1, node_timeout=NODE_TIMEOUT)
        started = time.monotonic()
        outcomes: list[bool] = []
        while time.monotonic() - started < 5.0 and outcomes[-10:] != [True] * 10:
            try:
                lock = dlm.acquire("late-nodes", ttl=5.0)
            except QuorumUnavailable:
                lock = None
            if lock is not None:
                dlm.release(lock, confirm=False)
            outcomes.append(lock is not None)
        took = time.monotonic() - started
        print(f"\n3 nodes 80 ms late, node timeout 50 ms: 10 in a row after {took:.2f} s")
        assert outcomes[-10:] == [True] * 10, "late nodes were given up instead of waited for"
        assert took < 3.0


def _first_calls(urls: list[str], threads: int = 16) -> list[float]:
    """Seconds each of ``threads`` threads took for its first acquire and release, all starting
    together on a new lock manager."""
    dlm = Redlock(urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    start = threading.Barrier(threads)
    took: list[float] = []

    def call(index: int) -> None:
        start.wait()
        started = time.monotonic()
        lock = dlm.acquire(f"first-call-{index}", ttl=5.0)
        took.append(time.monotonic() - started)
        assert lock is not None
        dlm.release(lock, confirm=False)

    workers = [threading.Thread(target=call, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(10)
    assert len(took) == threads
    dlm.close()
    return took


@pytest.mark.parametrize("kind", ["cluster", "sentinel"])
def test_a_member_whose_seeds_all_hang_costs_at_most_one_node_timeout(redis_nodes, kind):
    """A cluster member whose seeds, or a Sentinel member whose sentinels, all hang: 16 threads'
    first calls each take at most one node timeout longer than with a healthy third node (the
    member is looked up in the background, not by every caller, one seed after another)."""
    nodes = redis_nodes(6)
    healthy = _first_calls(nodes.urls[:3])
    hung = nodes.servers[3:]
    for server in hung:
        server.pause()
    try:
        addresses = ",".join(server.address for server in hung)
        member = (
            f"redis+cluster://{addresses}"
            if kind == "cluster"
            else f"redis+sentinel://{addresses}/service"
        )
        stalled = _first_calls([*nodes.urls[:2], member])
    finally:
        for server in hung:
            server.resume()
    print(
        f"\n16 first calls, a {kind} member whose servers hang: max {max(stalled) * 1000:.0f} "
        f"ms (healthy third node: max {max(healthy) * 1000:.0f} ms)"
    )
    assert max(stalled) <= max(healthy) + NODE_TIMEOUT + 0.05


def test_a_tls_node_that_stalls_in_its_handshake_costs_at_most_one_node_timeout(redis_nodes):
    """A TLS node that accepts connections and never answers the handshake: 16 threads' first
    calls each take at most one node timeout longer than with a healthy third node (one thread
    waits for the handshake; the others do not each try again after it failed)."""
    nodes = redis_nodes(3)
    healthy = _first_calls(nodes.urls)
    with socket.create_server(("127.0.0.1", 0), backlog=64) as silent:
        port = silent.getsockname()[1]
        stalled = _first_calls([*nodes.urls[:2], f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none"])
    print(
        f"\n16 first calls, a TLS node stalled in its handshake: max "
        f"{max(stalled) * 1000:.0f} ms (healthy third node: max {max(healthy) * 1000:.0f} ms)"
    )
    # redis-py bounds the TCP connect and the handshake each by the timeout: one connection
    # attempt to such a node takes about 1.5 node timeouts (it took 1.3 s before, in turn).
    assert max(stalled) <= max(healthy) + 2 * NODE_TIMEOUT + 0.03


def test_a_clean_up_owed_for_a_value_is_dropped_once_that_value_is_a_lock_taken(three_nodes):
    """The rounds of one acquisition share its token: once a later round takes the lock, a
    clean-up an earlier round owed a silent node for that value must never be sent (it would
    remove the lock there), while clean-ups owed for other values stay."""
    dlm = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))
    token = "0" * 40
    value = f"{token}|earlier-round"
    three_nodes[2].pause()
    try:
        endpoint = dlm.nodes[2].endpoint_for(dlm.key_for("forgiven"))
        assert endpoint is not None
        until = time.monotonic() + TTL
        for owed_value in (value, f"{'1' * 40}|another"):  # as earlier rounds owed them
            key = dlm.key_for("forgiven")
            packed = pack_command("EVALSHA", RELEASE.sha, 1, key, owed_value, 0)
            endpoint.owe(owed_value.encode(), packed, until, RELEASE.source)
        outcome = dlm.attempt("forgiven", TTL, "earlier-round", token=token)
        assert isinstance(outcome, Acquired)
        assert outcome.lock.value == value
        assert endpoint.owed == 1, "the clean-up of the lock taken is still owed"
    finally:
        three_nodes[2].resume()
    assert dlm.extend(outcome.lock)
    assert dlm.release(outcome.lock)


def _clean_up_on_its_way(
    three_nodes: RedisNodes, dlm: Redlock, resource: str, token: str
) -> tuple[Endpoint, threading.Event]:
    """A failed round of ``token``'s acquisition of ``resource`` while node 2 stalled, node 2's
    late replies read (it takes part in rounds again), and its probe about to send that round's
    clean-up: held at the returned gate until it is set. Node 0 still holds another value."""
    key = dlm.key_for(resource)
    endpoint = dlm.nodes[2].endpoint_for(key)
    assert endpoint is not None
    on_its_way, gate = threading.Event(), threading.Event()

    class HeldCleanUps(endpoint.connection_class):  # type: ignore[name-defined,misc]
        def send_packed_command(self, command, check_health=True):
            if any(token.encode() in part for part in command):
                on_its_way.set()  # taken for payment, not yet sent: held until the gate opens
                gate.wait(10)
            super().send_packed_command(command, check_health)

    endpoint.connection_class = HeldCleanUps
    with three_nodes[0].client() as client:
        client.set(key, f"{'1' * 40}|another", px=int(TTL * 1000))
    three_nodes[2].pause()
    try:
        outcome = dlm.attempt(resource, TTL, "stalled-round", token=token, rounds=1)
        assert not isinstance(outcome, Acquired)
        assert endpoint.owed, "the failed round's release waits for the stalled node"
    finally:
        three_nodes[2].resume()
    dlm.release(dlm.acquire("elsewhere", ttl=1.0))  # reads the node's late replies
    assert on_its_way.wait(3.0), "the probe never sent the clean-up"
    with three_nodes[0].client() as client:
        client.delete(key)
    return endpoint, gate


def _needs_node_2(three_nodes: RedisNodes, dlm: Redlock, resource: str) -> str:
    """Another holder's value on node 1: a lock on ``resource`` needs node 2 for a majority."""
    other = f"{'1' * 40}|another"
    with three_nodes[1].client() as client:
        client.set(dlm.key_for(resource), other, px=int(TTL * 1000))
    return other


def test_a_round_waits_for_the_clean_up_of_its_value_on_its_way_to_a_node(three_nodes):
    """A stalled node's late reply brings it back into rounds while its probe is still sending
    the clean-up of the failed round's value (on the probe's own connection). The next round of
    the same acquisition sets that value again: it waits for that clean-up, which would
    otherwise run after it and remove the copy the round counted on (here the lock needs that
    node for a majority)."""
    dlm = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))
    token = "2" * 40
    endpoint, gate = _clean_up_on_its_way(three_nodes, dlm, "owed", token)
    other = _needs_node_2(three_nodes, dlm, "owed")
    threading.Timer(0.3, gate.set).start()
    outcome = dlm.attempt("owed", TTL, "stalled-round", token=token)
    assert isinstance(outcome, Acquired)
    assert wait_until(lambda: gate.is_set() and not (endpoint.owed or endpoint.probing), 3.0)
    values = [value_on(server, dlm.key_for("owed")) for server in three_nodes]
    held = [outcome.lock.value, other, outcome.lock.value]
    assert values == held, "the clean-up removed the copy the round counted on"
    assert dlm.release(outcome.lock)


def test_a_node_whose_clean_up_is_on_its_way_for_too_long_is_skipped(three_nodes):
    """A clean-up still on its way after the round's wait (two probe timeouts): the node is
    backed off until the probe is done with it — a late reply does not bring it back — so the
    round skips it and, needing it for a majority, does not get the lock; once the clean-up
    went out, the lock is taken."""
    dlm = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    dlm.release(dlm.acquire("warm-up", ttl=1.0))
    token = "3" * 40
    endpoint, gate = _clean_up_on_its_way(three_nodes, dlm, "held-up", token)
    other = _needs_node_2(three_nodes, dlm, "held-up")
    try:
        outcome = dlm.attempt("held-up", TTL, "stalled-round", token=token)
        # The node's late reply, read meanwhile, did not end that back-off.
        assert endpoint.is_backed_off(time.monotonic())
    finally:
        gate.set()
    key = dlm.key_for("held-up")
    assert wait_until(lambda: not (endpoint.owed or endpoint.probing), 3.0)
    values = [value_on(server, key) for server in three_nodes]
    assert not isinstance(outcome, Acquired), f"counted a node its clean-up then emptied: {values}"
    assert values == [None, other, None]
    assert wait_until(lambda: not endpoint.is_backed_off(time.monotonic()), 3.0)
    outcome = dlm.attempt("held-up", TTL, "stalled-round", token=token)
    assert isinstance(outcome, Acquired)
    values = [value_on(server, key) for server in three_nodes]
    assert values == [outcome.lock.value, other, outcome.lock.value]
    assert dlm.release(outcome.lock)


def test_clean_ups_owed_from_many_threads_while_a_round_forgives_some(one_node):
    # Rounds owe clean-ups to a backed-off server from any thread (the reader too) while another
    # round, about to set its value, drops those owed for it: neither may see the other's half
    # done work (an acquisition once failed on "deque mutated during iteration").
    endpoint = Endpoint.from_url(one_node.urls[0], node_timeout=NODE_TIMEOUT)
    endpoint.mark_down(time.monotonic(), "backed off for the test")
    until = time.monotonic() + 60.0
    stop = threading.Event()
    errors: list[BaseException] = []

    def owe(number: int) -> None:
        try:
            count = 0
            while not stop.is_set():
                count += 1
                owed = f"owed-{number}-{count % 50}"
                endpoint.owe(owed.encode(), pack_command("ECHO", owed), until, "return 1")
        except BaseException as error:
            errors.append(error)
            raise

    threads = [threading.Thread(target=owe, args=(number,), daemon=True) for number in range(3)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 1.5
        forgiven = 0
        while time.monotonic() < deadline and not errors:
            endpoint.forgive(f"owed-0-{forgiven % 50}".encode())
            forgiven += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
    assert errors == []
    assert forgiven > 0


def test_a_lock_an_extension_set_again_on_a_node_is_owed_its_release_there(three_nodes):
    """A lock taken while node 2 was backed off never reached it; an extension once node 2
    answers again sets it there too (healing), so a release node 2 misses owes it the clean-up."""
    caller = Redlock(three_nodes.urls, retry_count=1, node_timeout=NODE_TIMEOUT)
    caller.release(caller.acquire("warm-up", ttl=1.0))
    three_nodes[2].pause()
    try:
        endpoint = caller.nodes[2].endpoint_for(caller.key_for("healed"))
        assert endpoint is not None
        caller.release(caller.acquire("warm-up-2", ttl=1.0))
        assert wait_until(lambda: endpoint.is_backed_off(time.monotonic()))
        lock = caller.acquire("healed", ttl=TTL)
        assert lock is not None and lock.unreached == frozenset({2})
    finally:
        three_nodes[2].resume()
    assert wait_until(lambda: not endpoint.is_backed_off(time.monotonic()), timeout=3.0)
    assert caller.extend(lock)
    assert value_on(three_nodes[2], lock.key) == lock.value  # healed onto node 2
    assert lock.unreached == frozenset()
    three_nodes[2].pause()
    try:
        assert wait_until(lambda: caller.extend(lock) and endpoint.is_backed_off(time.monotonic()))
        assert caller.release(lock)
    finally:
        three_nodes[2].resume()
    assert wait_until(lambda: value_on(three_nodes[2], lock.key) is None, timeout=2.0)
