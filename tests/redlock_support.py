"""Small helpers shared by every test module (tests/ is on ``sys.path``, so this is imported as
``redlock_support``; it is not a harness: servers come from celery_redlock.testing through the
fixtures of tests/conftest.py)."""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import kombu
import pytest
from celery.backends.redis import RedisBackend

from celery_redlock import QuorumUnavailable, Redlock
from celery_redlock.lock.nodes.reactor import Reactor
from celery_redlock.testing import RedisServer


class Watched(Protocol):
    """Something `wait_until` can check on while it polls (a `CeleryProcess`)."""

    def check_alive(self) -> None: ...


def wait_until(
    condition: Callable[[], object],
    timeout: float = 3.0,
    interval: float = 0.005,
    alive: Iterable[Watched] = (),
) -> bool:
    """Poll ``condition`` every ``interval`` seconds; True as soon as it holds, False at timeout.

    Before every poll each of the ``alive`` processes is checked, so a test fails at once (with
    the process's log) when one has exited instead of waiting out the timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        for process in alive:
            process.check_alive()
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


KOMBU_VERSION = tuple(int(part) for part in kombu.__version__.split(".")[:2])

requires_prompt_redelivery = pytest.mark.skipif(
    KOMBU_VERSION < (5, 7),
    reason="kombu before 5.7 restores unacknowledged Redis messages every 10 s at best "
    "(no unacked_restore_interval): redelivery tests would take minutes",
)
"""Marks tests that need the Redis transport to redeliver past visibility_timeout promptly."""


def collect_results_while_the_broker_is_up() -> None:
    """Run the finalizers of results a test left behind now, while their servers still run.

    A Celery ``AsyncResult`` unsubscribes from its Redis back-end when it is garbage collected;
    collected after its server stopped, it retries for 20 s in whatever test runs then. Celery's
    Redis result back-ends (one per app and thread, an embedded worker's threads included) are
    closed first: Celery leaves their connections to the garbage collector, which finds their
    sockets unclosed (a ResourceWarning, an error in this suite) in whatever test runs then.
    """
    for found in gc.get_objects():
        # type(), not isinstance(): isinstance asks a Celery proxy for its __class__, which
        # evaluates the proxy (a current app, a current task...).
        if issubclass(type(found), RedisBackend):
            client = vars(found).get("client")  # made on first use (a cached property)
            if client is not None:
                client.connection_pool.disconnect()
    gc.collect()


def value_on(server: RedisServer, key: str) -> str | None:
    """The value of ``key`` on one running, unpaused server (None when absent)."""
    with server.client(socket_timeout=2, decode_responses=True) as client:
        value: str | None = client.get(key)
        return value


def values_on(servers: Iterable[RedisServer], key: str) -> list[str | None]:
    """The value of ``key`` on each server, in order."""
    return [value_on(server, key) for server in servers]


def pttl_on(server: RedisServer, key: str) -> int:
    """PTTL of ``key`` on one server (-2 when absent, -1 without expiry)."""
    with server.client(socket_timeout=2) as client:
        return int(client.pttl(key))


def pttls_on(servers: Iterable[RedisServer], key: str) -> list[int]:
    """PTTL of ``key`` on each server, in order."""
    return [pttl_on(server, key) for server in servers]


@contextlib.contextmanager
def commands_seen(servers: Sequence[RedisServer]) -> Iterator[list[list[dict[str, Any]]]]:
    """``with commands_seen(servers) as seen:`` MONITORs each server for the block; on exit
    ``seen[i]`` holds every command server ``i`` ran meanwhile, as redis-py's ``Monitor`` parses
    them (``client_type`` is ``"lua"`` for a script's own commands; ``command`` is the command
    and its arguments, joined by spaces). The end is an ``ECHO`` of a marker, read back in order:
    no waiting."""
    seen: list[list[dict[str, Any]]] = [[] for _ in servers]
    with contextlib.ExitStack() as stack:
        monitors = [
            stack.enter_context(stack.enter_context(server.client(socket_timeout=5)).monitor())
            for server in servers
        ]
        yield seen
        marker = f"end-of-monitoring-{secrets.token_hex(8)}"
        for server, monitor, commands in zip(servers, monitors, seen, strict=True):
            with server.client(socket_timeout=5) as client:
                client.echo(marker)
            while (command := monitor.next_command())["command"] != f"ECHO {marker}":
                commands.append(command)


def script_commands(commands: Iterable[dict[str, Any]]) -> list[str]:
    """The names of the commands scripts ran, in order (``["GET", "SET", ...]``)."""
    return [
        command["command"].split(" ")[0].upper()
        for command in commands
        if command["client_type"] == "lua"
    ]


class Stopwatch:
    """``with Stopwatch() as watch: ...`` then ``watch.elapsed`` in seconds (monotonic)."""

    def __enter__(self) -> Stopwatch:
        self.started = time.monotonic()
        self.elapsed = 0.0
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.elapsed = time.monotonic() - self.started


def run_together(script: str, argument: str, count: int, timeout: float) -> list[str]:
    """Run ``python -c script argument`` in ``count`` processes that start work together: each
    prints ``ready`` once set up, and gets ``go`` on its standard input when all have. Returns
    the standard error of those that exited with a status other than 0 (an empty list: all
    succeeded); processes still running after ``timeout`` seconds are killed."""
    with contextlib.ExitStack() as stack:  # each Popen closes its pipes on exit
        processes = [
            stack.enter_context(
                subprocess.Popen(
                    [sys.executable, "-c", script, argument],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            for _ in range(count)
        ]
        try:
            for process in processes:
                assert process.stdout is not None
                assert process.stdout.readline().strip() == "ready"
            for process in processes:
                assert process.stdin is not None
                process.stdin.write("go\n")
                process.stdin.flush()
            codes = [process.wait(timeout=timeout) for process in processes]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        return [
            process.stderr.read() if process.stderr is not None else f"exit status {code}"
            for process, code in zip(processes, codes, strict=True)
            if code != 0
        ]


def first_calls(redlock: Redlock, threads: int, resource: str) -> list[float]:
    """``threads`` threads released at once each acquire (and then release) a lock of their own
    (named anew on every call: a release a busy node answered late may still be owed to it):
    the seconds each acquisition took; every acquisition and release must succeed."""
    resource = f"{resource}:{secrets.token_hex(4)}"
    start = threading.Barrier(threads)
    seconds: list[float] = []
    failed: list[str] = []

    def call(number: int) -> None:
        start.wait()
        started = time.perf_counter()
        try:
            lock = redlock.acquire(f"{resource}:{number}", 10)
        except QuorumUnavailable as error:
            seconds.append(time.perf_counter() - started)
            failed.append(f"thread {number}: {error}")
            return
        seconds.append(time.perf_counter() - started)
        if lock is None or not redlock.release(lock):
            failed.append(f"thread {number}: {lock}")

    callers = [threading.Thread(target=call, args=(number,)) for number in range(threads)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(30)
    assert failed == [] and len(seconds) == threads, failed
    return seconds


def exit_code_of_forked_child(body: Callable[[], bool], timeout: float = 20.0) -> int:
    """Fork; the child runs ``body`` and exits with 0 if it returned True, 1 if it returned
    False, 3 if it raised (its traceback on standard error), or is killed after ``timeout``
    seconds (SIGALRM: -14). Returns the child's exit code."""
    child = os.fork()
    if child == 0:
        code = 3
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(int(timeout))
            code = 0 if body() else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout + 10
    while (ended := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if ended[0] == 0:
        os.kill(child, signal.SIGKILL)
        ended = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(ended[1])


def slow_reactor_disposals(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[Reactor]:
    """Every reactor disposed of from now on (in a forked child: the parent's, by the child's
    first call) waits ``seconds`` before it closes its sockets, long enough for the child's other
    threads to ask for the connections meanwhile. Returns the reactors disposed of, once per
    disposal."""
    disposals: list[Reactor] = []
    close_sockets = Reactor.close_sockets

    def slow_close_sockets(self: Reactor) -> None:
        disposals.append(self)
        time.sleep(seconds)
        close_sockets(self)

    monkeypatch.setattr(Reactor, "close_sockets", slow_close_sockets)
    return disposals
