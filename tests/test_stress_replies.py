"""A reply reaches only the caller whose command it answers, whatever fails when: a connection
that fails while a writer is inside ``sendall`` (held there at a gate, deterministically), and
many threads on shared connections that a proxy cuts at random. Real redis-server processes;
only the socket (a gate around it) and the link (a proxy) are doubled.

``REDLOCK_STRESS_SECONDS`` sets how long the randomized test runs (default 8)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redlock_support import wait_until
from reply_faults import FaultyProxy, NoisySocket

from celery_redlock import Redlock
from celery_redlock.lock import keyspace, scripts
from celery_redlock.lock.nodes import NodeGroup, RoundResult, members_from_urls
from celery_redlock.lock.nodes import endpoint as endpoint_module
from celery_redlock.lock.nodes.channel import NO_REPLY
from celery_redlock.lock.outcomes import Acquired
from celery_redlock.lock.owner import Tokens
from celery_redlock.lock.redlock import reservation_of, reserve
from celery_redlock.lock.replies import judge_copy
from celery_redlock.settings import RedlockSettings
from celery_redlock.testing import RedisNodes

TOKENS = Tokens()  # fresh lock tokens, as the package draws them
STRESS_SECONDS = float(os.environ.get("REDLOCK_STRESS_SECONDS", "8"))


def read(group: NodeGroup, key: str) -> RoundResult:
    """READ ``key`` on every member."""
    return group.run(scripts.READ, [key], [], judge_copy, every=True)


def value_read(result: RoundResult) -> Any:
    """What the only member answered a READ: the stored value, or NO_REPLY."""
    reply = result.replies[0]
    return reply if reply is NO_REPLY else reply[0].decode()


# -- a connection that fails inside the reactor's write ----------------------------------------


class CutAfterWrite:
    """Stands in for a connection's socket: its next write is held at a gate after the bytes
    went out, then fails as a cut connection does; everything else goes to the real socket."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.entered = threading.Event()
        self.gate = threading.Event()

    def sendall(self, data: bytes) -> None:
        self.real.sendall(data)
        if not self.entered.is_set():
            self.entered.set()
            self.gate.wait(10)
            raise ConnectionResetError("cut after the write")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture
def group_on_one_node(one_node: RedisNodes) -> Iterator[NodeGroup]:
    with one_node[0].client() as client:
        client.mset({f"caller:{name}": f"value of {name}" for name in ("a", "b", "c", "warm")})
    group = NodeGroup(members_from_urls(one_node.urls, 2.0), 2.0)
    try:
        yield group
    finally:
        group.close()


def test_a_connection_failing_inside_a_write_leaves_every_reply_to_its_caller(
    group_on_one_node: NodeGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A's bytes are out, but the write has not returned when the connection fails; B and C ask
    # meanwhile. The server answers A on the failed connection, which nobody reads any more:
    # B and C must get their own replies on the next connection, A no reply or its own.
    group = group_on_one_node
    assert value_read(read(group, "caller:warm")) == "value of warm"  # the connection is open
    endpoint = group.nodes[0].endpoint_for("caller:a")
    assert endpoint is not None
    open_socket = endpoint.open_socket
    cut = CutAfterWrite(open_socket())
    opened = iter([cut])
    monkeypatch.setattr(endpoint, "open_socket", lambda: next(opened, None) or open_socket())
    group.close()  # the next command connects through CutAfterWrite
    monkeypatch.setattr(endpoint_module, "FIRST_BACKOFF_SECONDS", 0.001)
    monkeypatch.setattr(endpoint_module, "MAX_BACKOFF_SECONDS", 0.001)
    results: dict[str, RoundResult] = {}

    def caller(name: str) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: results.__setitem__(name, read(group, f"caller:{name}")), daemon=True
        )
        thread.start()
        return thread

    callers = [caller("a")]
    try:
        assert cut.entered.wait(5), "A was never written"
        callers += [caller("b"), caller("c")]
        time.sleep(0.05)  # B and C wait in the reactor's inbox behind the held write
    finally:
        cut.gate.set()
    for thread in callers:
        thread.join(10)
        assert not thread.is_alive(), f"caller {thread.name} still waits"
    # Each got its own reply or none (the node is backed off until its probe answers), never
    # another's; and the next connection is in order.
    got = {name: value_read(result) for name, result in results.items()}
    assert all(got[name] in (NO_REPLY, f"value of {name}") for name in got), [
        (name, result.replies, result.failures) for name, result in results.items()
    ]
    assert wait_until(lambda: value_read(read(group, "caller:warm")) is not NO_REPLY)
    for name in ("a", "b", "c", "warm"):
        assert value_read(read(group, f"caller:{name}")) == f"value of {name}"


# -- many threads, connections cut at random ---------------------------------------------------


class Tally:
    """What the threads saw, reply by reply."""

    def __init__(self) -> None:
        self.guard = threading.Lock()
        self.checked = 0
        self.no_reply = 0
        self.wrong: list[str] = []

    def add(self, checked: int, no_reply: int, wrong: list[str]) -> None:
        with self.guard:
            self.checked += checked
            self.no_reply += no_reply
            self.wrong += wrong


MISDELIVERED = ("cannot give", "a reply to no command")
"""Failures that only a reply handed to the wrong slot explains: every command on these
connections is a READ (whose reply is a copy) or a script load (whose reply is not)."""


