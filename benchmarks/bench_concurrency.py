"""Throughput of uncontended locks under concurrency, and the connections it takes.

Run from the repository root::

    python benchmarks/bench_concurrency.py                    # defaults: about two minutes
    python benchmarks/bench_concurrency.py --rounds 3 --seconds 1
    python benchmarks/bench_concurrency.py --variant new=/path/to/celery_redlock
    python benchmarks/bench_concurrency.py --processes 1,2,4,8
    python benchmarks/bench_concurrency.py --json results.json

Five fresh ``redis-server`` processes are started on free ports of 127.0.0.1 through
``celery_redlock.testing`` (never a Redis you already run) and stopped at the end, also on
Ctrl-C, SIGTERM and errors. Measured, for each library below:

* **throughput**: acquire + release per second of distinct, uncontended lock names (every call a
  name nobody else uses), from 1 thread and from 50 threads of this one process. The threads are
  long-lived (like a Celery ``-P threads`` pool): started once, warmed up, then run for
  ``--seconds`` in every round, each thread on its own names;
* **gevent**: a subprocess that monkey-patches first (``from gevent import monkey;
  monkey.patch_all()`` before any other import), then runs 500 greenlets doing the same for
  ``--seconds``; a fresh subprocess in every round;
* **processes** (``--processes N``, or a list: ``--processes 1,2,4,8``): N processes, each with
  the threads it measures (1 and 50) and a client of its own, timed over the same window; a
  row per process count, with the pairs/s of all N together and the CPU time of all N per call.
  Fresh subprocesses in every round: each warms up, then all start their timed run at once;
* **connections**: a subprocess whose 100 threads each use the lock once, and stay alive; then
  ``CLIENT LIST`` on every node, counting the connections whose client end belongs to that
  process (matched through ``/proc``). The gevent subprocesses are counted the same way after
  their timed run, with their 500 greenlets still alive.

Libraries: ``celery_redlock`` ``Redlock`` over 1 and over 5 nodes (public API only:
``Redlock(urls, node_timeout=...)``, ``acquire(name, ttl=...)``, ``release(lock)``), and
redis-py's ``Redis.lock(name, timeout=10)`` (``acquire(blocking=False)`` / ``release()``) through
one ``redis.Redis`` client whose pool every thread (or greenlet) shares: a
``BlockingConnectionPool`` of redis-py's default size, 100 connections, so that 500 greenlets
wait for a free connection instead of failing with ``MaxConnectionsError`` as the default pool
does. Every client gets celery_redlock's default per-node settings: 50 ms socket and connect
timeouts, no redis-py retries.

``--variant LABEL=DIR`` imports another copy of the ``celery_redlock`` package (DIR holds its
``__init__.py``) under another module name and measures it in the same rounds as
``celery_redlock[LABEL]`` (threads, gevent and connections alike): the fair way to compare a
change against the current code.

Fairness: every case runs once per round, in an order rotated every round (and reversed every
other round), so load from elsewhere falls on all alike; tables show the median over rounds and
the min - max. A call counts only when it succeeded (acquired, and the release confirmed);
anything else is counted and shown as a failure, never as throughput.

The report is Markdown: the throughput table, the connections table, and PASS/MISS lines for the
goals of issues 17 and 23 (50 threads >= 2.5x 1 thread with 1 and with 5 nodes; client CPU per
call at 50 threads no more than at 1 thread, with 1 and with 5 nodes; celery_redlock at 50
threads >= 2.5x redis-py's Lock at 50 threads; at most 4 connections per node with 100 live
threads, and with 500 greenlets). It always exits 0: it is a report, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import selectors
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from benchmark_support import (
    PRODUCTION_SERVER,
    cpu_model,
    interrupt_on_sigterm,
    quiet_logging,
    server_version,
    variant_argument,
)

NODE_TIMEOUT = 0.05  # seconds: celery_redlock's default node_timeout, given to every client
LOCK_TTL = 10.0  # seconds
NODES = 5
THREAD_COUNTS = (1, 50)
LIVE_THREADS = 100  # the connections measure: threads that each used the lock once
GREENLETS = 500
CONCURRENCY_GOAL = 2.5  # 50 threads vs 1 thread, and vs redis-py's Lock at 50 threads
CONNECTIONS_GOAL = 4  # connections per node, at most
REDIS_PY = "redis-py Lock"
CELERY_REDLOCK = "celery_redlock"
OK = "ok"
REDIS_PY_POOL_SIZE = 100  # redis-py's default max_connections
CHILD_TIMEOUT = 120.0  # seconds a subprocess may take to report, beyond its timed run
GEVENT_PRELUDE = (
    "from gevent import monkey; monkey.patch_all(); "
    "import os, runpy, sys; sys.argv[0] = {path!r}; sys.path[0] = os.path.dirname({path!r}); "
    "runpy.run_path({path!r}, run_name='__main__')"
)

Operation = Callable[[str], str]
"""One acquire + release of the named lock; returns an outcome (``"ok"``, ``"not acquired"``,
...); may raise."""


# -- the libraries ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Library:
    """A lock implementation to measure: redis-py's Lock, the installed celery_redlock, or a
    copy of celery_redlock in ``package_directory`` (a ``--variant``)."""

    name: str
    package_directory: str | None = None

    @property
    def is_redis_py(self) -> bool:
        """Whether this is redis-py's own Lock (the baseline)."""
        return self.name == REDIS_PY

    def node_counts(self) -> tuple[int, ...]:
        """The node counts this library is measured with: redis-py's Lock has one node."""
        return (1,) if self.is_redis_py else (1, NODES)

    def child_arguments(self) -> list[str]:
        """How a subprocess is told to use this library."""
        arguments = ["--library", self.name]
        if self.package_directory is not None:
            arguments += ["--package-directory", self.package_directory]
        return arguments


