"""A client interrupted at every line of the node layer, in turn, still locks correctly (issue 37).

A signal handler that raises (Celery's soft time limit raises SoftTimeLimitExceeded, an
`Exception`, that way; Ctrl-C raises KeyboardInterrupt) can interrupt a caller anywhere in the
node layer. Here a trace function raises `Injected` in the main thread of one client, call after
call (attempts, waiting attempts, extensions, releases, reads of the holder, closes), each time at
the first line of the node layer that it has not raised at yet, until calls reach no new line;
between calls the client closes its connections or the servers cut them, so that connecting is
interrupted too. Then 16 threads, 8 of that client and 8 of an independent one, contend for 3
locks for `CONTENTION_SECONDS`. No lock may be granted that a majority of the servers does not
hold for its holder, no two holders of one lock may overlap, no call may hang, no reply may reach
a caller it was not meant for, and every connection of the interrupted client must answer
correctly afterwards.

What an interruption breaks, the next reconnection of the main thread may mend before anybody
notices: so 2 of the 16 threads of each client contend during the interruption phase already, and
after every interrupted call the main thread waits until both of the interrupted client's have
made an attempt of their own (on the connections as the interruption left them). A reply that
reached another caller than its own mostly shows as a reply its script cannot give, since a
majority of servers outvotes one connection out of step: the servers here are honest, so the node
layer's warning that it marked a server down for such a reply (or an outcome that says so) is a
failure.

Only the public API (`Redlock`, its outcomes and its log) and the list of the node layer's source
files are used, so that the test holds whatever the node layer's insides are. The trace function
needs the exception table of CPython 3.11 and later (`signal_can_land`).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import math
import os
import random
import secrets
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest
import redis
from robustness.interruptions import InstructionTracer, signal_can_land

import celery_redlock.lock.nodes
from celery_redlock import Lock, QuorumUnavailable, Redlock
from celery_redlock.lock.outcomes import Acquired, Unavailable
from celery_redlock.testing import RedisNodes

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="the trace function reads CPython 3.11's exception table"
)

NODE_LAYER_FILES = frozenset(
    str(path.resolve()) for path in Path(celery_redlock.lock.nodes.__file__).parent.rglob("*.py")
)
"""Every source file of the node layer: the trace function raises in these only."""

NODE_TIMEOUT = 0.1
TTL = 1.0
CONTENTION_SECONDS = 10.0
THREADS_PER_CLIENT = 8
EARLY_THREADS_PER_CLIENT = 2
"""Threads of each client that contend during the interruption phase already."""
RESOURCE_COUNT = 3

CUT_EVERY = 10
"""The servers cut the clients' connections at every tenth reconnection of the main thread, the
client closes them itself at the others (a cut backs the servers off for a while: the calls after
it go unanswered, and do not count)."""
QUIET_CALLS = 40
"""The interruption phase ends once this many calls in a row reached no line that was not
interrupted before (calls the servers did not answer do not count)."""
LEAST_LINES_INTERRUPTED = 120
"""Fewer distinct lines interrupted would mean that the calls missed most of the node layer:
157 are on the main thread's path with one reactor thread owning the connections (a signal can
land only after a call, at a loop's back edge or on a function's entry)."""
LONGEST_CALL_SECONDS = 20.0
"""A call of the main thread still running after this long is hung (so are contending threads
that make no attempt for this long): the test fails with every thread's stack instead of hanging
the suite."""
LONGEST_SILENCE_SECONDS = 10.0
"""An interrupted client that answers no call for this long has stopped working."""
HANG_GRACE_SECONDS = 20.0
"""How long past the contention's end a contending thread may take to finish its last call."""
LEAST_HOLDS = 100
"""Fewer holds in the contention would mean that the clients hardly contended."""
CHECKER = "interrupted-everywhere-checker"
"""The client name of the test's own connections to the servers, which the cuts spare."""
MISROUTED = "cannot give"
"""What the node layer says of a reply that its script cannot give ("a reply the acquire script
cannot give: ..."), which from an honest server means a reply meant for another caller."""


