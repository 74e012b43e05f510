"""Lock throughput, memory and clean-up while one node of three is down (issue 37).

Run from the repository root::

    python benchmarks/bench_outage.py                                  # defaults: about 3 min
    python benchmarks/bench_outage.py --before 3 --outage 10 --after 3  # a quick look
    python benchmarks/bench_outage.py --fault hang --threads 8
    python benchmarks/bench_outage.py --fault none    # a control: the same phases, nothing down
    PYTHONPATH=/tmp/before python benchmarks/bench_outage.py           # another copy of the code

Issue 37's promise: one node of three stopped for 60 s, 4 threads: calls/s during the outage at
least 0.8x the all-up rate; the process grows less than 5 MB; within 1 s of the node's return
every released lock is gone from it. The same with the node hung (SIGSTOP) instead of stopped.

For each fault (``--fault stop``, ``--fault hang``, or both, the default, one after the other),
three fresh ``redis-server`` processes are started on free ports of 127.0.0.1 through
``celery_redlock.testing`` (never a Redis you already run), with an append-only file, and
stopped at the end, also on Ctrl-C, SIGTERM and errors. One ``Redlock`` over the three (public
API only: ``Redlock(urls, node_timeout=...)``, ``acquire(name, ttl=...)``, ``release(lock)``) is
shared by ``--threads`` threads, each acquiring then releasing lock names nobody else uses, in a
loop, through three phases:

* **all up** (``--before`` seconds, after ``--warmup`` seconds not counted);
* **outage** (``--outage`` seconds): the third node is stopped (``stop``: SIGTERM, a clean
  shutdown that writes its append-only file, then started again on the same port, its data
  back) or hung (``hang``: SIGSTOP, then SIGCONT); or nothing happens to it (``--fault none``,
  a control: what the same phases show with every node up). The phase ends when the node serves
  again (answers and has loaded its data): the return;
* **after return** (``--after`` seconds, at least 1).

A pair counts only when the lock was acquired and its release returned True (a majority, two of
three, confirmed it); anything else is a failure, counted by kind, never as throughput. Pairs are
counted per ``--window``-second window of each phase; a phase's rate is the median over its
windows (a last window shorter than half a window is shown but left out of the median).

Measured and checked:

* **calls/s**: the outage's median window rate against the all-up one: PASS at 0.8x or more;
* **memory**: the process's resident size (``VmRSS`` of ``/proc/self/status``) when the fault
  begins and when the node returns: PASS if it grew by less than 5 MB (10^6 bytes);
* **clean-up**: the lock keys still on the returned node of calls that had finished before it
  returned (every lock released by then; their releases could not reach it), counted by ``SCAN``
  right at the return, 1 s after it (PASS if none) and every second of the after phase, while the
  threads go on; then, once every thread has stopped, the lock keys left on each node.

Also shown: the seconds each phase took, the slowest call and the calls over 1 s per phase (a
stuck call shows there), the machine and the versions. The report is Markdown on standard
output (``--json PATH`` also writes the numbers); progress goes to standard error. It always
exits 0: it is a report, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmark_support import (
    PRODUCTION_SERVER,
    cpu_model,
    interrupt_on_sigterm,
    quiet_logging,
    server_version,
)

FAULTS = ("stop", "hang")
CONTROL = "none"  # no fault: the same phases with every node up, to judge the others by
NODES = 3
FAULTY_NODE = 2  # the index of the node that goes down
RESOURCE_PREFIX = "outage-bench"
OK = "ok"
RATE_GOAL = 0.8  # outage calls/s against all-up calls/s, at least
MEMORY_GOAL_BYTES = 5_000_000  # growth over the outage, less than
CLEANUP_SECONDS = 1.0  # after the node's return, no released lock's key is left on it
SLOW_CALL_SECONDS = 1.0  # a pair slower than this is counted as slow
JOIN_TIMEOUT = 30.0  # seconds a thread may take to finish its last pair
PHASES = ("warm-up", "all up", "outage", "after return")
# A resource of this benchmark, and what follows it in a key: "}" for the lock key,
# "}:fence" for its fencing counter, nothing for the 0.2-layout key, "}:pending" a reservation.
KEY_PATTERN = re.compile(rf"{RESOURCE_PREFIX}:[a-z]+:(\d+):(\d+)(.*)$")
PERSISTENT_SERVER = ("--appendonly", "yes", "--appendfsync", "everysec")


# -- the threads -----------------------------------------------------------------------------


@dataclass
class Tally:
    """What one thread saw, phase by phase: pairs per window, failures by kind, its slowest
    pair and the pairs slower than `SLOW_CALL_SECONDS`. Written by its thread only."""

    pairs: Counter[tuple[str, int]] = field(default_factory=Counter)  # (phase, window) -> pairs
    failures: dict[str, Counter[str]] = field(default_factory=dict)
    slowest: dict[str, float] = field(default_factory=dict)
    slow: Counter[str] = field(default_factory=Counter)


class Clock:
    """The current phase and when it began, read by every thread at the end of each pair."""

    def __init__(self, window_seconds: float) -> None:
        self.window_seconds = window_seconds
        self.current: tuple[str, float] = (PHASES[0], time.monotonic())  # replaced whole

    def enter(self, phase: str) -> float:
        """Begin ``phase`` now; return when."""
        now = time.monotonic()
        self.current = (phase, now)
        return now

    def where(self, now: float) -> tuple[str, int]:
        """The phase and window index of a pair ending at ``now``."""
        phase, began = self.current
        return phase, max(0, int((now - began) // self.window_seconds))


class LockThreads:
    """``count`` threads sharing one lock manager, each acquiring and releasing names of its
    own (``<prefix>:<fault>:<thread>:<call>``, calls numbered from 0) until `stop`."""

    def __init__(self, manager: Any, count: int, fault: str, ttl: float, clock: Clock) -> None:
        self._manager = manager
        self._fault = fault
        self._ttl = ttl
        self._clock = clock
        self._stopping = threading.Event()
        self.tallies = [Tally() for _ in range(count)]
        # The number of calls each thread has finished: every name below it is released.
        self.finished = [0] * count
        self.errors: list[str] = []  # exceptions that ended a thread (none expected)
        self._threads = [
            threading.Thread(target=self._work, args=(index,), name=f"outage-{index}", daemon=True)
            for index in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self, index: int) -> None:
        tally = self.tallies[index]
        call = 0
        try:
            while not self._stopping.is_set():
                name = f"{RESOURCE_PREFIX}:{self._fault}:{index}:{call}"
                started = time.monotonic()
                outcome = self._pair(name)
                ended = time.monotonic()
                phase, window = self._clock.where(ended)
                if outcome == OK:
                    tally.pairs[(phase, window)] += 1
                else:
                    tally.failures.setdefault(phase, Counter())[outcome] += 1
                took = ended - started
                if took > tally.slowest.get(phase, 0.0):
                    tally.slowest[phase] = took
                if took > SLOW_CALL_SECONDS:
                    tally.slow[phase] += 1
                call += 1
                self.finished[index] = call
        except BaseException as error:  # counted in the report: a thread must never die quietly
            self.errors.append(f"thread {index}: {type(error).__name__}: {error}")

    def _pair(self, name: str) -> str:
        """One acquire + release; its outcome, an exception being an outcome too."""
        try:
            lock = self._manager.acquire(name, ttl=self._ttl)
            if lock is None:
                return "not acquired"
            return OK if self._manager.release(lock) else "release not confirmed"
        except Exception as error:
            return f"raised {type(error).__name__}"

    def stop(self) -> list[str]:
        """Let every thread finish its pair and end; the names of those still running after
        `JOIN_TIMEOUT` seconds (stuck)."""
        self._stopping.set()
        deadline = time.monotonic() + JOIN_TIMEOUT
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return [thread.name for thread in self._threads if thread.is_alive()]


# -- measuring -------------------------------------------------------------------------------


def resident_bytes() -> int | None:
    """This process's resident set size (``VmRSS``), None where /proc cannot tell."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def lock_keys(client: Any, finished: list[int] | None = None) -> int:
    """The lock keys of this benchmark on a node (lock, 0.2-layout and reservation keys; not
    fencing counters), by ``SCAN``; with ``finished``, only those of calls numbered below it."""
    count = 0
    for raw in client.scan_iter(match=f"*{RESOURCE_PREFIX}:*", count=1000):
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        match = KEY_PATTERN.search(key)
        if match is None or match.group(3).endswith(":fence"):
            continue
        thread, call = int(match.group(1)), int(match.group(2))
        if finished is None or (thread < len(finished) and call < finished[thread]):
            count += 1
    return count