def read_own_key_until(
    group: NodeGroup, number: int, deadline: float, tally: Tally
) -> Callable[[], None]:
    """Thread ``number``'s loop: READ its own key in quorum rounds (as lock rounds decide)
    until ``deadline``, checking every reply that came."""
    key, value = f"stress:{number}", f"value of thread {number}".encode()

    def run() -> None:
        checked = no_reply = 0
        wrong: list[str] = []
        try:
            while time.monotonic() < deadline:
                result = group.run(scripts.READ, [key], [], judge_copy)
                if result.answered == 0:
                    time.sleep(0.005)  # every node is backed off: no spinning past them
                for index, reply in enumerate(result.replies):
                    why = result.failures[index] or ""
                    if reply is NO_REPLY:
                        no_reply += 1
                        if any(mark in why for mark in MISDELIVERED):
                            wrong.append(f"{key} on node {index}: {why}")
                    else:
                        checked += 1
                        if reply != [value, -1]:
                            wrong.append(f"{key} on node {index} got {reply!r}")
        except BaseException as error:
            wrong.append(f"thread {number} raised {error!r}")
        tally.add(checked, no_reply, wrong)

    return run


def test_threads_on_connections_cut_at_random_get_only_their_own_replies(
    three_nodes: RedisNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Writers race with failures only when a cut connection is replaced at once (after an
    # interruption, or a server that answers its probe): the back-off of a millisecond makes
    # that the rule, not a quarter of a second later. Pauses around every write stand for the
    # descheduled threads of a busy host.
    threads = 60
    seed = random.randrange(2**32)
    monkeypatch.setattr(endpoint_module, "FIRST_BACKOFF_SECONDS", 0.001)
    monkeypatch.setattr(endpoint_module, "MAX_BACKOFF_SECONDS", 0.001)
    values = {f"stress:{number}": f"value of thread {number}" for number in range(threads)}
    for server in three_nodes:
        with server.client(socket_timeout=5) as client:
            client.mset(values)
    tally = Tally()
    with contextlib.ExitStack() as stack:
        proxies = [
            stack.enter_context(
                FaultyProxy(("127.0.0.1", server.port), cut_chance=0.02, seed=seed + index)
            )
            for index, server in enumerate(three_nodes)
        ]
        node_timeout = RedlockSettings.node_timeout
        group = NodeGroup(
            members_from_urls([proxy.url for proxy in proxies], node_timeout), node_timeout
        )
        stack.callback(group.close)
        for node in group.nodes:
            endpoint = node.endpoint_for("stress")
            assert endpoint is not None
            monkeypatch.setattr(endpoint, "open_socket", noisy(endpoint.open_socket))
        deadline = time.monotonic() + STRESS_SECONDS
        workers = [
            threading.Thread(target=read_own_key_until(group, number, deadline, tally))
            for number in range(threads)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(STRESS_SECONDS + 30)
        assert not any(worker.is_alive() for worker in workers)
        cuts = sum(proxy.cuts for proxy in proxies)
    print(
        f"\nseed {seed}, {STRESS_SECONDS:g} s, {threads} threads: {tally.checked} replies "
        f"checked, {tally.no_reply} missing, {cuts} connections cut, "
        f"{len(tally.wrong)} reached the wrong caller"
    )
    assert tally.wrong == [], f"seed {seed}: " + "\n".join(tally.wrong[:20])
    assert cuts > 0
    assert tally.checked > 100 * STRESS_SECONDS


def noisy(open_socket: Callable[[], Any]) -> Callable[[], Any]:
    """``open_socket``, its sockets pausing around every write (`NoisySocket`)."""

    def open_noisy_socket() -> Any:
        return NoisySocket(open_socket(), before=0.002, after=0.005)

    return open_noisy_socket


# -- holder_of and reservation_of decide on copies ---------------------------------------------

CALLS = 200


@pytest.mark.parametrize("kind", ["lock", "reservation"])
def test_a_lock_on_a_majority_is_named_every_time_and_one_on_a_minority_never(
    three_nodes: RedisNodes, kind: str
) -> None:
    # The first two copies to arrive may be the holder's and an empty one (the node that lost
    # the lock): that is no majority either way, and the third node decides.
    redlock = Redlock(three_nodes.urls, node_timeout=0.5)
    try:
        for lost in range(len(three_nodes)):
            resource = f"majority:{kind}:{lost}"
            if kind == "lock":
                outcome = redlock.attempt(resource, 30, "worker-A")
                key, ask = redlock.key_for(resource), redlock.holder_of
            else:
                outcome = reserve(redlock, resource, 30, "worker-A", token=TOKENS.new())
                key = keyspace.reservation_key(redlock.key_for(resource))
                ask = functools.partial(reservation_of, redlock)
            assert isinstance(outcome, Acquired), outcome
            # A node loses the lock: its key and the 0.2-layout copy held beside it.
            copies = (key, keyspace.legacy_key(RedlockSettings.key_prefix, key))
            with three_nodes[lost].client() as client:
                assert client.delete(*copies) == 2
            holders = Counter(getattr(ask(resource), "holder", None) for _ in range(CALLS))
            assert holders == {"worker-A": CALLS}, f"lost on node {lost}: {holders}"
            with three_nodes[(lost + 1) % len(three_nodes)].client() as client:
                assert client.delete(*copies) == 2  # left on one node only: a leftover
            holders = Counter(getattr(ask(resource), "holder", None) for _ in range(CALLS))
            assert holders == {None: CALLS}, f"left on one node: {holders}"
    finally:
        redlock.close()