def import_celery_redlock(library: Library) -> ModuleType:
    """The celery_redlock package of ``library``: the installed one, or its copy imported under
    another module name so that both run in one process."""
    if library.package_directory is None:
        import celery_redlock

        return celery_redlock
    module_name = "celery_redlock_variant_" + "".join(
        character if character.isalnum() else "_" for character in library.name
    )
    if module_name in sys.modules:
        return sys.modules[module_name]
    init = os.path.join(library.package_directory, "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(f"{library.name}: no __init__.py in {library.package_directory}")
    spec = importlib.util.spec_from_file_location(
        module_name, init, submodule_search_locations=[library.package_directory]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def make_operation(library: Library, urls: Sequence[str]) -> tuple[Operation, str]:
    """One shared lock client of ``library`` on ``urls`` (built once, used by every thread or
    greenlet), as an operation; and where the code it runs comes from."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    if library.is_redis_py:
        (url,) = urls
        # redis-py's default pool size (100), waiting for a free connection rather than raising
        # MaxConnectionsError when 500 greenlets want one at once.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=REDIS_PY_POOL_SIZE,
            timeout=CHILD_TIMEOUT,
            socket_timeout=NODE_TIMEOUT,
            socket_connect_timeout=NODE_TIMEOUT,
            retry=Retry(NoBackoff(), 0),
        )
        client = redis.Redis(connection_pool=pool)

        def redis_py_operation(name: str) -> str:
            lock = client.lock(name, timeout=LOCK_TTL)
            if not lock.acquire(blocking=False):
                return "not acquired"
            lock.release()
            return OK

        return redis_py_operation, f"redis-py {importlib.metadata.version('redis')}"

    package = import_celery_redlock(library)
    manager = package.Redlock(list(urls), node_timeout=NODE_TIMEOUT)

    def celery_redlock_operation(name: str) -> str:
        lock = manager.acquire(name, ttl=LOCK_TTL)
        if lock is None:
            return "not acquired"
        return OK if manager.release(lock) else "release not confirmed"

    return celery_redlock_operation, os.path.dirname(os.path.abspath(str(package.__file__)))


def run_once(operation: Operation, name: str) -> str:
    """The operation's outcome, an exception being an outcome too."""
    try:
        return operation(name)
    except Exception as error:
        return f"raised {type(error).__name__}"


# -- measuring -------------------------------------------------------------------------------


@dataclass
class Sample:
    """One timed run of one case: how many calls ended how, over how long, at what CPU cost of
    the process that ran them; with the connections per node that process held afterwards,
    when they were counted."""

    outcomes: Counter[str]
    seconds: float
    cpu_seconds: float
    connections: list[int] | None = None
    node_cpu_seconds: list[float] = field(default_factory=list)  # per lock node, over the run

    @property
    def node_cpu_us_per_pair(self) -> float | None:
        """CPU microseconds of the lock nodes together per successful pair."""
        if not self.node_cpu_seconds or not self.successes:
            return None
        return sum(self.node_cpu_seconds) / self.successes * 1e6

    @property
    def busiest_node_share(self) -> float | None:
        """The busiest lock node's CPU over the run, as a share of one core (1.0: saturated)."""
        if not self.node_cpu_seconds or self.seconds <= 0:
            return None
        return max(self.node_cpu_seconds) / self.seconds

    @property
    def successes(self) -> int:
        """Calls that acquired and had their release confirmed."""
        return self.outcomes.get(OK, 0)

    @property
    def failures(self) -> int:
        """Calls that did anything else."""
        return sum(self.outcomes.values()) - self.successes

    @property
    def rate(self) -> float:
        """Successful acquire + release pairs per second."""
        return self.successes / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us_per_call(self) -> float | None:
        """CPU microseconds of the measuring process per call (all its threads)."""
        calls = sum(self.outcomes.values())
        return self.cpu_seconds / calls * 1e6 if calls else None


class ThreadGang:
    """``size`` long-lived threads of this process running one shared operation, each on lock
    names of its own, in timed runs: like the threads of a Celery ``-P threads`` pool."""

    def __init__(self, operation: Operation, size: int, prefix: str) -> None:
        self._operation = operation
        self._prefix = prefix
        self._start = threading.Barrier(size + 1)
        self._end = threading.Barrier(size + 1)
        self._deadline = 0.0
        self._stopping = False
        self._outcomes: list[Counter[str]] = [Counter() for _ in range(size)]
        self._threads = [
            threading.Thread(
                target=self._work, args=(index,), name=f"{prefix}-{index}", daemon=True
            )
            for index in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self, index: int) -> None:
        """One thread: at every run, call until the deadline (at least once)."""
        prefix = f"{self._prefix}:{index}:"
        calls = 0
        while True:
            try:
                self._start.wait()
            except threading.BrokenBarrierError:
                return
            if self._stopping:
                return
            outcomes: Counter[str] = Counter()
            deadline = self._deadline
            while True:
                outcomes[run_once(self._operation, f"{prefix}{calls}")] += 1
                calls += 1
                if time.perf_counter() >= deadline:
                    break
            self._outcomes[index] = outcomes
            try:
                self._end.wait()
            except threading.BrokenBarrierError:
                return

    def run(self, seconds: float) -> Sample:
        """Every thread calls for ``seconds`` (each at least once); the run lasts until the last
        call of the last thread returned."""
        gc.collect()
        cpu_started = time.process_time()
        started = time.perf_counter()
        self._deadline = started + seconds
        self._start.wait(timeout=CHILD_TIMEOUT)
        self._end.wait(timeout=seconds + CHILD_TIMEOUT)
        elapsed = time.perf_counter() - started
        cpu_seconds = time.process_time() - cpu_started
        return Sample(sum(self._outcomes, Counter()), elapsed, cpu_seconds)

    def close(self) -> None:
        """Let the threads end, and wait a little for them."""
        self._stopping = True
        with contextlib.suppress(threading.BrokenBarrierError):
            self._start.wait(timeout=5.0)
        self._start.abort()
        self._end.abort()
        for thread in self._threads:
            thread.join(timeout=5.0)


class Case(Protocol):
    """A measured configuration: one library, a node count, a kind of concurrency."""

    library: Library
    nodes: int
    samples: list[Sample]
    source: str  # where the measured code was imported from

    @property
    def mode(self) -> str:
        """How it runs: "1 thread", "50 threads", "gevent, 500 greenlets"."""
        ...

    def warm_up(self) -> None:
        """Open connections and load scripts before the timed rounds."""

    def run(self, seconds: float) -> Sample:
        """One timed run."""
        ...

    def close(self) -> None:
        """Release what the case holds."""


@dataclass
class ThreadCase:
    """``threads`` threads of this process sharing one lock client."""

    library: Library
    nodes: int
    threads: int
    urls: list[str]
    warmup_seconds: float
    samples: list[Sample] = field(default_factory=list)
    source: str = ""
    _gang: ThreadGang | None = None

    @property
    def mode(self) -> str:
        """How it runs, for the report."""
        return f"{self.threads} thread{'s' if self.threads > 1 else ''}"

    def warm_up(self) -> None:
        """Build the client and the threads; a first run, not counted."""
        operation, self.source = make_operation(self.library, self.urls[: self.nodes])
        slug = "".join(c if c.isalnum() else "-" for c in self.library.name)
        self._gang = ThreadGang(
            operation, self.threads, f"bench:{slug}:{self.nodes}:{self.threads}"
        )
        self._gang.run(self.warmup_seconds)

    def run(self, seconds: float) -> Sample:
        """One timed run of every thread."""
        assert self._gang is not None
        return self._gang.run(seconds)

    def close(self) -> None:
        """End the threads."""
        if self._gang is not None:
            self._gang.close()


@dataclass
class ChildReport:
    """What a subprocess reported, and the connections it held then."""

    sample: Sample
    source: str


def local_ports_of(pid: int) -> set[int] | None:
    """The local TCP ports of the established sockets process ``pid`` holds (from ``/proc``);
    None where that cannot be read."""
    inodes: set[str] = set()
    try:
        for entry in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(entry.path)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    except OSError:
        return None
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as lines:
            next(lines, None)  # the header
            for line in lines:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "01" and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def connections_of(pid: int, observers: Sequence[Any]) -> list[int] | None:
    """How many connections process ``pid`` holds to each node, by ``CLIENT LIST`` on each
    (``observers``: one redis-py client per node) matched with the process's sockets."""
    ports = local_ports_of(pid)
    if ports is None:
        return None
    counts = []
    for observer in observers:
        clients = observer.client_list()
        counts.append(
            sum(1 for client in clients if int(str(client["addr"]).rsplit(":", 1)[1]) in ports)
        )
    return counts


def run_child(
    arguments: list[str], observers: Sequence[Any], gevent: bool, timeout: float
) -> ChildReport:
    """Run this script as a subprocess (``--child``), read its report from its standard output,
    count its connections to every node while it still holds them, then let it exit."""
    script = os.path.abspath(__file__)
    prefix = (
        [sys.executable, "-c", GEVENT_PRELUDE.format(path=script)]
        if gevent
        else [sys.executable, script]
    )
    with (
        tempfile.TemporaryFile(mode="w+", encoding="utf-8") as errors,
        subprocess.Popen(
            [*prefix, *arguments],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        ) as child,
    ):
        try:
            assert child.stdout is not None and child.stdin is not None
            line = _read_line(child, timeout)
            if not line:
                if child.poll() is None:
                    child.kill()
                child.wait()
                errors.seek(0)
                raise RuntimeError(f"the subprocess reported nothing:\n{errors.read()[-3000:]}")
            report = json.loads(line)
            connections = connections_of(child.pid, observers)
            child.stdin.write("done\n")
            child.stdin.flush()
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    sample = Sample(
        Counter(report["outcomes"]), report["seconds"], report["cpu_seconds"], connections
    )
    return ChildReport(sample, report["source"])


def _read_line(child: subprocess.Popen[str], timeout: float) -> str:
    """The first line of the child's standard output, or "" if it exits or takes too long."""
    assert child.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            return ""
    return child.stdout.readline()


@dataclass
class GeventCase:
    """A fresh monkey-patched subprocess per run, ``greenlets`` greenlets sharing one client."""

    library: Library
    nodes: int
    greenlets: int
    urls: list[str]
    observers: Sequence[Any]
    warmup_seconds: float
    samples: list[Sample] = field(default_factory=list)
    source: str = ""

    @property
    def mode(self) -> str:
        """How it runs, for the report."""
        return f"gevent, {self.greenlets} greenlets"

    def warm_up(self) -> None:
        """One run, not counted (the first subprocess pays for cold caches)."""
        self.run(self.warmup_seconds)

    def run(self, seconds: float) -> Sample:
        """One subprocess: warm-up, ``seconds`` of calls, connections counted at the end."""
        report = run_child(
            [
                "--child",
                "greenlets",
                *self.library.child_arguments(),
                "--urls",
                ",".join(self.urls[: self.nodes]),
                "--workers",
                str(self.greenlets),
                "--seconds",
                str(seconds),
                "--warmup-seconds",
                str(self.warmup_seconds),
            ],
            self.observers[: self.nodes],
            gevent=True,
            timeout=seconds + self.warmup_seconds + CHILD_TIMEOUT,
        )
        self.source = report.source
        return report.sample

    def close(self) -> None:
        """Nothing: each run's subprocess is gone when the run returns."""


def start_child(arguments: list[str], errors: Any) -> subprocess.Popen[str]:
    """This script as a subprocess (``--child``), talking over its standard input and output."""
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *arguments],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
    )