def wait_until_loaded(client: Any, timeout: float = 60.0) -> None:
    """Wait until the node has loaded its data (it answers ``INFO`` while loading, and refuses
    data commands); `TimeoutError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while str(client.info("persistence").get("loading", 0)) != "0":
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the node was still loading its data after {timeout:g} s")
        time.sleep(0.005)


@dataclass
class Window:
    """One window of a phase: when it began (seconds into the phase), how long it lasted, the
    pairs in it."""

    began: float
    seconds: float
    pairs: int

    @property
    def rate(self) -> float:
        """Pairs per second."""
        return self.pairs / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Phase:
    """One measured phase: its seconds, windows, failures, slowest pair, slow pairs."""

    name: str
    seconds: float
    windows: list[Window]
    failures: dict[str, int]
    slowest: float
    slow: int
    window_seconds: float

    @property
    def pairs(self) -> int:
        """Successful pairs in the whole phase."""
        return sum(window.pairs for window in self.windows)

    @property
    def rate(self) -> float:
        """Successful pairs per second over the whole phase."""
        return self.pairs / self.seconds if self.seconds > 0 else 0.0

    def counted(self, window: Window) -> bool:
        """Whether ``window`` enters the median: at least half a window long (or the only one)."""
        return window.seconds >= self.window_seconds / 2 or len(self.windows) == 1

    @property
    def median_rate(self) -> float:
        """The median pairs/s over the phase's counted windows."""
        rates = [window.rate for window in self.windows if self.counted(window)]
        return statistics.median(rates) if rates else 0.0