class Injected(Exception):
    """Raised by the trace function inside the node layer, as a signal handler would raise."""


class Hung(BaseException):
    """Raised in the main thread by the watchdog: a call did not return (not an `Exception`, so
    that no handler of the library swallows it)."""


# -- the trace function ----------------------------------------------------------------------------


class LineInterrupter:
    """A trace function (`sys.settrace`) for the thread that installs it: while `armed`, it raises
    `Injected` at the first line event of a node layer file whose line it never raised at, unless
    the exception would escape a block there as no signal handler's can (`signal_can_land`). One
    line per call at most: CPython removes a trace function that raised (`install` puts it back).
    ``interrupted`` lists the lines it raised at, in order."""

    def __init__(self) -> None:
        self.armed = False
        self.interrupted: list[tuple[str, int]] = []
        self._done: set[tuple[str, int]] = set()
        self._files: dict[CodeType, str] = {}  # each traced code's file ("" outside the layer)

    def install(self) -> None:
        """Trace the current thread from now on."""
        sys.settrace(self._on_call)

    def remove(self) -> None:
        """Stop tracing the current thread."""
        self.armed = False
        sys.settrace(None)

    def _on_call(self, frame: FrameType, event: str, argument: Any) -> Any:
        if not self._file_of(frame.f_code):
            return None
        if isinstance(frame.f_trace, InstructionTracer):
            return frame.f_trace  # a generator resumed: the instruction before is its yield
        frame.f_trace_opcodes = True
        return InstructionTracer(self.at_line)

    def _file_of(self, code: CodeType) -> str:
        """The node layer file ``code`` is from, "" when it is from none."""
        file = self._files.get(code)
        if file is None:
            file = os.path.realpath(code.co_filename)
            file = self._files[code] = file if file in NODE_LAYER_FILES else ""
        return file

    def at_line(self, frame: FrameType, previous: int | None) -> None:
        """Raise `Injected` at this line event unless the line was interrupted before, the
        interrupter is not armed, or the exception would escape a block."""
        if not self.armed:
            return
        where = (self._file_of(frame.f_code), frame.f_lineno)
        if where in self._done or not signal_can_land(frame.f_code, previous, frame.f_lasti):
            return
        self._done.add(where)
        self.interrupted.append(where)
        raise Injected(f"{Path(where[0]).name}:{where[1]} ({frame.f_code.co_qualname})")


# -- what went wrong -----------------------------------------------------------------------------


def every_stack() -> str:
    """The stack of every thread of this process."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


class Watchdog:
    """``with watchdog.watching(seconds):`` raises `Hung` in the main thread (from a SIGUSR1
    handler: pytest-timeout has SIGALRM) when the block runs longer than ``seconds``, with every
    thread's stack at that moment."""

    def __init__(self) -> None:
        self.stacks = ""
        self._watching = False
        self._main = threading.main_thread().ident
        self._previous: Any = signal.signal(signal.SIGUSR1, self._raise)

    def _raise(self, signum: int, frame: FrameType | None) -> None:
        if self._watching:
            self._watching = False
            raise Hung(self.stacks)

    def _bark(self) -> None:
        if self._watching and self._main is not None:
            self.stacks = every_stack()
            signal.pthread_kill(self._main, signal.SIGUSR1)

    @contextmanager
    def watching(self, seconds: float) -> Iterator[None]:
        """Bound the block's time."""
        timer = threading.Timer(seconds, self._bark)
        timer.daemon = True
        self._watching = True
        timer.start()
        try:
            yield
        finally:
            self._watching = False
            timer.cancel()

    def close(self) -> None:
        """Give SIGUSR1 back its previous handler."""
        signal.signal(signal.SIGUSR1, self._previous)