def run_children_together(argument_lists: Sequence[list[str]], timeout: float) -> list[ChildReport]:
    """Run one subprocess (``--child ... --start-on-go``) per argument list; once every one has
    warmed up, start their timed runs at the same moment, and collect their reports."""
    with contextlib.ExitStack() as stack:
        errors = stack.enter_context(tempfile.TemporaryFile(mode="w+", encoding="utf-8"))
        children = [
            stack.enter_context(start_child([*arguments, "--start-on-go"], errors))
            for arguments in argument_lists
        ]
        try:
            deadline = time.monotonic() + timeout
            for child in children:  # every one warmed up and waiting
                if not _read_line(child, max(deadline - time.monotonic(), 0.0)):
                    errors.seek(0)
                    raise RuntimeError(f"a subprocess never got ready:\n{errors.read()[-3000:]}")
            for child in children:
                assert child.stdin is not None
                child.stdin.write("go\n")
                child.stdin.flush()
            lines = [_read_line(child, max(deadline - time.monotonic(), 0.0)) for child in children]
            if not all(lines):
                errors.seek(0)
                raise RuntimeError(f"a subprocess reported nothing:\n{errors.read()[-3000:]}")
            for child in children:
                assert child.stdin is not None
                child.stdin.write("done\n")
                child.stdin.flush()
            for child in children:
                child.wait(timeout=30)
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
    reports = []
    for line in lines:
        report = json.loads(line)
        sample = Sample(Counter(report["outcomes"]), report["seconds"], report["cpu_seconds"])
        reports.append(ChildReport(sample, report["source"]))
    return reports