@dataclass
class Scenario:
    """One fault's run: its phases, the memory, the clean-up checks, what went wrong."""

    fault: str
    phases: list[Phase] = field(default_factory=list)
    fault_seconds: float = 0.0  # applying the fault (a stop waits for the exit)
    return_seconds: float = 0.0  # bringing the node back until it answers
    resident_at_fault: int | None = None
    resident_at_return: int | None = None
    resident_at_end: int | None = None
    released_before_return: int = 0  # calls finished before the node returned
    leftovers: list[tuple[float, int]] = field(default_factory=list)  # (s after return, keys)
    keys_at_end: list[int] = field(default_factory=list)  # per node, every thread stopped
    stuck_threads: list[str] = field(default_factory=list)
    thread_errors: list[str] = field(default_factory=list)
    error: str = ""  # the exception that ended the run early, if one did

    def phase(self, name: str) -> Phase | None:
        """The phase called ``name``, if it was measured."""
        return next((phase for phase in self.phases if phase.name == name), None)

    @property
    def rate_ratio(self) -> float | None:
        """The outage's median window rate over the all-up one."""
        up, outage = self.phase("all up"), self.phase("outage")
        if up is None or outage is None or not up.median_rate:
            return None
        return outage.median_rate / up.median_rate

    @property
    def growth(self) -> int | None:
        """Bytes the process grew by over the outage."""
        if self.resident_at_fault is None or self.resident_at_return is None:
            return None
        return self.resident_at_return - self.resident_at_fault

    def leftovers_at(self, seconds: float) -> int | None:
        """Leftover keys at the first check at least ``seconds`` after the return."""
        return next((keys for at, keys in self.leftovers if at >= seconds), None)

    @property
    def gone_after(self) -> float | None:
        """When a check first found no leftover key (seconds after the return)."""
        return next((at for at, keys in self.leftovers if keys == 0), None)