@dataclass
class Findings:
    """What the test saw, as text only (no reference to a client: a client left to the garbage
    collector after the test could close its sockets in another test)."""

    lines_interrupted: list[tuple[str, int]] = field(default_factory=list)
    calls: int = 0
    injected: int = 0
    interruption_seconds: float = 0.0
    hung: list[str] = field(default_factory=list)
    stopped_answering: list[str] = field(default_factory=list)
    misrouted: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    unclosed_sockets: int = 0
    holds: int = 0
    unverified: int = 0
    wrong_grants: list[str] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)
    contention_errors: list[str] = field(default_factory=list)
    wrong_afterwards: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Every way the promise was broken, with a few examples of each."""
        kinds = {
            "hung": self.hung,
            "wrong grants": self.wrong_grants,
            "overlapping holders": self.overlaps,
            "replies that reached another caller": self.misrouted,
            "stopped answering": self.stopped_answering,
            "wrong answers afterwards": self.wrong_afterwards,
            "unexpected errors": self.unexpected,
            "errors while contending": self.contention_errors,
        }
        problems = [
            f"{len(found)} {kind}:\n  " + "\n  ".join(found[:5])
            for kind, found in kinds.items()
            if found
        ]
        if len(self.lines_interrupted) < LEAST_LINES_INTERRUPTED:
            problems.append(f"only {len(self.lines_interrupted)} lines interrupted")
        if self.holds < LEAST_HOLDS and not self.hung:
            problems.append(f"only {self.holds} holds while contending")
        return problems

    def summary(self) -> str:
        """The figures of the run."""
        files = len({file for file, _ in self.lines_interrupted})
        return (
            f"{len(self.lines_interrupted)} lines of {files} node layer files interrupted, in "
            f"{self.calls} calls ({self.injected} interrupted) in "
            f"{self.interruption_seconds:.1f}s; {self.holds} holds ({self.unverified} not "
            f"verified in time), {len(self.wrong_grants)} wrong grants, {len(self.overlaps)} "
            f"overlaps, {len(self.misrouted)} replies to another caller, "
            f"{len(self.contention_errors)} errors; {self.unclosed_sockets} sockets left to the "
            "garbage collector"
        )


@contextmanager
def unraisables_noted(findings: Findings) -> Iterator[None]:
    """Note what is raised where nobody can catch it (finalizers) during the block: `Injected`
    (raised inside a finalizer that ran during a call: it could not reach the call) is ignored;
    an unclosed socket is counted (its finalizer closes it; the sockets an interruption leaves
    behind are not what this test is about); anything else is unexpected."""
    previous = sys.unraisablehook

    def note(unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, Injected):
            return
        if isinstance(error, ResourceWarning) and "unclosed <socket" in str(error):
            findings.unclosed_sockets += 1
            return
        findings.unexpected.append(f"unraisable {error!r} in {unraisable.object!r}")

    sys.unraisablehook = note
    try:
        yield
    finally:
        sys.unraisablehook = previous


class MisroutedReplies(logging.Handler):
    """Notes the node layer's warnings about replies that its scripts cannot give."""

    def __init__(self, findings: Findings) -> None:
        super().__init__(logging.WARNING)
        self.findings = findings

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if MISROUTED in message:
            self.findings.misrouted.append(message)


@contextmanager
def misrouted_replies_noted(findings: Findings) -> Iterator[None]:
    """Note the misrouted replies the package warns of during the block."""
    logger = logging.getLogger("celery_redlock")
    handler = MisroutedReplies(findings)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def misrouted_in(outcome: object) -> list[str]:
    """The reasons an `Unavailable` outcome gives that tell of a misrouted reply."""
    if not isinstance(outcome, Unavailable):
        return []
    return [reason for reason in outcome.error.reasons if MISROUTED in reason]


# -- the interruption phase ----------------------------------------------------------------------


def cut_connections(servers: RedisNodes) -> None:
    """Have every server close the clients' connections (not the checker's, nor this one's):
    their next calls connect anew."""
    for server in servers:
        with server.client(socket_timeout=2, decode_responses=True) as client:
            own = client.client_id()
            for connection in client.client_list():
                if connection["name"] == CHECKER or int(connection["id"]) == own:
                    continue
                with contextlib.suppress(redis.ResponseError):  # gone meanwhile
                    client.execute_command("CLIENT", "KILL", "ID", connection["id"])