@dataclass
class ProcessCase:
    """``processes`` fresh subprocesses per run, each with ``threads`` threads sharing a client
    of its own, timed over the same window: what a host running several worker processes gets."""

    library: Library
    nodes: int
    processes: int
    threads: int
    urls: list[str]
    warmup_seconds: float
    samples: list[Sample] = field(default_factory=list)
    source: str = ""

    @property
    def mode(self) -> str:
        """How it runs, for the report."""
        processes = f"{self.processes} process{'es' if self.processes > 1 else ''}"
        return f"{processes} x {self.threads} thread{'s' if self.threads > 1 else ''}"

    def warm_up(self) -> None:
        """Nothing: every run's subprocesses warm up before their timed run."""

    def run(self, seconds: float) -> Sample:
        """One run of every subprocess at once: the pairs of all of them over the longest of
        their timed runs, and the CPU time of all of them."""
        arguments = [
            "--child",
            "threads",
            *self.library.child_arguments(),
            "--urls",
            ",".join(self.urls[: self.nodes]),
            "--workers",
            str(self.threads),
            "--seconds",
            str(seconds),
            "--warmup-seconds",
            str(self.warmup_seconds),
        ]
        reports = run_children_together(
            [arguments] * self.processes, seconds + self.warmup_seconds + CHILD_TIMEOUT
        )
        self.source = reports[0].source
        samples = [report.sample for report in reports]
        return Sample(
            sum((sample.outcomes for sample in samples), Counter()),
            max(sample.seconds for sample in samples),
            sum(sample.cpu_seconds for sample in samples),
        )

    def close(self) -> None:
        """Nothing: each run's subprocesses are gone when the run returns."""


def node_cpu_seconds(observers: Sequence[Any]) -> list[float]:
    """``used_cpu_sys + used_cpu_user`` of each node, from ``INFO cpu``."""
    seconds = []
    for observer in observers:
        cpu = observer.info("cpu")
        seconds.append(float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]))
    return seconds