def collect_phases(
    threads: LockThreads, bounds: dict[str, tuple[float, float]], window_seconds: float
) -> list[Phase]:
    """Every measured phase from the threads' tallies and the phases' (start, end) times."""
    phases = []
    for name in PHASES[1:]:
        if name not in bounds:
            continue
        began, ended = bounds[name]
        seconds = ended - began
        pairs: Counter[int] = Counter()
        failures: Counter[str] = Counter()
        slowest, slow = 0.0, 0
        for tally in threads.tallies:
            for (phase, window), count in tally.pairs.items():
                if phase == name:
                    pairs[window] += count
            failures.update(tally.failures.get(name, Counter()))
            slowest = max(slowest, tally.slowest.get(name, 0.0))
            slow += tally.slow[name]
        last = max([*pairs, max(0, int(seconds // window_seconds - 1e-9))])
        windows = []
        for index in range(last + 1):
            start = index * window_seconds
            length = max(0.0, min(window_seconds, seconds - start))
            windows.append(Window(start, length, pairs[index]))
        phases.append(Phase(name, seconds, windows, dict(failures), slowest, slow, window_seconds))
    return phases


def progress(began: float, text: str) -> None:
    """A progress line on standard error."""
    print(f"  [{time.monotonic() - began:6.1f} s] {text}", file=sys.stderr, flush=True)


def sleep_until(moment: float) -> None:
    """Sleep until the monotonic clock reaches ``moment``."""
    time.sleep(max(0.0, moment - time.monotonic()))


def run_scenario(fault: str, arguments: argparse.Namespace, began: float) -> Scenario:
    """Three fresh nodes, the threads, the three phases with ``fault`` on the third node; the
    nodes are stopped at the end, also on errors."""
    from celery_redlock import Redlock
    from celery_redlock.testing import RedisServer, ServerGroup

    scenario = Scenario(fault)
    clock = Clock(arguments.window)
    bounds: dict[str, tuple[float, float]] = {}
    threads: LockThreads | None = None
    with contextlib.ExitStack() as stack:
        data = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-outage-")))
        servers = []
        for index in range(NODES):
            directory = data / f"node{index}"
            directory.mkdir()
            # Later arguments override the harness's: data in a directory that outlives a run.
            extra = (*PRODUCTION_SERVER, *PERSISTENT_SERVER, "--dir", str(directory))
            servers.append(RedisServer(extra_args=extra))
        nodes = stack.enter_context(ServerGroup(servers))
        faulty = nodes[FAULTY_NODE]
        progress(began, f"{fault}: started {NODES} redis-server nodes: {nodes.urls}")
        options = {} if arguments.node_timeout is None else {"node_timeout": arguments.node_timeout}
        manager = Redlock(nodes.urls, **options)
        stack.callback(manager.close)
        try:
            threads = LockThreads(manager, arguments.threads, fault, arguments.ttl, clock)
            time.sleep(arguments.warmup)

            start = clock.enter("all up")
            sleep_until(start + arguments.before)

            scenario.resident_at_fault = resident_bytes()
            outage_start = clock.enter("outage")
            bounds["all up"] = (start, outage_start)
            if fault == "stop":
                faulty.stop()
            elif fault == "hang":
                faulty.pause()
            scenario.fault_seconds = time.monotonic() - outage_start
            progress(began, f"{fault}: outage phase begins")
            sleep_until(outage_start + arguments.outage)

            scenario.resident_at_return = resident_bytes()
            bringing_back = time.monotonic()
            if fault == "stop":
                faulty.start()  # the same port, its data back from the append-only file
            elif fault == "hang":
                faulty.resume()
            observer = stack.enter_context(faulty.client(socket_timeout=10.0))
            wait_until_loaded(observer)
            returned = clock.enter("after return")
            scenario.return_seconds = returned - bringing_back
            bounds["outage"] = (outage_start, returned)
            finished = list(threads.finished)
            scenario.released_before_return = sum(finished)
            progress(began, f"{fault}: node {FAULTY_NODE + 1} serves again")
            check = 0.0
            while check <= arguments.after:
                sleep_until(returned + check)
                at = time.monotonic() - returned
                scenario.leftovers.append((at, lock_keys(observer, finished)))
                check = CLEANUP_SECONDS if check < CLEANUP_SECONDS else check + 1.0
            sleep_until(returned + arguments.after)
            bounds["after return"] = (returned, time.monotonic())
        except Exception as error:
            scenario.error = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        finally:
            if threads is not None:
                scenario.stuck_threads = threads.stop()
                scenario.thread_errors = list(threads.errors)
                scenario.phases = collect_phases(threads, bounds, arguments.window)
        scenario.resident_at_end = resident_bytes()
        if not scenario.error:
            for server in nodes:
                with server.client(socket_timeout=10.0) as client:
                    scenario.keys_at_end.append(lock_keys(client))
    return scenario


# -- the report ------------------------------------------------------------------------------


def verdict(passed: bool | None) -> str:
    """PASS, MISS, or n/a when it could not be measured."""
    return "n/a" if passed is None else ("PASS" if passed else "MISS")


def megabytes(value: int | None) -> str:
    """Bytes as MB (10^6 bytes), signed; "?" when unknown."""
    return "?" if value is None else f"{value / 1e6:+.2f} MB"


def describe_fault(fault: str) -> str:
    """What the fault does to the node, for a heading."""
    if fault == CONTROL:
        return "left up (no fault: the control)"
    if fault == "stop":
        return "stopped (SIGTERM, clean shutdown), started again on the same port with its data"
    return "hung (SIGSTOP), then continued (SIGCONT)"


def scenario_markdown(scenario: Scenario, arguments: argparse.Namespace) -> list[str]:
    """One fault's tables and goals."""
    lines = [
        f"## Node {FAULTY_NODE + 1} of {NODES} {describe_fault(scenario.fault)}: "
        f"`--fault {scenario.fault}`",
        "",
        f"Applying the fault took {scenario.fault_seconds:.2f} s, bringing the node back "
        f"{scenario.return_seconds:.2f} s (until it served its data again: the return).",
        "",
        "| phase | seconds | pairs | pairs/s (whole phase) | pairs/s (median of windows) "
        "| failures | slowest pair | pairs > 1 s |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for phase in scenario.phases:
        failures = ", ".join(f"{kind} x{count}" for kind, count in sorted(phase.failures.items()))
        lines.append(
            f"| {phase.name} | {phase.seconds:.1f} | {phase.pairs:,} | {phase.rate:,.0f} "
            f"| {phase.median_rate:,.0f} | {failures or 'none'} | {phase.slowest * 1000:,.0f} ms "
            f"| {phase.slow} |"
        )
    lines += [
        "",
        f"Per {arguments.window:g}-s window (a window marked * is under half a window long and "
        "left out of the median):",
        "",
        "| phase | from s | seconds | pairs/s |",
        "|---|---:|---:|---:|",
    ]
    for phase in scenario.phases:
        for window in phase.windows:
            mark = "" if phase.counted(window) else " *"
            lines.append(
                f"| {phase.name} | {window.began:.0f} | {window.seconds:.1f} "
                f"| {window.rate:,.0f}{mark} |"
            )
    ratio = scenario.rate_ratio
    up, outage = scenario.phase("all up"), scenario.phase("outage")
    growth = scenario.growth
    at_check = scenario.leftovers_at(CLEANUP_SECONDS)
    at_return = scenario.leftovers[0][1] if scenario.leftovers else None
    gone = scenario.gone_after
    gone_text = (
        f"none left from {gone:.1f} s after the return"
        if gone is not None
        else f"still {scenario.leftovers[-1][1]} at {scenario.leftovers[-1][0]:.1f} s"
        if scenario.leftovers
        else "not checked"
    )
    lines += [
        "",
        "Goals (issue 37):",
        "",
        f"- {verdict(None if ratio is None else ratio >= RATE_GOAL)}: calls/s during the outage "
        f">= {RATE_GOAL}x all up (median of windows: "
        f"{outage.median_rate if outage else 0:,.0f} against {up.median_rate if up else 0:,.0f}"
        f" = {'?' if ratio is None else f'{ratio:.2f}'}x)",
        f"- {verdict(None if growth is None else growth < MEMORY_GOAL_BYTES)}: the process grew "
        f"< 5 MB over the outage (VmRSS {megabytes(scenario.resident_at_fault)[1:]} at the fault, "
        f"{megabytes(scenario.resident_at_return)[1:]} at the return: {megabytes(growth)}; "
        f"{megabytes(scenario.resident_at_end)[1:]} at the end)",
        f"- {verdict(None if at_check is None else at_check == 0)}: {CLEANUP_SECONDS:g} s after "
        f"the return, no key on the returned node of the {scenario.released_before_return:,} "
        f"calls finished before it returned ({at_check if at_check is not None else '?'} left; "
        f"{at_return if at_return is not None else '?'} right at the return; {gone_text})",
        "",
        "Checks of the returned node (seconds after the return: leftover keys): "
        + ", ".join(f"{at:.1f}: {keys}" for at, keys in scenario.leftovers),
        "",
        "Lock keys on each node once every thread had stopped: "
        + (", ".join(str(keys) for keys in scenario.keys_at_end) or "not counted"),
    ]
    problems = []
    if scenario.error:
        problems.append(f"the run ended early: {scenario.error}")
    if scenario.stuck_threads:
        problems.append(
            f"threads still in a call {JOIN_TIMEOUT:.0f} s after being told to stop: "
            f"{', '.join(scenario.stuck_threads)}"
        )
    problems += [f"a thread died: {error}" for error in scenario.thread_errors]
    if problems:
        lines += ["", *(f"WARNING: {problem}" for problem in problems)]
    return lines


def markdown(
    scenarios: list[Scenario], arguments: argparse.Namespace, facts: dict[str, str]
) -> str:
    """The whole report."""
    timeout = (
        "the library's default"
        if arguments.node_timeout is None
        else f"{arguments.node_timeout * 1000:g} ms"
    )
    lines = [
        f"# One node of {NODES} down for {arguments.outage:g} s, {arguments.threads} threads",
        "",
        f"Phases: {arguments.warmup:g} s warm-up (not counted), {arguments.before:g} s all up, "
        f"{arguments.outage:g} s outage, {arguments.after:g} s after the return. Lock ttl "
        f"{arguments.ttl:g} s, node_timeout {timeout}; every pair a name nobody else uses; a "
        "pair counts when acquired and its release returned True.",
    ]
    for scenario in scenarios:
        lines += ["", *scenario_markdown(scenario, arguments)]
    lines += [
        "",
        f"Machine: {facts['cpu']}, {facts['cpus']} CPUs, load average {facts['load_before']} "
        f"before, {facts['load_after']} after; the nodes share those CPUs with the threads. "
        f"Python {facts['python']} ({facts['implementation']}), {facts['redis_server']}, "
        f"redis-py {facts['redis-py']}; celery_redlock from {facts['source']}. "
        f"Took {facts['took']}.",
    ]
    return "\n".join(lines)


def machine_facts() -> dict[str, str]:
    """The machine and versions, for the report."""
    import celery_redlock
    from celery_redlock.testing import find_redis_server

    return {
        "cpu": cpu_model(),
        "cpus": str(os.cpu_count()),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "redis_server": server_version(find_redis_server()),
        "redis-py": importlib.metadata.version("redis"),
        "source": os.path.dirname(os.path.abspath(str(celery_redlock.__file__))),
        "load_before": f"{os.getloadavg()[0]:.1f}",
    }


# -- main ------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--fault",
        choices=(*FAULTS, "both", CONTROL),
        default="both",
        help=f"how the node goes down; {CONTROL}: it does not (a control run)",
    )
    parser.add_argument("--threads", type=int, default=4, help="threads sharing the lock manager")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds not counted first")
    parser.add_argument("--before", type=float, default=10.0, help="seconds all up")
    parser.add_argument("--outage", type=float, default=60.0, help="seconds the node is down")
    parser.add_argument(
        "--after", type=float, default=10.0, help="seconds after the node's return (at least 1)"
    )
    parser.add_argument("--window", type=float, default=5.0, help="seconds per counting window")
    parser.add_argument("--ttl", type=float, default=600.0, help="every lock's ttl in seconds")
    parser.add_argument(
        "--node-timeout",
        type=float,
        default=None,
        help="Redlock(node_timeout=...) in seconds (default: the library's)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show the library's log messages on stderr"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    arguments = parser.parse_args(argv)
    if arguments.threads < 1:
        parser.error("--threads must be at least 1")
    if min(arguments.before, arguments.outage, arguments.window, arguments.ttl) <= 0:
        parser.error("--before, --outage, --window and --ttl must be positive")
    if arguments.warmup < 0 or arguments.after < CLEANUP_SECONDS:
        parser.error(f"--warmup must be >= 0 and --after >= {CLEANUP_SECONDS:g}")
    return arguments


def main(argv: list[str] | None = None) -> int:
    """Run every chosen fault and print the report; exit 0 unless interrupted."""
    arguments = parse_arguments(argv)
    quiet_logging(arguments.verbose)
    faults = FAULTS if arguments.fault == "both" else (arguments.fault,)
    began = time.monotonic()
    scenarios: list[Scenario] = []
    try:
        facts = machine_facts()
        print(
            f"{facts['cpu']}, {facts['cpus']} CPUs; load {facts['load_before']}; "
            f"{facts['redis_server']}; celery_redlock from {facts['source']}",
            file=sys.stderr,
        )
        with interrupt_on_sigterm():
            for fault in faults:
                scenarios.append(run_scenario(fault, arguments, began))
    except KeyboardInterrupt:
        print("interrupted; the Redis servers were stopped", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print("the benchmark failed (see above); the Redis servers were stopped", file=sys.stderr)
        return 0
    facts["load_after"] = f"{os.getloadavg()[0]:.1f}"
    facts["took"] = f"{time.monotonic() - began:.0f} s"
    print(markdown(scenarios, arguments, facts))
    if arguments.json:
        document = {
            "settings": vars(arguments),
            "machine": facts,
            "scenarios": [
                {
                    **asdict(scenario),
                    "rate_ratio": scenario.rate_ratio,
                    "growth_bytes": scenario.growth,
                }
                for scenario in scenarios
            ],
        }
        Path(arguments.json).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