class Interruptions:
    """Calls of every kind on one client, in the main thread, each interrupted at the first node
    layer line it reaches that no earlier call was interrupted at."""

    def __init__(self, redlock: Redlock, servers: RedisNodes, prefix: str) -> None:
        self.redlock = redlock
        self.servers = servers
        self.resources = [f"{prefix}:interrupted:{number}" for number in range(RESOURCE_COUNT)]
        self.interrupter = LineInterrupter()
        self.held: list[Lock] = []  # taken by calls that returned; released by later calls
        self.rng = random.Random(37)

    def run(
        self, findings: Findings, watchdog: Watchdog, after_interruption: Callable[[], bool]
    ) -> None:
        """Call until `QUIET_CALLS` calls in a row reach no new line, calling
        ``after_interruption`` after every call interrupted (False from it ends the phase)."""
        started = time.monotonic()
        findings.lines_interrupted = self.interrupter.interrupted
        try:
            self._run(findings, watchdog, after_interruption)
        finally:
            findings.interruption_seconds = time.monotonic() - started

    def _run(
        self, findings: Findings, watchdog: Watchdog, after_interruption: Callable[[], bool]
    ) -> None:
        steps = self._steps()
        quiet = 0
        answered_at = time.monotonic()
        interrupted_when_answered = 0
        while quiet < QUIET_CALLS:
            step = next(steps)
            findings.calls += 1
            before = len(self.interrupter.interrupted)
            with watchdog.watching(LONGEST_CALL_SECONDS):
                answered = self._call(step, findings)
            if len(self.interrupter.interrupted) > before:
                findings.injected += 1
                quiet = 0
                if not after_interruption():
                    return
            elif answered is False:
                time.sleep(0.01)  # servers backed off after a failure: soon taken back
            else:
                quiet += 1
            now = time.monotonic()
            if answered:
                answered_at = now
                interrupted_when_answered = len(self.interrupter.interrupted)
            elif answered is False and now - answered_at > LONGEST_SILENCE_SECONDS:
                last = self.interrupter.interrupted[max(0, interrupted_when_answered - 3) :]
                findings.stopped_answering.append(
                    f"the servers answered no call for {LONGEST_SILENCE_SECONDS}s; the last "
                    f"lines interrupted before that: {last}"
                )
                return

    def _call(self, step: Callable[[], bool | None], findings: Findings) -> bool | None:
        """Run ``step`` traced: whether the servers answered it (an interrupted call counts as
        answered; None: the step asks the servers nothing)."""
        self.interrupter.install()
        self.interrupter.armed = True
        try:
            return step()
        except Injected:
            return True
        except QuorumUnavailable as error:
            findings.misrouted += [reason for reason in error.reasons if MISROUTED in reason]
            return False
        except Exception as error:
            findings.unexpected.append(f"{step.__name__} raised {error!r}")
            return True
        finally:
            self.interrupter.remove()

    def _steps(self) -> Iterator[Callable[[], bool | None]]:
        steps: list[Callable[[], bool | None]] = [
            self._attempt,
            self._extend,
            self._holder_of,
            self._release,
            self._attempt_waiting,
            self._attempt_and_release_without_confirming,
            self._release,
        ]
        for cycle in itertools.count():
            yield from steps
            yield self._cut if cycle % CUT_EVERY == 0 else self._close

    def _resource(self) -> str:
        return self.rng.choice(self.resources)

    def _held(self) -> Lock | None:
        """The lock taken last (one about to expire is dropped), taken now, not interrupted, when
        none is held; None when the client cannot take one."""
        while self.held and self.held[-1].remaining() < TTL / 2:
            self.held.pop()
        if not self.held:
            self.interrupter.armed = False
            outcome = self.redlock.attempt(self._resource(), TTL, rounds=1)
            self.interrupter.armed = True
            if isinstance(outcome, Acquired):
                self.held.append(outcome.lock)
        return self.held[-1] if self.held else None

    def _attempted(self, outcome: object) -> bool:
        """Keep the lock ``outcome`` took; whether the servers answered."""
        if isinstance(outcome, Acquired):
            self.held.append(outcome.lock)
        return not isinstance(outcome, Unavailable)

    def _attempt(self) -> bool:
        return self._attempted(self.redlock.attempt(self._resource(), TTL, rounds=1))

    def _attempt_waiting(self) -> bool:
        # On the lock held: the caller subscribes to its release and waits for it.
        lock = self._held()
        resource = lock.resource if lock is not None else self._resource()
        return self._attempted(self.redlock.attempt(resource, TTL, wait=0.02, rounds=1))

    def _attempt_and_release_without_confirming(self) -> bool:
        outcome = self.redlock.attempt(self._resource(), TTL, rounds=1)
        if isinstance(outcome, Acquired):
            self.redlock.release(outcome.lock, confirm=False)
        return not isinstance(outcome, Unavailable)

    def _extend(self) -> bool:
        lock = self._held()
        if lock is None:
            return False
        self.redlock.extend(lock)  # False when the servers were unavailable, too
        return True

    def _release(self) -> bool:
        lock = self._held()
        if lock is None:
            return False
        self.held.remove(lock)
        self.redlock.release(lock)
        return True

    def _holder_of(self) -> bool:
        self.redlock.holder_of(self._resource())
        return True

    def _close(self) -> None:
        self.redlock.close()

    def _cut(self) -> None:
        self.interrupter.armed = False
        cut_connections(self.servers)