def measure(cases: Sequence[Case], rounds: int, seconds: float, observers: Sequence[Any]) -> None:
    """Warm every case up, then ``rounds`` rounds of every case once, rotated every round;
    each run with the CPU its lock nodes spent (``observers``: a client per node)."""
    began = time.monotonic()
    for case in cases:
        case.warm_up()
        print(
            f"  [{time.monotonic() - began:5.1f} s] warmed up {case.library.name} "
            f"{case.nodes} node(s), {case.mode}",
            file=sys.stderr,
            flush=True,
        )
    for round_index in range(rounds):
        shift = round_index % len(cases)
        order = list(cases[shift:]) + list(cases[:shift])
        if round_index % 2:
            order.reverse()
        for case in order:
            nodes_before = node_cpu_seconds(observers[: case.nodes])
            sample = case.run(seconds)
            nodes_after = node_cpu_seconds(observers[: case.nodes])
            sample.node_cpu_seconds = [
                after - before for before, after in zip(nodes_before, nodes_after, strict=True)
            ]
            case.samples.append(sample)
            failures = f", {sample.failures} failed" if sample.failures else ""
            print(
                f"  [{time.monotonic() - began:5.1f} s] round {round_index + 1}/{rounds} "
                f"{case.library.name} {case.nodes} node(s), "
                f"{case.mode}: {sample.rate:,.0f}/s{failures}",
                file=sys.stderr,
                flush=True,
            )


def live_thread_connections(
    library: Library, nodes: int, urls: list[str], observers: Sequence[Any]
) -> ChildReport:
    """A subprocess whose ``LIVE_THREADS`` threads each use one shared client once, all at
    once, and stay alive while their connections are counted."""
    return run_child(
        [
            "--child",
            "threads",
            *library.child_arguments(),
            "--urls",
            ",".join(urls[:nodes]),
            "--workers",
            str(LIVE_THREADS),
            "--seconds",
            "0",
        ],
        observers[:nodes],
        gevent=False,
        timeout=CHILD_TIMEOUT,
    )


# -- the subprocesses (``--child``) ----------------------------------------------------------


def raise_open_file_limit() -> None:
    """Allow as many open files as the hard limit does: without multiplexing, 500 greenlets
    over 5 nodes hold 2,500 sockets."""
    with contextlib.suppress(ValueError, OSError, ImportError):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def child_main(options: argparse.Namespace) -> int:
    """In a subprocess: ``--workers`` threads or greenlets share one client of ``--library``;
    each calls once (``--seconds 0``), or for ``--seconds`` after a warm-up. Then one JSON line
    on standard output, and every worker stays alive until a line arrives on standard input."""
    raise_open_file_limit()
    library = Library(options.library, options.package_directory)
    operation, source = make_operation(library, options.urls.split(","))
    workers = options.workers
    event_class: Callable[[], Any] = threading.Event
    if options.child == "greenlets":
        import gevent.event
        import gevent.monkey

        if not gevent.monkey.is_module_patched("socket"):
            raise SystemExit("--child greenlets needs gevent's monkey patching done first")
        event_class = gevent.event.Event

    warmed: list[int] = []
    finished: list[int] = []
    all_warm, all_finished, go, release = (event_class() for _ in range(4))
    outcomes = [Counter[str]() for _ in range(workers)]
    timing = {"deadline": 0.0}

    def work(index: int) -> None:
        prefix = f"bench:{options.child}:{os.getpid()}:{index}:"
        calls = 0
        if options.seconds > 0:
            warm_deadline = time.perf_counter() + options.warmup_seconds
            while True:
                run_once(operation, f"{prefix}{calls}")
                calls += 1
                if time.perf_counter() >= warm_deadline:
                    break
        warmed.append(index)
        if len(warmed) == workers:
            all_warm.set()
        go.wait()
        counted: Counter[str] = Counter()
        while True:
            counted[run_once(operation, f"{prefix}{calls}")] += 1
            calls += 1
            if time.perf_counter() >= timing["deadline"]:
                break
        outcomes[index] = counted
        finished.append(index)
        if len(finished) == workers:
            all_finished.set()
        release.wait()

    if options.child == "greenlets":
        import gevent

        spawned = [gevent.spawn(work, index) for index in range(workers)]
    else:
        spawned = [
            threading.Thread(target=work, args=(index,), daemon=True) for index in range(workers)
        ]
        for thread in spawned:
            thread.start()
    all_warm.wait()
    if options.start_on_go:  # several processes start their timed runs at the same moment
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        sys.stdin.readline()
    gc.collect()
    cpu_started = time.process_time()
    started = time.perf_counter()
    timing["deadline"] = started + options.seconds
    go.set()
    all_finished.wait()
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    report = {
        "outcomes": dict(sum(outcomes, Counter())),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "source": source,
    }
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    sys.stdin.readline()  # the parent counted our connections
    release.set()
    if options.child == "greenlets":
        gevent.joinall(spawned, timeout=10)
    else:
        for thread in spawned:
            thread.join(timeout=10)
    return 0


# -- reporting -------------------------------------------------------------------------------


def median_rate(case: Case) -> float:
    """The case's median successful pairs per second over rounds."""
    return float(statistics.median(sample.rate for sample in case.samples))


@dataclass
class Goal:
    """One goal of issue 17 or 23: a measured value against its limit."""

    name: str
    value: float | None
    limit: float
    at_least: bool
    unit: str = ""

    @property
    def verdict(self) -> str:
        """PASS, MISS, or SKIP when it was not measured."""
        if self.value is None:
            return "SKIP (not measured)"
        met = self.value >= self.limit if self.at_least else self.value <= self.limit
        return "PASS" if met else "MISS"


