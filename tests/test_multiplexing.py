"""The multiplexed nodes layer (celery_redlock.lock.nodes) under the faults it exists to survive.

One connection per server and process carries every thread's commands, pipelined, and the
replies are handed out in order. What must never happen is a reply given to the wrong caller: a
caller that timed out, a caller interrupted by a signal handler (a soft time limit), a process
that forked, a server that froze with commands half-way down the pipe. Every check here
therefore runs rounds on distinct keys with distinct values and checks each member's reply
against its own key: a READ must return its key's value, an acquire a fencing token no lower
than its own clock (the script's promise), a release 1. A reply that went to another caller
shows as a wrong value; a command whose reply went elsewhere leaves its own caller waiting for
nothing, which shows as a healthy local node that stalled.

Real redis-server processes (celery_redlock.testing), frozen with SIGSTOP; real ``celery
worker`` subprocesses for prefork; gevent and eventlet in monkey-patched subprocesses
(tests/celery_apps/green_locks.py).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.connection
from celery.result import AsyncResult
from celery_apps.subprocesses import (
    WorkerProcess,
    app_environment,
    celery_processes,
    control_app,
)
from celery_apps.support import RunLog, key_gone
from redlock_support import collect_results_while_the_broker_is_up, values_on, wait_until

import celery_redlock.lock.nodes
from celery_redlock import Redlock
from celery_redlock.errors import DuplicateSkipped
from celery_redlock.lock import keyspace, scripts
from celery_redlock.lock.nodes import Endpoint, NodeGroup, RoundResult, members_from_urls
from celery_redlock.lock.nodes.channel import NO_REPLY
from celery_redlock.lock.outcomes import Acquisition, Lock, Outcome
from celery_redlock.lock.owner import Tokens, lock_value
from celery_redlock.lock.replies import acquire_judge, judge_copy, judge_zero_or_one
from celery_redlock.testing import RedisNodes, RedisServer

TOKENS = Tokens()  # fresh lock tokens, as the package draws them

TESTS_DIRECTORY = Path(__file__).resolve().parent
NODES_DIRECTORY = str(Path(celery_redlock.lock.nodes.__file__).resolve().parent)
GREEN_SCRIPT = TESTS_DIRECTORY / "celery_apps" / "green_locks.py"

MOST_CONNECTIONS_PER_NODE = 4
"""One process's connections to one server: its shared connection, its subscriber, a probe and
one being replaced."""


# -- rounds whose every reply is checked --------------------------------------------------------


class Rounds:
    """Rounds over one `NodeGroup` (one process's shared connections), each reply checked
    against what its own caller asked. The checks return what was wrong, so that threads can
    report instead of raising."""

    def __init__(self, nodes: RedisNodes, node_timeout: float) -> None:
        self.nodes = nodes
        self.group = NodeGroup(members_from_urls(nodes.urls, node_timeout), node_timeout)

    def close(self) -> None:
        """Close this process's connections."""
        self.group.close()

    def read(self, key: str, value: str, every: bool = True) -> tuple[RoundResult, list[str]]:
        """READ ``key``, which holds ``value`` on every node (no expiry)."""
        result = self.group.run(scripts.READ, [key], [], judge_copy, every=every)
        wrong = [
            f"node {index}: READ of {key} got {reply!r}, not {value!r}"
            for index, reply in enumerate(result.replies)
            if reply is not NO_REPLY and reply != [value.encode(), -1]
        ]
        return result, wrong

    def acquire(self, key: str, value: str, every: bool = True) -> tuple[RoundResult, list[str]]:
        """Take the lock at ``key`` with ``value`` (free beforehand): each node must answer a
        fencing token no lower than this caller's clock."""
        clock = time.time_ns() // 1000
        result = self.group.run(
            scripts.ACQUIRE,
            [key, keyspace.fence_key(key), keyspace.reservation_key(key)],
            [value, 30_000, clock, ""],
            acquire_judge(clock, False),
            every=every,
            grants=True,
        )
        wrong = [
            f"node {index}: acquire of {key} got {reply!r}, not a token >= {clock}"
            for index, reply in enumerate(result.replies)
            if reply is not NO_REPLY and not (isinstance(reply, int) and reply >= clock)
        ]
        return result, wrong

    def release(self, key: str, value: str, every: bool = True) -> tuple[RoundResult, list[str]]:
        """Release the lock at ``key`` held with ``value``: each node must answer 1."""
        result = self.group.run(
            scripts.RELEASE,
            [key, keyspace.fence_key(key)],
            [value, 0],
            judge_zero_or_one,
            every=every,
        )
        wrong = [
            f"node {index}: release of {key} got {reply!r}, not 1"
            for index, reply in enumerate(result.replies)
            if reply is not NO_REPLY and reply != 1
        ]
        return result, wrong

    def full_cycle(self, name: str) -> list[str]:
        """READ a key of ``name``'s own, then take and release a lock of its own, every node
        answering each time; what went wrong."""
        values = {f"own:{name}": f"value of {name}"}
        self.seed(values)
        return read_acquire_release(self, values, 0)

    def seed(self, values: dict[str, str]) -> None:
        """Set ``values`` on every (running) node."""
        for server in self.nodes:
            with server.client(socket_timeout=5) as client:
                client.mset(values)


def missing(result: RoundResult, who: str, indexes: tuple[int, ...] | None = None) -> list[str]:
    """A problem for every node (among ``indexes``, default all) that gave no reply in
    ``result``."""
    return [
        f"{who}: node {index} gave no reply ({why})"
        for index, why in enumerate(result.failures)
        if result.replies[index] is NO_REPLY and (indexes is None or index in indexes)
    ]


def run_threads(count: int, body: Callable[[int], list[str]], timeout: float = 30.0) -> list[str]:
    """Run ``body(number)`` in ``count`` threads started together; every problem they report,
    an exception or a thread still running after ``timeout`` seconds included."""
    problems: list[str] = []
    start = threading.Barrier(count)

    def run(number: int) -> None:
        try:
            start.wait()
            problems.extend(body(number))
        except BaseException as error:
            problems.append(f"thread {number} raised {error!r}")

    threads = [threading.Thread(target=run, args=(number,), daemon=True) for number in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    problems += [
        f"{thread.name} still runs after {timeout} s" for thread in threads if thread.is_alive()
    ]
    return problems


def sockets_to(server: RedisServer, pid: int | str = "self") -> set[int]:
    """The TCP connections to ``server`` that process ``pid`` holds open (socket inodes, read
    from /proc: no server can tell which process a connection belongs to)."""
    connected = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port, state, inode = int(fields[2].split(":")[1], 16), fields[3], int(fields[9])
        if remote_port == server.port and state == "01":  # ESTABLISHED
            connected.add(inode)
    held = set()
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            held.add(int(target[len("socket:[") : -1]))
    return connected & held


def client_connections(server: RedisServer) -> int:
    """How many clients ``server`` has, the asking connection left out."""
    with server.client(socket_timeout=5) as client:
        own = int(client.client_id())
        return sum(1 for entry in client.client_list() if int(entry["id"]) != own)


# -- 1. a caller that times out while its reply is in flight ------------------------------------


def distinct_values(name: str, count: int) -> dict[str, str]:
    """``count`` keys of ``name``, each with a value of its own."""
    return {f"{name}:{number}": f"value of {name}:{number}" for number in range(count)}


def read_without_the_frozen_node(
    rounds: Rounds, values: dict[str, str], every: bool, number: int
) -> list[str]:
    """Thread ``number`` READs its key of ``values`` while node 0 is frozen: nodes 1 and 2 must
    give its own value, node 0 nothing (and a reason)."""
    key = list(values)[number]
    result, wrong = rounds.read(key, values[key], every=every)
    if result.replies[0] is not NO_REPLY:
        wrong.append(f"the frozen node answered {key}: {result.replies[0]!r}")
    if every and not result.failures[0]:
        wrong.append(f"{key}: no reason given for the frozen node's missing reply")
    return wrong + missing(result, key, (1, 2))


def read_acquire_release(rounds: Rounds, values: dict[str, str], number: int) -> list[str]:
    """Thread ``number`` READs its key of ``values``, then takes and releases a lock of its own,
    every node answering each time."""
    key = list(values)[number]
    result, wrong = rounds.read(key, values[key])
    lock = f"lock:{{{key}}}"
    value = lock_value(TOKENS.new(), f"thread {number}")
    acquired, wrong_token = rounds.acquire(lock, value)
    released, not_released = rounds.release(lock, value)
    return (
        wrong
        + wrong_token
        + not_released
        + missing(result, key)
        + missing(acquired, lock)
        + missing(released, lock)
    )


def test_late_replies_of_callers_that_returned_go_to_their_own_slots(
    three_nodes: RedisNodes,
) -> None:
    # Callers that decided at quorum while node 0 was frozen leave their commands on its
    # connection. The node comes back: their late replies must be read and dropped, never handed
    # to the callers queued behind them on the same connection.
    rounds = Rounds(three_nodes, node_timeout=2.0)
    frozen = three_nodes[0]
    threads = 6
    for repetition in range(3):
        first = distinct_values(f"first-{repetition}", threads)
        second = distinct_values(f"second-{repetition}", threads)
        rounds.seed({**first, **second})
        frozen.pause()
        try:
            body = functools.partial(read_without_the_frozen_node, rounds, first, False)
            assert run_threads(threads, body) == []
        finally:
            frozen.resume()
        body = functools.partial(read_acquire_release, rounds, second)
        assert run_threads(threads, body) == []


def test_callers_that_time_out_never_get_each_others_replies(three_nodes: RedisNodes) -> None:
    # Every caller waits for every node (every=True) and times out on the frozen one with its
    # command sent. After the node comes back, new callers on the same connection (or its
    # replacement) get their own replies, not the timed-out ones'.
    node_timeout = 0.3
    rounds = Rounds(three_nodes, node_timeout=node_timeout)
    frozen = three_nodes[0]
    threads = 6
    for repetition in range(3):
        timed_out = distinct_values(f"timed-out-{repetition}", threads)
        after = distinct_values(f"after-{repetition}", threads)
        rounds.seed({**timed_out, **after, "probe": "probe"})
        frozen.pause()
        try:
            started = time.monotonic()
            body = functools.partial(read_without_the_frozen_node, rounds, timed_out, True)
            assert run_threads(threads, body) == []
            # One node_timeout, not one per caller (a generous margin for a busy machine).
            assert time.monotonic() - started < node_timeout + 3.0
        finally:
            frozen.resume()
        # Backed off, then probed: it takes part again within about a second, and meanwhile
        # gives nothing but the right value.
        seen: list[RoundResult] = []

        def answers_again(seen: list[RoundResult] = seen) -> bool:
            seen.append(rounds.read("probe", "probe")[0])
            return seen[-1].replies[0] is not NO_REPLY

        assert wait_until(answers_again, timeout=5.0, interval=0.02)
        assert all(result.replies[0] in (NO_REPLY, [b"probe", -1]) for result in seen), seen
        body = functools.partial(read_acquire_release, rounds, after)
        assert run_threads(threads, body) == []


def test_late_replies_nobody_waited_for_are_read_before_the_next_callers(
    three_nodes: RedisNodes,
) -> None:
    # Commands sent without waiting (wait=False, as releases are) get replies nobody reads until
    # the next round, even past node_timeout. Such a connection is not hung: its replies are
    # there. The next callers must get their own replies, and no node may be backed off.
    node_timeout = 0.2
    rounds = Rounds(three_nodes, node_timeout=node_timeout)
    unread = distinct_values("unread", 20)
    after = distinct_values("after-unread", 4)
    rounds.seed({**unread, **after})
    for key in unread:
        result = rounds.group.run(scripts.READ, [key], [], judge_copy, wait=False)
        assert result.answered == 0
    time.sleep(node_timeout * 1.5)  # the unread replies are now older than node_timeout
    assert run_threads(4, functools.partial(read_acquire_release, rounds, after)) == []


class Interrupted(Exception):
    """What a signal handler raises in the middle of a round (Celery's soft time limit raises
    SoftTimeLimitExceeded that way; Ctrl-C raises KeyboardInterrupt)."""


class Interruption:
    """A profile function (`sys.setprofile`) that raises `Interrupted` at the ``at``-th point of
    the nodes layer where CPython can run a signal handler: on entry to one of its functions, or
    right after one of its calls to a C function returns. ``point`` names where it did."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.count = 0
        self.point = ""

    def __call__(self, frame: Any, event: str, argument: Any) -> None:
        code = frame.f_code
        if event not in ("call", "c_return") or not code.co_filename.startswith(NODES_DIRECTORY):
            return
        if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE):
            return  # a generator closed by the garbage collector could not report it
        self.count += 1
        if self.count == self.at:
            sys.setprofile(None)
            where = "on entry" if event == "call" else f"after {argument.__qualname__}()"
            self.point = f"{Path(code.co_filename).stem}.{code.co_name}, {where}"
            raise Interrupted(self.point)


def rounds_after_an_interruption(nodes: RedisNodes, at: int) -> tuple[bool, list[str]]:
    """Interrupt a round at point ``at`` (`Interruption`), then run rounds on the same
    connections: whether the point was reached, and what went wrong after it."""
    rounds = Rounds(nodes, node_timeout=0.5)
    try:
        values = distinct_values("interrupted", 6)
        rounds.read("interrupted:0", values["interrupted:0"])  # the connection is open
        interruption = Interruption(at)
        sys.setprofile(interruption)
        try:
            rounds.read("interrupted:1", values["interrupted:1"])
        except Interrupted:
            pass
        finally:
            sys.setprofile(None)
        if interruption.count < at:
            return False, []
        for key in list(values)[2:]:
            result, wrong = rounds.read(key, values[key])
            for index, why in enumerate(result.failures):
                if result.replies[index] is NO_REPLY and not why:
                    wrong.append(f"node {index} gave {key} no reply and no reason")
                elif result.replies[index] is NO_REPLY and (why or "").startswith(
                    "no reply within"
                ):
                    # The server is idle and local: its replies are owed to somebody else.
                    wrong.append(f"node {index} stalled {key}: {why}")
            if wrong:
                return True, [f"interrupted in {interruption.point}: {wrong}"]
        return True, []
    finally:
        rounds.close()


def test_a_caller_interrupted_anywhere_leaves_the_connection_in_order(
    one_node: RedisNodes,
) -> None:
    # A signal handler that raises (a soft time limit) can interrupt a round at any call in the
    # nodes layer. Whatever the point, the connection must stay in order (or be closed and
    # reopened): the next rounds get their own replies, at once. Every such point of one
    # round is tried in turn.
    with one_node[0].client() as client:
        client.mset(distinct_values("interrupted", 6))
    problems: list[str] = []
    points = 0
    for at in range(1, 1000):
        reached, wrong = rounds_after_an_interruption(one_node, at)
        if not reached:
            break
        points += 1
        problems += wrong
    print(f"\n{points} points of interruption tried")
    assert points > 20
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("function", "marker", "name"),
    [
        # redis-py's connect holds a socket it has not handed over yet, and closes it on its own
        # errors only: raised where it calls connect() on the socket.
        (redis.connection.Connection._connect, "sock.connect(", "sock"),
        # Inside socket.socket's constructor, after the operating system socket exists but
        # before the attributes close() reads are set (CI saw it): closing that half-made socket
        # must neither fail nor leave its descriptor open.
        (socket.socket.__init__, "self._io_refs = 0", "self"),
    ],
    ids=["in redis-py's connect", "in the socket constructor"],
)
def test_a_connect_interrupted_closes_the_socket_it_was_making(
    one_node: RedisNodes, function: Any, marker: str, name: str
) -> None:
    # A signal handler (a soft time limit) raising at that line, like a signal arriving there.
    code = function.__code__
    lines, first = inspect.getsourcelines(code)
    at = first + next(number for number, line in enumerate(lines) if marker in line)
    held: list[socket.socket] = []

    def at_the_line(frame: Any, event: str, argument: Any) -> Any:
        if event == "line" and frame.f_lineno == at and not held:
            held.append(frame.f_locals[name])
            raise Interrupted("a signal")
        return at_the_line

    def tracer(frame: Any, event: str, argument: Any) -> Any:
        return at_the_line if frame.f_code is code else None

    endpoint = Endpoint.from_url(one_node.urls[0], 1.0)
    sys.settrace(tracer)
    try:
        with pytest.raises(Interrupted):
            endpoint.open_socket()
    finally:
        sys.settrace(None)
    assert len(held) == 1
    assert held[0].fileno() == -1  # closed at once, not left to the garbage collector
    with endpoint.open_socket() as sock:  # and the next connect works
        assert sock.fileno() != -1


def test_callers_interrupted_by_signals_never_get_other_callers_replies(
    one_node: RedisNodes,
) -> None:
    # The same, at random moments, with other threads pipelining on the same connection: the
    # main thread's rounds are interrupted by a signal handler (every few milliseconds of CPU)
    # while four threads run rounds of their own. A queue out of step shows as wrong values.
    rounds = Rounds(one_node, node_timeout=1.0)
    values = distinct_values("signalled", 500)
    rounds.seed(values)
    keys = list(values)
    armed = [False]  # no lock: the handler may run while the main thread holds any

    def interrupt(signum: int, frame: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise Interrupted("a signal")

    stop = threading.Event()

    def others(number: int) -> list[str]:
        wrong: list[str] = []
        cycle = 0
        while not stop.is_set() and len(wrong) < 5:
            cycle += 1
            key = keys[100 + number * 100 + cycle % 100]
            wrong += rounds.read(key, values[key])[1]
        return wrong

    def unraisable(unraisable: Any) -> None:
        # Raised inside a finalizer (a weakref callback, a redis-py connection's __del__) or a
        # garbage collector callback (hypothesis installs one), the interruption cannot reach the
        # round: the next tick interrupts instead. Anything else unraisable still fails the test.
        if isinstance(unraisable.exc_value, Interrupted):
            armed[0] = True
        else:
            previous_hook(unraisable)

    problems: list[str] = []
    running = threading.Thread(target=lambda: problems.extend(run_threads(4, others)), daemon=True)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    previous = signal.signal(signal.SIGPROF, interrupt)
    signal.setitimer(signal.ITIMER_PROF, 0.001, 0.001)
    interrupted = completed = 0
    try:
        running.start()
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline and len(problems) < 5:
            key = keys[completed % 100]
            try:
                armed[0] = True
                result, wrong = rounds.read(key, values[key])
                armed[0] = False
                completed += 1
                problems += wrong
                if result.replies[0] is NO_REPLY:
                    time.sleep(0.01)  # backed off: let it come back
            except Interrupted:
                interrupted += 1
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, previous)
        sys.unraisablehook = previous_hook
        stop.set()
        running.join(timeout=30)
    print(f"\n{completed} rounds completed, {interrupted} interrupted")
    assert interrupted > 0
    assert problems == []


# -- 2. a fork with requests in flight ----------------------------------------------------------

FORK_WARNING = "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"


def report_and_exit(report_to: int, work: Callable[[], list[str]]) -> None:
    """In a forked child: run ``work``, write what went wrong to ``report_to`` as JSON and exit
    (1 if anything did); SIGALRM ends a child that hangs."""
    code = 2
    try:
        signal.alarm(20)
        problems = work()
        os.write(report_to, json.dumps(problems).encode())
        code = 1 if problems else 0
    except BaseException as error:
        os.write(report_to, json.dumps([f"the child raised {error!r}"]).encode())
    finally:
        os._exit(code)


def child_outcome(pid: int, report_from: int) -> tuple[str, list[str]]:
    """Wait for forked child ``pid`` and read its report: (how it ended, its problems)."""
    _, status = os.waitpid(pid, 0)
    chunks = []
    while chunk := os.read(report_from, 65536):
        chunks.append(chunk)
    os.close(report_from)
    if os.WIFSIGNALED(status):
        ended = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        ended = f"exit {os.waitstatus_to_exitcode(status)}"
    return ended, json.loads(b"".join(chunks) or b"[]")


@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_fork_with_requests_in_flight_leaves_each_process_its_own_replies(
    three_nodes: RedisNodes,
) -> None:
    # Threads of the parent wait on a frozen node with their acquisitions sent (one of them is
    # the reader, polling) when the process forks. The child must open connections of its own
    # and work on every node; the parent must get its own late replies, which the child must
    # never read.
    rounds = Rounds(three_nodes, node_timeout=5.0)
    frozen, threads = three_nodes[0], 8
    locks = {
        f"lock:{{parent-{n}}}": lock_value(TOKENS.new(), f"parent {n}") for n in range(threads)
    }
    rounds.full_cycle("before the fork")  # the parent's connections are open
    frozen.pause()
    parent_problems: list[str] = []

    def acquire(number: int) -> list[str]:
        key = list(locks)[number]
        result, wrong = rounds.acquire(key, locks[key])
        return wrong + missing(result, key)

    waiting = threading.Thread(
        target=lambda: parent_problems.extend(run_threads(threads, acquire)), daemon=True
    )
    resumed = False
    try:
        waiting.start()
        # Commands go to the nodes in order: once a lock is on nodes 1 and 2, its command to the
        # frozen node 0 was sent before them.
        assert wait_until(
            lambda: all(
                values_on(three_nodes.servers[1:], key) == [value] * 2
                for key, value in locks.items()
            ),
            timeout=10,
        )
        go_read, go_write = os.pipe()
        report_from, report_to = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(go_write)

            def work() -> list[str]:
                os.read(go_read, 1)  # the node is running again
                return rounds.full_cycle(f"child-{os.getpid()}")

            report_and_exit(report_to, work)
        os.close(go_read)
        os.close(report_to)
        frozen.resume()
        resumed = True
        os.write(go_write, b"x")
        os.close(go_write)
        ended, problems = child_outcome(child, report_from)
        assert problems == []
        assert ended == "exit 0"
        waiting.join(timeout=30)
        assert not waiting.is_alive()
    finally:
        if not resumed:
            frozen.resume()
    assert parent_problems == []
    # Each of the parent's locks is its own on every node, and the child left nothing behind.
    for key, value in locks.items():
        assert values_on(three_nodes, key) == [value] * 3
        released, wrong = rounds.release(key, value)
        assert wrong + missing(released, key) == []
    assert rounds.full_cycle("after the fork") == []


@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_forked_child_does_not_keep_the_parents_connections_open(
    three_nodes: RedisNodes,
) -> None:
    # The child opens connections of its own; the parent's, inherited at the fork, must not stay
    # open in it: a descriptor the child keeps keeps the parent's connection alive on the
    # server after the parent closed it (and in a prefork pool, every child forked after the
    # main process connected would hold its connections for life).
    rounds = Rounds(three_nodes, node_timeout=2.0)
    assert rounds.full_cycle("parent") == []
    assert [len(sockets_to(server)) for server in three_nodes] == [1, 1, 1]
    report_from, report_to = os.pipe()
    child = os.fork()
    if child == 0:

        def work() -> list[str]:
            problems = rounds.full_cycle(f"child-{os.getpid()}")
            held = [len(sockets_to(server)) for server in three_nodes]
            if held != [1, 1, 1]:
                problems.append(f"after its first rounds the child holds {held} connections")
            return problems

        report_and_exit(report_to, work)
    os.close(report_to)
    ended, problems = child_outcome(child, report_from)
    assert problems == []
    assert ended == "exit 0"


@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_fork_while_threads_read_and_write_does_not_hang_the_child(
    three_nodes: RedisNodes,
) -> None:
    # Other threads keep the reactor's reader role and the connections' locks busy while this
    # thread forks, again and again: a lock held at the fork must not be one the child needs.
    rounds = Rounds(three_nodes, node_timeout=2.0)
    stop = threading.Event()
    hammered: list[str] = []
    values = distinct_values("hammered", 4)
    rounds.seed(values)

    def hammer(number: int) -> list[str]:
        key = list(values)[number]
        problems: list[str] = []
        while not stop.is_set() and not problems:
            result, wrong = rounds.read(key, values[key], every=False)
            problems = wrong + (["no quorum"] if result.successes < 2 else [])
        return problems

    hammering = threading.Thread(
        target=lambda: hammered.extend(run_threads(4, hammer)), daemon=True
    )
    hammering.start()
    try:
        for fork in range(20):
            report_from, report_to = os.pipe()
            child = os.fork()
            if child == 0:
                report_and_exit(report_to, functools.partial(rounds.full_cycle, f"forked-{fork}"))
            os.close(report_to)
            assert child_outcome(child, report_from) == ("exit 0", [])
    finally:
        stop.set()
        hammering.join(timeout=30)
    assert hammered == []


@pytest.mark.filterwarnings(FORK_WARNING)
def test_no_token_is_taken_twice_by_threads_or_by_a_forked_child(one_node: RedisNodes) -> None:
    # Tokens are drawn from `secrets` many at a time: the first acquisition leaves the rest of
    # its draw in the parent, which a forked child copies and must never take.
    redlock = Redlock(one_node.urls)
    first = redlock.acquire("tokens:{parent}", ttl=10)
    assert first is not None
    report_from, report_to = os.pipe()
    child = os.fork()
    if child == 0:

        def work() -> list[str]:
            locks = [redlock.acquire(f"tokens:{{child-{n}}}", ttl=10) for n in range(8)]
            return [lock.token if lock is not None else "not acquired" for lock in locks]

        report_and_exit(report_to, work)  # the child's tokens, as its "problems"
    os.close(report_to)
    tokens = [first.token]

    def acquire(number: int) -> list[str]:
        lock = redlock.acquire(f"tokens:{{thread-{number}}}", ttl=10)
        assert lock is not None
        tokens.append(lock.token)
        return []

    assert run_threads(16, acquire) == []
    ended, child_tokens = child_outcome(child, report_from)
    assert ended == "exit 1"  # it reported its tokens
    assert len(child_tokens) == 8 and "not acquired" not in child_tokens
    assert len(set(tokens)) == 17
    assert set(tokens).isdisjoint(child_tokens)
    assert len(set(child_tokens)) == 8


# -- 3. a node that hangs mid-pipeline ----------------------------------------------------------


@dataclass
class Pipelining:
    """Threads that keep rounds going on one group until stopped: READs that wait for every
    node, and acquire-release pairs that decide at quorum. What each round saw is kept."""

    rounds: Rounds
    values: dict[str, str]
    stop: threading.Event = field(default_factory=threading.Event)
    finished: list[tuple[float, float, RoundResult]] = field(default_factory=list)

    def run(self, number: int) -> list[str]:
        """Thread ``number``'s loop; what went wrong."""
        key = list(self.values)[number]
        problems: list[str] = []
        iteration = 0
        while not self.stop.is_set():
            iteration += 1
            started = time.monotonic()
            if iteration % 2:
                result, wrong = self.rounds.read(key, self.values[key])
                problems += wrong + missing(result, key, (1, 2))
            else:
                lock = f"lock:{{{key}-{iteration}}}"
                value = lock_value(TOKENS.new(), key)
                result, wrong = self.rounds.acquire(lock, value, every=False)
                released, _ = self.rounds.release(lock, value, every=False)
                problems += wrong
                for index, reply in enumerate(released.replies):
                    # 1 where the acquisition landed; a node it skipped (backed off) has no key.
                    expected = (1,) if isinstance(result.replies[index], int) else (0, 1)
                    if reply is not NO_REPLY and reply not in expected:
                        problems.append(f"node {index}: release of {lock} got {reply!r}")
                if result.successes < 2 or released.successes < 2:
                    problems.append(f"{lock}: no quorum ({result}, {released})")
            self.finished.append((started, time.monotonic(), result))
        return problems

    def rounds_since(self, moment: float) -> list[RoundResult]:
        """The rounds that began after ``moment``."""
        return [result for started, _, result in list(self.finished) if started > moment]


def test_a_node_that_hangs_mid_pipeline_costs_one_node_timeout(three_nodes: RedisNodes) -> None:
    # Many threads pipeline their commands on one connection per node when node 0 freezes with
    # commands in flight. Every caller returns within about node_timeout, the node is backed
    # off, the two others keep the quorum, nobody gets another's reply, and once the node runs
    # again it is used again.
    node_timeout, threads = 0.3, 12
    pipelining = Pipelining(Rounds(three_nodes, node_timeout), distinct_values("piped", threads))
    pipelining.rounds.seed(pipelining.values)
    problems: list[str] = []
    running = threading.Thread(
        target=lambda: problems.extend(run_threads(threads, pipelining.run, timeout=60)),
        daemon=True,
    )
    frozen = three_nodes[0]
    running.start()
    try:
        assert wait_until(lambda: len(pipelining.finished) >= threads * 4, timeout=10)
        frozen.pause()
        paused_at = time.monotonic()
        try:

            def backed_off() -> bool:
                return any(
                    (result.failures[0] or "").startswith("skipped while backed off")
                    for result in pipelining.rounds_since(paused_at)
                )

            assert wait_until(backed_off, timeout=10)
            # The others keep going meanwhile (checked by each thread: a quorum every time).
            going = len(pipelining.finished)
            assert wait_until(lambda: len(pipelining.finished) >= going + threads * 4, timeout=10)
        finally:
            frozen.resume()
        resumed_at = time.monotonic()
        assert wait_until(
            lambda: any(
                result.replies[0] is not NO_REPLY for result in pipelining.rounds_since(resumed_at)
            ),
            timeout=10,
        )
    finally:
        pipelining.stop.set()
        running.join(timeout=60)
    assert not running.is_alive()
    assert problems == []
    longest = max(ended - started for started, ended, _ in pipelining.finished)
    print(f"\n{len(pipelining.finished)} rounds; the longest took {longest:.3f} s")
    # At most one node_timeout (on a busy machine, plus a generous margin), never one per
    # command queued on the frozen connection.
    assert longest < node_timeout + 2.0


# -- 4. 200 threads, one node frozen for a while ------------------------------------------------


def test_two_hundred_threads_on_three_nodes_with_one_frozen(three_nodes: RedisNodes) -> None:
    # 200 threads share one connection per node. Node 2 freezes for a while: every acquisition
    # of a key of a thread's own still succeeds on the other two, the shared key never has two
    # holders, nobody hangs, and the nodes see a handful of connections, not 200.
    dlm = Redlock(three_nodes.urls, retry_count=10, retry_delay=0.01, node_timeout=1.0)
    threads, contenders = 200, 20
    stop = threading.Event()
    done = [0]
    shared = {"inside": 0, "most": 0, "entries": 0}
    guard = threading.Lock()
    unconfirmed: list[tuple[str, float]] = []  # releases no majority confirmed, and when
    frozen_between = [float("inf"), float("inf")]

    def work(number: int) -> list[str]:
        problems: list[str] = []
        cycle = 0
        while not stop.is_set() and not problems:
            cycle += 1
            if number < contenders:
                lock = dlm.acquire("shared", ttl=10.0, blocking=True, timeout=30.0)
                if lock is None:
                    return [f"contender {number} waited 30 s in vain"]
                with guard:
                    shared["inside"] += 1
                    shared["most"] = max(shared["most"], shared["inside"])
                    shared["entries"] += 1
                time.sleep(0.001)
                with guard:
                    shared["inside"] -= 1
            else:
                lock = dlm.acquire(f"own-{number}-{cycle}", ttl=10.0)
                if lock is None:
                    return [f"thread {number}: own-{number}-{cycle} was held by somebody"]
            if not dlm.release(lock):
                # A lock granted by the node that then froze and one other cannot be confirmed
                # released by a majority while the node is frozen; any other is a problem.
                unconfirmed.append((lock.resource, time.monotonic()))
            with guard:
                done[0] += 1
        return problems

    problems: list[str] = []
    running = threading.Thread(
        target=lambda: problems.extend(run_threads(threads, work, timeout=60)), daemon=True
    )
    frozen, live = three_nodes[2], three_nodes.servers[:2]
    running.start()
    connections: list[int] = []
    turns_after = 0.0
    try:
        assert wait_until(lambda: done[0] >= threads, timeout=20, alive=[])
        frozen.pause()
        frozen_between[0] = time.monotonic()
        try:
            going, entries, paused_at = done[0], shared["entries"], time.monotonic()
            # Long enough for the node to be backed off, probed in vain and backed off again,
            # and for the contenders to take turns meanwhile: rounds in flight when it froze wait
            # for it (a node timeout of 1 s here), and so do subscriptions made before it is
            # backed off; on a loaded host that can take more than the first two seconds.
            while running.is_alive() and (
                done[0] < going + 2 * threads
                or time.monotonic() < paused_at + 2.0
                or (shared["entries"] == entries and time.monotonic() < paused_at + 20.0)
            ):
                connections += [client_connections(server) for server in live]
                time.sleep(0.05)
            turns_after = time.monotonic() - paused_at
            assert shared["entries"] > entries, f"no contender took the lock in {turns_after:.1f}s"
        finally:
            frozen.resume()
            frozen_between[1] = time.monotonic()
        going = done[0]
        assert wait_until(lambda: done[0] >= going + threads, timeout=20)
        assert wait_until(
            lambda: client_connections(frozen) <= MOST_CONNECTIONS_PER_NODE, timeout=5
        )
        connections += [client_connections(server) for server in three_nodes]
    finally:
        stop.set()
        running.join(timeout=60)
    print(f"\n{done[0]} acquire+release by {threads} threads; connections per node {connections}")
    print(f"the contenders took the lock again {turns_after:.1f}s into the freeze")
    assert not running.is_alive()
    assert problems == []
    # Unconfirmed releases only while the node was frozen (plus the node timeout and a margin
    # for the thaw: a lock granted just before it froze is released just after).
    start, end = frozen_between
    outside = [(resource, at) for resource, at in unconfirmed if not start <= at <= end + 3.0]
    assert outside == [], f"releases unconfirmed with every node up: {outside}"
    assert shared["most"] == 1
    assert shared["entries"] >= contenders
    assert max(connections) <= MOST_CONNECTIONS_PER_NODE


class ReleasedDuringTheAttempt(Redlock):
    """A lock manager whose ``holding`` lock is released right after a blocking waiter's
    listening attempt saw it held, before the waiter goes to sleep: the narrowest window of a
    blocking acquisition (the holder releasing at that moment), held open."""

    holding: Lock | None = None
    attempts = 0

    # White box: every attempt of one blocking acquisition goes through this one step.
    def _attempt_at(self, acquisition: Acquisition) -> Outcome:
        outcome = super()._attempt_at(acquisition)
        self.attempts += 1
        # The waiter's first attempt comes before it listens; its second, after.
        if self.attempts == 2 and self.holding is not None:
            holding, self.holding = self.holding, None
            assert self.release(holding)
            for _ in range(5):
                self.holder_of(acquisition.resource)  # rounds read the notification in
        return outcome


def test_a_release_heard_between_the_attempt_and_the_wait_wakes_the_waiter(
    three_nodes: RedisNodes,
) -> None:
    # Every thread's release notifications arrive on one shared subscriber connection and are
    # read by whichever thread reads. One that arrives while the waiter is still in its attempt
    # must wake it: the lock is free, and the waiter must not sleep until the released lock's
    # ttl (with many contenders, the last waiter would sleep the whole ttl).
    dlm = ReleasedDuringTheAttempt(three_nodes.urls, node_timeout=0.5)
    dlm.holding = dlm.acquire("heard", ttl=4.0)
    assert dlm.holding is not None
    dlm.attempts = 0
    started = time.monotonic()
    lock = dlm.acquire("heard", ttl=4.0, blocking=True, timeout=10.0)
    waited = time.monotonic() - started
    print(f"\nthe waiter got the lock after {waited:.3f} s and {dlm.attempts} attempts")
    assert lock is not None
    assert dlm.holding is None  # released during the waiter's second attempt
    assert waited < 2.0  # woken by the release, not by the released lock's expiry (4 s)
    assert dlm.release(lock)


# -- 5. gevent and eventlet ---------------------------------------------------------------------


BURST_SECONDS = 2.0
"""How long 200 greenlets of a fresh process make attempts with every node healthy (issue 39
measured 36 false "unavailable" in the first 2.3 s)."""


@pytest.mark.parametrize("mode", ["gevent", "eventlet"])
def test_greenlets_share_the_connections(three_nodes: RedisNodes, mode: str) -> None:
    # A monkey-patched process. First, from a cold start, 200 greenlets make single-round
    # attempts for a few seconds with every node healthy: not one may come back unavailable.
    # Then a greenlet takes a lock while another waits for a held one (and so reads the
    # connections). Then 200 greenlets, 20 of them contending for one key
    # with blocking=True (woken by release notifications), the others on keys of their own:
    # with node 0 frozen, then with every node running again.
    if importlib.util.find_spec(mode) is None:  # not imported here: only patched processes
        pytest.skip(f"{mode} is not installed (the test extra lists it)")
    options = {
        "urls": three_nodes.urls,
        "node_timeout": 0.5,
        "phases": ["burst", "beside-a-waiter", "load", "load"],
        "burst_seconds": BURST_SECONDS,
    }
    frozen = three_nodes[0]
    with subprocess.Popen(
        [sys.executable, str(GREEN_SCRIPT), mode, json.dumps(options)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=TESTS_DIRECTORY,
    ) as process:
        assert process.stdin is not None and process.stdout is not None
        lines = []
        try:
            for change in (lambda: None, frozen.pause, frozen.resume, None):
                lines.append(process.stdout.readline())
                if change is not None:
                    change()
                    process.stdin.write("next\n")
                    process.stdin.flush()
            process.wait(timeout=60)
        finally:
            frozen.resume()
            if process.poll() is None:
                process.kill()
        errors = process.stderr.read() if process.stderr is not None else ""
    assert process.returncode == 0, errors
    burst, beside, *loads = [json.loads(line) for line in lines]
    print(f"\n{mode}: {burst}")
    assert burst["patched"] is True
    assert burst["hung"] == 0
    assert set(burst["outcomes"]) == {"Acquired"}, burst["failures"]
    assert burst["outcomes"]["Acquired"] >= 200, burst  # every greenlet made an attempt
    print(f"\n{mode}: {beside}")
    assert beside == {
        "mode": "beside-a-waiter",
        "patched": True,
        "held": True,
        "free": True,
        "waiter": True,
    }
    for summary in loads:
        print(f"{mode}: {summary}")
        assert summary["patched"] is True
        assert summary["has_poll"] is (mode == "gevent")  # eventlet removes select.poll
        assert summary["hung"] == 0
        assert summary["errors"] == []
        assert summary["overlaps"] == []
        assert summary["counter"] == summary["expected_counter"]
        assert summary["acquired"] == summary["expected_acquired"]
    assert max(loads[-1]["connections"]) <= MOST_CONNECTIONS_PER_NODE


# -- 6. prefork --------------------------------------------------------------------------------


def test_prefork_pool_processes_each_have_connections_of_their_own() -> None:
    # A real `celery worker -P prefork -c 3` runs singleton tasks against three nodes. Each pool
    # process uses connections of its own (none shared with, or inherited from, another
    # process), a handful per node, and no two runs of one key overlap. Then a pool process is
    # killed mid-run: the main process frees its lock (over connections of its own) and forks a
    # replacement, which must not hold the main process's connections either.
    with (
        RedisServer() as broker,
        RedisNodes(3) as nodes,
        celery_processes() as processes,
    ):
        client_app = control_app(broker, result_backend=broker.url)
        worker = WorkerProcess(
            "celery_apps.prefork_app", "multiplexed", app_environment(broker, nodes), 3
        )
        log = RunLog(broker.url)

        def send(key: str, seconds: float) -> AsyncResult:
            return client_app.send_task("celery_apps.prefork_app.sleeper", args=(key, seconds))

        def run_batch(batch: str) -> None:
            # Keys of their own, long enough for every pool process to get some; then contention.
            results = [send(f"{batch}-own-{number}", 0.3) for number in range(6)]
            results += [send(f"{batch}-contended-{number % 2}", 0.02) for number in range(24)]
            for result in results:
                outcome = result.get(timeout=30, propagate=False)
                # A run, or a duplicate skipped while another run held its key.
                assert result.successful() or isinstance(outcome, DuplicateSkipped), outcome

        def check_connections(pool: set[int], ran: set[int]) -> None:
            everyone = {worker.pid, *pool}
            role = {pid: "pool process" for pid in pool} | {worker.pid: "main process"}
            for server in nodes:
                held = {pid: sockets_to(server, pid) for pid in everyone}
                print(f"node {server.port}: connections by process {held}")
                for pid in ran & pool:
                    assert held[pid], f"pool process {pid} ran tasks without a connection"
                for pid, sockets in held.items():
                    # Its shared connection and a subscriber at most.
                    assert len(sockets) <= 2, (pid, held)
                shared = {
                    inode: sorted(f"{role[pid]} {pid}" for pid in everyone if inode in held[pid])
                    for inode in set().union(*held.values())
                }
                assert {inode: by for inode, by in shared.items() if len(by) > 1} == {}, (
                    f"connections to node {server.port} held open by several processes"
                )
                assert client_connections(server) <= 2 * len(everyone)

        try:
            processes.append(worker.start())
            worker.wait_ready(client_app)
            run_batch("first")
            log.assert_no_overlap()
            pool = worker.child_pids()
            ran = {run["pid"] for run in log.runs()}
            assert len(pool) == 3 and ran <= pool and len(ran) >= 2, (pool, ran)
            print()
            check_connections(pool, ran)

            killed = send("killed", 20)
            started = log.wait_task_started(killed.id, timeout=15)
            os.kill(started["pid"], signal.SIGKILL)
            log.mark_ended(started, time.time())  # the killed child can no longer record it
            assert wait_until(lambda: key_gone(nodes, started["key"]), timeout=15)
            assert wait_until(lambda: len(worker.child_pids() - pool) == 1, timeout=15)
            run_batch("second")
            log.assert_no_overlap()
            pool = worker.child_pids()
            check_connections(pool, {run["pid"] for run in log.runs()})
        finally:
            collect_results_while_the_broker_is_up()
            client_app.close()