# -- the contention ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hold:
    """One lock held: by whom, with which fencing token, and when it was surely held (from the
    grant's return to the release's call, cut at the end of its validity)."""

    resource: str
    holder: str
    fencing_token: int
    start: float
    end: float


class Contention:
    """Threads of several clients that take, check, hold and release a few locks until `stop_in`
    says when to stop. Until `stop_in` is called they are in a hurry (the interruption phase
    waits for their attempts): they neither wait for a lock, nor retry, nor sleep."""

    def __init__(self, servers: RedisNodes, resources: list[str]) -> None:
        self.servers = servers
        self.resources = resources
        self.until = math.inf
        self.threads: list[threading.Thread] = []
        self.begun: dict[str, int] = {}  # attempts each thread began
        self.finished: dict[str, int] = {}  # attempts each thread finished
        self.holds: list[Hold] = []
        self.wrong_grants: list[str] = []
        self.misrouted: list[str] = []
        self.errors: list[str] = []
        self.unverified = 0

    def start(self, redlock: Redlock, holder: str) -> None:
        """Start a thread named ``holder`` that contends with ``redlock``."""
        self.begun[holder] = self.finished[holder] = 0
        thread = threading.Thread(target=self.run, args=(redlock, holder), name=holder)
        thread.daemon = True  # a thread that hangs (the failure looked for) must not hang pytest
        self.threads.append(thread)
        thread.start()

    def stop_in(self, seconds: float) -> None:
        """Have every thread stop ``seconds`` from now."""
        self.until = time.monotonic() + seconds

    def attempted(self, holders: list[str], timeout: float) -> bool:
        """Wait until each of the threads ``holders`` has finished an attempt begun after this
        call, up to ``timeout`` seconds; whether they did."""
        deadline = time.monotonic() + timeout
        wanted = {holder: self.begun[holder] + 1 for holder in holders}
        while any(self.finished[holder] < count for holder, count in wanted.items()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def join(self, timeout: float) -> list[str]:
        """Wait for every thread, up to ``timeout`` seconds: the names and stacks of those still
        running then (hung)."""
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [thread.name for thread in self.threads if thread.is_alive()]
        if not hung:
            return []
        return [
            f"threads {hung} still ran {timeout:.0f}s after being told to stop:\n{every_stack()}"
        ]

    def run(self, redlock: Redlock, holder: str) -> None:
        """One thread's loop: attempt a lock (now and then waiting for it), and when granted
        check it on the servers, hold it a moment (now and then extending it) and release it."""
        rng = random.Random(holder)
        clients = [
            server.client(socket_timeout=2, decode_responses=True, client_name=CHECKER)
            for server in self.servers
        ]
        try:
            while time.monotonic() < self.until:
                leisurely = self.until < math.inf
                waits = leisurely and rng.random() < 0.3
                self.begun[holder] += 1
                try:
                    outcome = redlock.attempt(
                        rng.choice(self.resources),
                        TTL,
                        holder,
                        wait=0.2 if waits else 0.0,
                        rounds=None if leisurely else 1,
                    )
                    self.misrouted += misrouted_in(outcome)
                    if isinstance(outcome, Acquired):
                        self._hold(redlock, outcome.lock, holder, clients, rng, leisurely)
                    elif leisurely:
                        time.sleep(rng.uniform(0, 0.01))
                except Exception as error:
                    self.errors.append(f"{holder}: {error!r}")
                    time.sleep(0.05)
                self.finished[holder] += 1
        finally:
            for client in clients:
                client.close()

    def _hold(
        self,
        redlock: Redlock,
        lock: Lock,
        holder: str,
        clients: list[redis.Redis],
        rng: random.Random,
        leisurely: bool,
    ) -> None:
        """Check ``lock`` on the servers, hold it (a few milliseconds when ``leisurely``), now
        and then extend it, and release it."""
        start = time.monotonic()
        key = redlock.key_for(lock.resource)
        stored = [client.get(key) for client in clients]
        if time.monotonic() >= lock.valid_until:
            self.unverified += 1  # the servers may have let it expire meanwhile
        elif stored.count(lock.value) < len(clients) // 2 + 1:
            self.wrong_grants.append(
                f"{holder} was granted {lock.resource} (fencing token {lock.fencing_token}) "
                f"while the servers hold {stored}"
            )
        longest = 0.005 if leisurely else 0.0
        time.sleep(rng.uniform(0, longest))
        if rng.random() < 0.3:
            redlock.extend(lock)
            time.sleep(rng.uniform(0, longest))
        end = min(time.monotonic(), lock.valid_until)
        self.holds.append(Hold(lock.resource, holder, lock.fencing_token, start, end))
        redlock.release(lock)

    def overlaps(self) -> list[str]:
        """Every hold of a lock that began before an earlier hold of it ended."""
        found: list[str] = []
        for resource in self.resources:
            latest: Hold | None = None
            for hold in sorted(
                (hold for hold in self.holds if hold.resource == resource),
                key=lambda hold: hold.start,
            ):
                if latest is not None and hold.start < latest.end:
                    found.append(
                        f"{resource}: {hold.holder} (fencing token {hold.fencing_token}) from "
                        f"{hold.start:.4f}, while {latest.holder} (fencing token "
                        f"{latest.fencing_token}) held it until {latest.end:.4f}"
                    )
                if latest is None or hold.end > latest.end:
                    latest = hold
        return found


# -- afterwards ------------------------------------------------------------------------------------


def wrong_answers(redlock: Redlock, servers: RedisNodes, resource: str) -> list[str]:
    """Take, read and release the lock on ``resource`` with ``redlock``: what went wrong. Every
    server must hold the lock (one backed off after a failure is given a few seconds to be taken
    back), `holder_of` must name its owner, and the release must free it."""
    owner = "the check afterwards"
    key = redlock.key_for(resource)
    deadline = time.monotonic() + 5
    while True:
        outcome = redlock.attempt(resource, 5.0, owner, wait=3.0)
        if not isinstance(outcome, Acquired):
            return [f"{resource}: {outcome}"]
        lock = outcome.lock
        stored = [value_on(server, key) for server in servers]
        if stored.count(lock.value) == len(stored) or time.monotonic() > deadline:
            break
        redlock.release(lock)
        time.sleep(0.1)
    wrong: list[str] = []
    if stored.count(lock.value) != len(stored):
        wrong.append(f"{resource}: granted to {lock.value!r}, but the servers hold {stored}")
    held = redlock.holder_of(resource)
    if held is None or held.holder != owner:
        wrong.append(f"{resource}: taken by {owner!r}, but holder_of says {held}")
    if not redlock.release(lock):
        wrong.append(f"{resource}: its release was not confirmed")
    held = redlock.holder_of(resource)
    if held is not None:
        wrong.append(f"{resource}: released, but holder_of says {held}")
    return wrong


def value_on(server: Any, key: str) -> str | None:
    """The value of ``key`` on ``server`` (a `RedisServer`)."""
    with server.client(socket_timeout=2, decode_responses=True) as client:
        value: str | None = client.get(key)
        return value


def close_within(redlock: Redlock, seconds: float) -> None:
    """Close ``redlock``'s connections, unless a lock left held blocks that (a failure): then they
    are left."""
    closing = threading.Thread(target=redlock.close, daemon=True)
    closing.start()
    closing.join(seconds)


# -- the test --------------------------------------------------------------------------------------


def interrupt_then_contend(servers: RedisNodes, findings: Findings) -> None:
    """The interruption phase, with the first contending threads running; then the whole
    contention (unless something hung); then the check of the interrupted client's connections.
    What went wrong goes to ``findings``."""
    prefix = secrets.token_hex(4)
    interrupted = Redlock(servers.urls, node_timeout=NODE_TIMEOUT, retry_delay=0.01)
    independent = Redlock(servers.urls, node_timeout=NODE_TIMEOUT, retry_delay=0.01)
    clients = {"interrupted": interrupted, "independent": independent}
    resources = [f"{prefix}:contended:{number}" for number in range(RESOURCE_COUNT)]
    contention = Contention(servers, resources)
    watchdog = Watchdog()
    try:
        for name, redlock in clients.items():
            for number in range(EARLY_THREADS_PER_CLIENT):
                contention.start(redlock, f"{name} {number}")
        early = [f"interrupted {number}" for number in range(EARLY_THREADS_PER_CLIENT)]
        interruptions = Interruptions(interrupted, servers, prefix)

        def let_the_others_call() -> bool:
            # What the interruption broke meets the client's other threads before the next call
            # of the main thread can mend it (by reconnecting).
            if contention.attempted(early, LONGEST_CALL_SECONDS):
                return True
            findings.hung.append(
                f"the contending threads made no attempt for {LONGEST_CALL_SECONDS}s after the "
                f"lines {interruptions.interrupter.interrupted[-3:]} were interrupted; every "
                f"thread then:\n{every_stack()}"
            )
            return False

        try:
            interruptions.run(findings, watchdog, let_the_others_call)
        except Hung as hung:
            findings.hung.append(
                f"a call hung after the lines {interruptions.interrupter.interrupted[-3:]} were "
                f"interrupted; every thread then:\n{hung}"
            )
        if findings.hung:
            return
        for lock in interruptions.held:
            interrupted.release(lock)

        contention.stop_in(CONTENTION_SECONDS)
        for name, redlock in clients.items():
            for number in range(EARLY_THREADS_PER_CLIENT, THREADS_PER_CLIENT):
                contention.start(redlock, f"{name} {number}")
        findings.hung += contention.join(CONTENTION_SECONDS + HANG_GRACE_SECONDS)
        if findings.hung:
            return

        try:
            with watchdog.watching(LONGEST_CALL_SECONDS):
                for resource in resources:
                    findings.wrong_afterwards += wrong_answers(interrupted, servers, resource)
        except Hung as hung:
            findings.hung.append(f"the check afterwards hung; every thread then:\n{hung}")
    finally:
        contention.stop_in(0)
        if not findings.hung:
            contention.join(HANG_GRACE_SECONDS)
        findings.holds = len(contention.holds)
        findings.unverified = contention.unverified
        findings.wrong_grants = contention.wrong_grants
        findings.overlaps = contention.overlaps()
        findings.misrouted += contention.misrouted
        findings.contention_errors = contention.errors
        watchdog.close()
        close_within(interrupted, 5)
        close_within(independent, 5)


def test_a_client_interrupted_at_every_line_keeps_locking_correctly(
    three_nodes: RedisNodes,
) -> None:
    findings = Findings()
    with unraisables_noted(findings), misrouted_replies_noted(findings):
        interrupt_then_contend(three_nodes, findings)
        gc.collect()  # the clients' sockets, closed or not, while unraisables are noted
    print(f"\n{findings.summary()}")
    problems = findings.problems()
    assert problems == [], "\n".join(problems)