@dataclass
class Results:
    """Everything measured, for the report and ``--json``."""

    cases: list[Case]
    connections: dict[tuple[str, int], ChildReport]
    environment: dict[str, str]
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def find(self, library: str, nodes: int, mode: str) -> Case | None:
        """The case of that library, node count and mode, if measured."""
        for case in self.cases:
            if case.library.name == library and case.nodes == nodes and case.mode == mode:
                return case
        return None

    def rate(self, library: str, nodes: int, mode: str) -> float | None:
        """That case's median rate, if measured."""
        case = self.find(library, nodes, mode)
        return median_rate(case) if case is not None and case.samples else None

    def cpu_per_call(self, library: str, nodes: int, mode: str) -> float | None:
        """That case's median client CPU microseconds per call, if measured."""
        case = self.find(library, nodes, mode)
        values = [] if case is None else [sample.cpu_us_per_call for sample in case.samples]
        present = [value for value in values if value is not None]
        return float(statistics.median(present)) if present else None

    def gevent_connections(self, case: Case) -> list[int] | None:
        """The most connections per node any round of a gevent case held."""
        counted = [sample.connections for sample in case.samples if sample.connections]
        if not counted:
            return None
        return [max(column) for column in zip(*counted, strict=True)]

    def goals(self) -> list[Goal]:
        """The goals of issues 17 and 23, for every celery_redlock measured."""
        goals: list[Goal] = []
        libraries = []
        for case in self.cases:
            if not case.library.is_redis_py and case.library.name not in libraries:
                libraries.append(case.library.name)
        redis_py_50 = self.rate(REDIS_PY, 1, "50 threads")
        for library in libraries:
            for nodes in (1, NODES):
                one, fifty = (
                    self.rate(library, nodes, "1 thread"),
                    self.rate(library, nodes, "50 threads"),
                )
                goals.append(
                    Goal(
                        f"{library}, {nodes} node{'s' if nodes > 1 else ''}: 50 threads / "
                        f"1 thread >= {CONCURRENCY_GOAL}x",
                        fifty / one if fifty is not None and one else None,
                        CONCURRENCY_GOAL,
                        at_least=True,
                        unit="x",
                    )
                )
            for nodes in (1, NODES):
                one_cpu = self.cpu_per_call(library, nodes, "1 thread")
                fifty_cpu = self.cpu_per_call(library, nodes, "50 threads")
                goals.append(
                    Goal(
                        f"{library}, {nodes} node{'s' if nodes > 1 else ''}: client CPU per "
                        "call at 50 threads / at 1 thread <= 1x (issue 23)",
                        fifty_cpu / one_cpu if fifty_cpu is not None and one_cpu else None,
                        1.0,
                        at_least=False,
                        unit="x",
                    )
                )
            for nodes in (1, NODES):
                fifty = self.rate(library, nodes, "50 threads")
                goals.append(
                    Goal(
                        f"{library}, {nodes} node{'s' if nodes > 1 else ''}, 50 threads / "
                        f"redis-py Lock 50 threads (shared pool) >= {CONCURRENCY_GOAL}x",
                        fifty / redis_py_50 if fifty is not None and redis_py_50 else None,
                        CONCURRENCY_GOAL,
                        at_least=True,
                        unit="x",
                    )
                )
            for nodes in (1, NODES):
                report = self.connections.get((library, nodes))
                counts = report.sample.connections if report is not None else None
                goals.append(
                    Goal(
                        f"{library}, {nodes} node{'s' if nodes > 1 else ''}: {LIVE_THREADS} live "
                        f"threads hold <= {CONNECTIONS_GOAL} connections per node",
                        max(counts) if counts else None,
                        CONNECTIONS_GOAL,
                        at_least=False,
                    )
                )
            for nodes in (1, NODES):
                gevent_case = self.find(library, nodes, f"gevent, {GREENLETS} greenlets")
                counts = self.gevent_connections(gevent_case) if gevent_case is not None else None
                goals.append(
                    Goal(
                        f"{library}, {nodes} node{'s' if nodes > 1 else ''}: {GREENLETS} "
                        f"greenlets hold <= {CONNECTIONS_GOAL} connections per node",
                        max(counts) if counts else None,
                        CONNECTIONS_GOAL,
                        at_least=False,
                    )
                )
        return goals


def _counts(counts: list[int] | None) -> str:
    if not counts:
        return "n/a"
    return " / ".join(str(count) for count in counts)


def markdown(results: Results) -> str:
    """The report: throughput table, connections table, goals, machine."""
    settings = results.settings
    lines = [
        "## Uncontended acquire + release under concurrency",
        "",
        f"{settings['rounds']} interleaved rounds of {settings['seconds']:g} s per case; "
        f"medians over rounds (min - max); distinct lock names; per-node timeout "
        f"{NODE_TIMEOUT * 1000:g} ms, no redis-py retries, lock ttl {LOCK_TTL:g} s. Only "
        "successful pairs (acquired, release confirmed) count; client CPU is the measuring "
        "process's CPU time (all threads) per call; lock nodes' CPU is `used_cpu_sys + "
        "used_cpu_user` of `INFO cpu`, after minus before, of the nodes together per pair, and "
        "of the busiest node as a share of one core (100%: that node is saturated).",
        "",
        "| library | nodes | concurrency | pairs/s | min - max | x own 1 thread "
        "| x redis-py Lock, same concurrency | client CPU µs/call | nodes CPU µs/pair "
        "| busiest node CPU | failures |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for case in results.cases:
        if not case.samples:
            continue
        rates = [sample.rate for sample in case.samples]
        median = median_rate(case)
        one = results.rate(case.library.name, case.nodes, "1 thread")
        own = f"{median / one:.2f}x" if one else "—"
        if case.mode == "1 thread":
            own = "1.00x"
        baseline = results.rate(REDIS_PY, 1, case.mode)
        versus = f"{median / baseline:.2f}x" if baseline else "—"
        cpu_values = [
            sample.cpu_us_per_call for sample in case.samples if sample.cpu_us_per_call is not None
        ]
        cpu = f"{statistics.median(cpu_values):,.0f}" if cpu_values else "—"
        node_values = [
            sample.node_cpu_us_per_pair
            for sample in case.samples
            if sample.node_cpu_us_per_pair is not None
        ]
        node_cpu = f"{statistics.median(node_values):,.0f}" if node_values else "—"
        shares = [
            sample.busiest_node_share
            for sample in case.samples
            if sample.busiest_node_share is not None
        ]
        busiest = f"{statistics.median(shares):.0%}" if shares else "—"
        failures = Counter[str]()
        for sample in case.samples:
            failures.update(
                {outcome: count for outcome, count in sample.outcomes.items() if outcome != OK}
            )
        failed = ", ".join(f"{name} x{count}" for name, count in sorted(failures.items()))
        lines.append(
            f"| {case.library.name} | {case.nodes} | {case.mode} | {median:,.0f} "
            f"| {min(rates):,.0f} - {max(rates):,.0f} | {own} | {versus} | {cpu} "
            f"| {node_cpu} | {busiest} | {failed or 'none'} |"
        )
    lines += [
        "",
        "Connections each node holds from the measuring process (`CLIENT LIST`, matched with the "
        "process's sockets through /proc), one figure per node:",
        "",
        "| library | nodes | while alive | connections per node |",
        "|---|---:|---|---|",
    ]
    for (library, nodes), report in results.connections.items():
        lines.append(
            f"| {library} | {nodes} | {LIVE_THREADS} threads that each used the lock once "
            f"| {_counts(report.sample.connections)} |"
        )
    for case in results.cases:
        if case.mode.startswith("gevent") and case.samples:
            lines.append(
                f"| {case.library.name} | {case.nodes} | {GREENLETS} greenlets after their "
                f"timed run (most in any round) | {_counts(results.gevent_connections(case))} |"
            )
    lines += ["", "Goals (issues 17 and 23):", ""]
    for goal in results.goals():
        value = "n/a" if goal.value is None else f"{goal.value:.2f}{goal.unit}"
        if goal.value is not None and not goal.unit:
            value = f"{goal.value:.0f}"
        lines.append(f"- {goal.verdict}: {goal.name} (measured {value})")
    if results.notes:
        lines += ["", *results.notes]
    env = results.environment
    lines += [
        "",
        f"Machine: {env['cpu']}, {env['cpus']} CPUs, load average {env['load_before']} before, "
        f"{env['load_after']} after; the nodes share those CPUs with the clients. "
        f"Python {env['python']}, {env['redis_server']}, redis-py {env['redis-py']}, "
        f"gevent {env['gevent']}; sources: {env['sources']}. Took {env['took']}.",
    ]
    return "\n".join(lines)


def environment() -> dict[str, str]:
    """The machine and versions, for the report."""
    from celery_redlock.testing import find_redis_server

    def version(distribution: str) -> str:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "cpu": cpu_model(),
        "cpus": str(os.cpu_count()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "redis_server": server_version(find_redis_server()),
        "redis-py": version("redis"),
        "gevent": version("gevent"),
        "load_before": f"{os.getloadavg()[0]:.1f}",
    }


# -- main ------------------------------------------------------------------------------------


def process_counts(text: str) -> tuple[int, ...]:
    """``--processes``: one count, or several separated by commas, each at least 1."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of process counts: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"process counts must be at least 1: {text!r}")
    return counts


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument(
        "--seconds", type=float, default=1.5, help="timed seconds per case per round"
    )
    parser.add_argument(
        "--warmup-seconds", type=float, default=0.5, help="untimed seconds of calls per case first"
    )
    parser.add_argument("--no-gevent", action="store_true", help="skip the gevent subprocesses")
    parser.add_argument(
        "--processes",
        type=process_counts,
        default=(),
        metavar="N[,N...]",
        help="also run N processes at once, each with the threads of the thread cases (1 and 50) "
        "and a client of its own, for each N given (e.g. 1,2,4,8): their pairs/s together and "
        "their CPU per call",
    )
    parser.add_argument(
        "--no-redis-py", action="store_true", help="skip redis-py's Lock (no ratios to it then)"
    )
    parser.add_argument(
        "--variant",
        action="append",
        type=variant_argument,
        default=[],
        metavar="LABEL=DIR",
        help="also measure the celery_redlock package copy in DIR as 'celery_redlock[LABEL]', in "
        "the same rounds (repeatable)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show the libraries' log messages on stderr"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    # Internal: a measuring subprocess.
    parser.add_argument("--child", choices=("threads", "greenlets"), help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    parser.add_argument("--package-directory", help=argparse.SUPPRESS)
    parser.add_argument("--urls", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start-on-go", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if not arguments.child and (arguments.rounds < 1 or arguments.seconds <= 0):
        parser.error("--rounds must be at least 1 and --seconds positive")
    return arguments


def run(arguments: argparse.Namespace) -> Results:
    """Start the nodes, measure every case, stop the nodes."""
    import redis

    from celery_redlock.testing import RedisNodes

    libraries = [Library(CELERY_REDLOCK)] + [
        Library(f"{CELERY_REDLOCK}[{label}]", directory) for label, directory in arguments.variant
    ]
    if not arguments.no_redis_py:
        libraries.append(Library(REDIS_PY))
    gevent_available = importlib.util.find_spec("gevent") is not None
    notes = []
    if not gevent_available and not arguments.no_gevent:
        notes.append("gevent is not installed (`pip install -e '.[bench]'`): no gevent rows.")
    started = time.monotonic()
    env = environment()
    print(
        f"{env['cpu']}, {env['cpus']} CPUs; load {env['load_before']}; {env['redis_server']}",
        file=sys.stderr,
    )
    with RedisNodes(NODES, extra_args=PRODUCTION_SERVER) as servers:
        urls = servers.urls
        print(f"  started {NODES} redis-server nodes: {urls}", file=sys.stderr)
        observers = [redis.Redis.from_url(url, socket_timeout=10.0) for url in urls]
        cases: list[Case] = []
        for library in libraries:
            for nodes in library.node_counts():
                for threads in THREAD_COUNTS:
                    cases.append(
                        ThreadCase(library, nodes, threads, urls, arguments.warmup_seconds)
                    )
                for processes in arguments.processes:
                    for threads in THREAD_COUNTS:
                        cases.append(
                            ProcessCase(
                                library, nodes, processes, threads, urls, arguments.warmup_seconds
                            )
                        )
                if gevent_available and not arguments.no_gevent:
                    cases.append(
                        GeventCase(
                            library, nodes, GREENLETS, urls, observers, arguments.warmup_seconds
                        )
                    )
        try:
            measure(cases, arguments.rounds, arguments.seconds, observers)
        finally:
            for case in cases:
                case.close()
        connections: dict[tuple[str, int], ChildReport] = {}
        for library in libraries:
            for nodes in library.node_counts():
                report = live_thread_connections(library, nodes, urls, observers)
                connections[(library.name, nodes)] = report
                print(
                    f"  {library.name}, {nodes} node(s): {LIVE_THREADS} live threads hold "
                    f"{_counts(report.sample.connections)} connection(s) per node",
                    file=sys.stderr,
                )
                if report.sample.failures:
                    notes.append(
                        f"{library.name}, {nodes} node(s), {LIVE_THREADS} threads once: "
                        f"{dict(report.sample.outcomes)}"
                    )
        for observer in observers:
            observer.close()
    sources: dict[str, set[str]] = {}
    for case in cases:
        sources.setdefault(case.library.name, set()).add(case.source)
    for (library_name, _), report in connections.items():
        sources.setdefault(library_name, set()).add(report.source)
    for library_name, places in sources.items():
        if len(places - {""}) > 1:
            notes.append(
                f"WARNING: {library_name} was imported from several places: {sorted(places)}; "
                "the processes did not all measure the same code."
            )
    env["sources"] = "; ".join(
        f"{name}: {', '.join(sorted(places - {''}))}" for name, places in sources.items()
    )
    env["load_after"] = f"{os.getloadavg()[0]:.1f}"
    env["took"] = f"{time.monotonic() - started:.0f} s"
    settings = {
        "rounds": arguments.rounds,
        "seconds": arguments.seconds,
        "warmup_seconds": arguments.warmup_seconds,
        "node_timeout_seconds": NODE_TIMEOUT,
        "lock_ttl_seconds": LOCK_TTL,
        "greenlets": GREENLETS,
        "live_threads": LIVE_THREADS,
        "processes": list(arguments.processes),
    }
    return Results(cases, connections, env, settings, notes)


def to_json(results: Results) -> str:
    """Every sample, and the goals."""
    document = {
        "environment": results.environment,
        "settings": results.settings,
        "cases": [
            {
                "library": case.library.name,
                "nodes": case.nodes,
                "mode": case.mode,
                "median_rate": median_rate(case) if case.samples else None,
                "samples": [
                    {
                        "rate": sample.rate,
                        "seconds": sample.seconds,
                        "cpu_seconds": sample.cpu_seconds,
                        "outcomes": dict(sample.outcomes),
                        "connections": sample.connections,
                        "node_cpu_seconds": sample.node_cpu_seconds,
                    }
                    for sample in case.samples
                ],
            }
            for case in results.cases
        ],
        "live_thread_connections": [
            {"library": library, "nodes": nodes, "connections": report.sample.connections}
            for (library, nodes), report in results.connections.items()
        ],
        "goals": [{**goal.__dict__, "verdict": goal.verdict} for goal in results.goals()],
    }
    return json.dumps(document, indent=2, ensure_ascii=False)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, internally, one measuring subprocess); exit 0 unless interrupted."""
    arguments = parse_arguments(argv)
    quiet_logging(arguments.verbose)
    raise_open_file_limit()
    if arguments.child:
        return child_main(arguments)
    try:
        with interrupt_on_sigterm():
            results = run(arguments)
    except KeyboardInterrupt:
        print("interrupted; the Redis servers were stopped", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print("the benchmark failed (see above); the Redis servers were stopped", file=sys.stderr)
        return 0
    print(markdown(results))
    if arguments.json:
        Path(arguments.json).write_text(to_json(results) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
