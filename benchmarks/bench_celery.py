"""Throughput and CPU of a no-op task through one solo Celery worker: plain, singleton_task, peers.

Run from the repository root::

    python benchmarks/bench_celery.py                          # defaults: five to eight minutes
    python benchmarks/bench_celery.py --tasks 300 --rounds 2   # a quick check
    python benchmarks/bench_celery.py --json results.json      # the tables, plus raw numbers
    python benchmarks/bench_celery.py --candidate /tmp/patched # A/B a changed celery_redlock
    python benchmarks/bench_celery.py --profile /tmp/profiles  # cProfile the solo workers too

Six fresh ``redis-server`` processes are started on free ports of 127.0.0.1 through
``celery_redlock.testing`` (never a Redis you already run) and stopped at the end, also on
Ctrl-C, SIGTERM and errors: one is the broker, five are lock nodes. The same no-op task,
``noop(i)``, is measured in six variants, all on that one broker:

* ``plain``: ``@app.task``;
* ``redlock-1``: ``@singleton_task`` with ``redlock_urls`` = lock node 0;
* ``redlock-5``: ``@singleton_task`` with ``redlock_urls`` = lock nodes 0-4;
* ``celery-singleton``: ``@app.task(base=Singleton)``, its Redis backend on lock node 0;
* ``celery-once``: ``@app.task(base=QueueOnce)``, its Redis backend on lock node 0;
* ``shape``: ``@app.task`` whose body first takes a lock through `owner_shape.OwnerShape` on
  lock node 0 (``SET NX`` through one owner thread, waited for) and posts its release at the
  end, as ``@singleton_task`` does: the shape issue 37 chose for the nodes layer, bare. No
  library of that shape can do better here; its row tells what the shape costs on this machine,
  the distance to ``redlock-1`` what our promises and our code cost.

One run of one variant:

1. ``--tasks`` calls ``noop(i)`` are published to a queue nobody used before, every call with
   arguments no other call ever had (so nothing is a duplicate), then one ``report`` task. This
   is not timed: celery-singleton and celery-once take their locks here, at publish time;
2. then one real worker starts on that queue: ``celery -A bench_celery:app worker -P solo
   -c 1`` (a `celery_redlock.testing.CeleryWorker`: no gossip, mingle or heartbeat, log level
   WARNING, Celery's default prefetch, ``ignore_result=True`` and no result backend). Every
   worker imports celery_redlock, celery-singleton and celery-once alike, whatever its variant;
3. inside the worker, a ``task_prerun`` and a ``task_postrun`` receiver, the same in every
   variant, keep a few numbers in memory: when the first ``noop`` started (wall clock and the
   process's CPU time), when the last one ended, and how many ended in which state. The window
   runs from the start of the first ``noop`` to the end of the last, so it holds every call's
   whole cycle (receive, lock, run, release, acknowledge) and neither the worker's start nor
   its stop;
4. ``report``, queued behind the calls, sends those numbers to the broker Redis once, and the
   window starts anew;
5. end to end (unless ``--worker-only``): with that worker idle on the queue, ``--tasks`` more
   calls are published one ``apply_async`` at a time, as an application does (celery-singleton
   and celery-once lock here, inside the time), then a ``report``; timed from the first
   ``apply_async`` to the end of the last call in the worker (harness and worker read the host's
   monotonic clock). Producer, broker and worker all count, running at once. celery-singleton
   locks in ``apply_async``, outside the worker-only window: only this table compares it fairly;
6. the worker is then stopped (killed: every message is acknowledged by then, and a warm
   shutdown would only add a second per run).

A run where a call failed, retried or was skipped (any state but SUCCESS, or fewer calls than
published) is noted in the report and run again, at most three times.

CPU: with ``-P solo`` the worker is one process that receives, locks, runs and acknowledges,
so its CPU time in the window (``time.process_time``: user + system, every thread) divided by
the calls is everything a call costs the worker. The lock nodes' memory (INFO ``used_memory``,
expired keys swept by a SCAN) is read before the worker starts and two seconds after it is
stopped, so it holds what the run (both halves) left behind. The lock nodes' CPU time (from
their INFO) is read before the worker starts and after the report arrives, so it holds the
worker's start, and the nodes' idle housekeeping: the plain row shows that floor.

The lock client alone: ``client-1`` and ``client-5`` run ``Redlock(urls).acquire(resource,
ttl)`` + ``release(lock)`` ``--tasks`` times (distinct resources, after a short warm-up) in a
separate process started and pinned (``--cpus``) the same way as the workers, importing the same
modules, in the same rounds. The integration CPU of singleton_task is its worker CPU per call
minus plain's, minus the lock client's CPU per acquire + release with the same node count,
computed in each round and reported as the median over rounds; the target is at most 50 µs.

The lock client also runs half as many pairs again with a millisecond's pause before each (only
the pairs timed): paced like tasks, the pair costs more, since caches go cold and the nodes go
idle between two locks as they do in a worker between two tasks; the report gives that yardstick
beside the hot loop's.

What the integration adds, against the lock client's own cost (issue 17): the wall time a
``@singleton_task`` call takes over plain (from the median rates) divided by the lock client's
wall time per acquire + release pair (from its median rate), for 1 and for 5 lock nodes; shown
beside the ratio to plain, with its min - max when computed within each round. At most 1.0x is
the goal: the integration costs a task no more than one acquire + release of the lock client.

Runs are interleaved: every round runs every variant and both lock clients once, in an order
rotated every round, so load from elsewhere on the machine falls on all of them alike. Before
the rounds, each runs once with ``--warmup`` calls, not counted. The report is Markdown: the
median tasks per second of each variant, its min - max over rounds, its ratio to plain, its cost
per call over plain and that cost over the lock client's pair, the worker's and the lock nodes'
CPU per call; the same end to end, with the producer's CPU per call; the lock client alone;
the integration CPU; then the checks of the targets (singleton_task at least 0.9x plain with 1
and with 5 lock nodes, what it adds at most 1.0x the lock client's pair, integration CPU at most
50 µs per call with either, singleton_task with 1 node at least as fast as celery-singleton,
worker only and end to end) and the machine's load.

``--candidate DIR`` adds ``redlock-1-candidate``, ``redlock-5-candidate`` and their lock
clients: the same runs with another copy of ``celery_redlock`` (a proposed change) first on the
path. DIR is that copy's package directory (holding its ``__init__.py``, as for
``bench_locks.py --variant``) or a directory that contains it as ``celery_redlock/``.

``--profile DIR`` runs every variant once more after the rounds (not in the table), with
cProfile enabled in the worker from the first ``noop`` to the ``report``, and keeps the result
in ``DIR/<variant>.pstats``. It counts wall-clock time, waits included, or with
``--profile-timer cpu`` the worker thread's CPU time (``time.thread_time``; slower).

It always exits 0 when the benchmark itself ran: it is a report, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import hashlib
import importlib.metadata
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from benchmark_support import PRODUCTION_SERVER, server_version
from celery import Celery, signals
from celery_once import QueueOnce  # type: ignore[import-untyped]
from celery_singleton import Singleton  # type: ignore[import-untyped]
from owner_shape import OwnerShape

import celery_redlock
from celery_redlock import Redlock, singleton_task
from celery_redlock.settings import RedlockSettings
from celery_redlock.testing import (
    CeleryWorker,
    ManagedProcess,
    ProcessExitedError,
    RedisNodes,
    RedisServer,
    celery_processes,
    find_redis_server,
)


def _version(distribution: str) -> str:
    """The installed version of a distribution, "?" when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


VARIANTS: dict[str, str] = {
    "plain": "plain `@app.task`",
    "redlock-1": "`@singleton_task`, 1 lock node",
    "redlock-5": "`@singleton_task`, 5 lock nodes",
    "celery-singleton": f"celery-singleton {_version('celery-singleton')} (`base=Singleton`)",
    "celery-once": f"celery-once {_version('celery-once')} (`base=QueueOnce`)",
    "shape": "the bare shape: one owner thread, `SET NX` + release script, 1 node",
}
LOCK_CLIENTS: dict[str, int] = {"client-1": 1, "client-5": 5}  # the lock client alone: nodes
CLIENT_OF: dict[str, str] = {"redlock-1": "client-1", "redlock-5": "client-5"}
BASELINE = "plain"
CANDIDATE = "-candidate"  # runs whose process imports celery_redlock from --candidate
TARGETS = ("redlock-1", "redlock-5")
TARGET_RATIO = 0.9
TARGET_INTEGRATION_CPU_US = 50.0
TARGET_ADDED_PER_CLIENT_PAIR = 1.0  # issue 17: what the integration adds <= one lock client pair
PACE_SECONDS = 0.001  # between two paced lock client pairs: about one plain no-op task
TARGET_BYTES_LEFT = 64.0  # issue 23: lock node memory a run acknowledged on receipt leaves behind
PEER = "celery-singleton"  # issue 23: @singleton_task on 1 node at least as fast as this peer
SHAPE = "shape"
SHAPE_TTL_MS = 60_000
LOCK_NODES = 5

NOOP = "benchmark.noop"
REPORT = "benchmark.report"
APP_MODULE = Path(__file__).stem  # the workers run ``celery -A bench_celery:app``

# Environment of a worker or lock client process.
VARIANT_VARIABLE = "BENCH_CELERY_VARIANT"
BROKER_VARIABLE = "BENCH_CELERY_BROKER"
NODES_VARIABLE = "BENCH_CELERY_NODES"
CPUS_VARIABLE = "BENCH_CELERY_CPUS"
PROFILE_VARIABLE = "BENCH_CELERY_PROFILE"
PROFILE_TIMER_VARIABLE = "BENCH_CELERY_PROFILE_TIMER"

RUN_TIMEOUT = 300.0  # seconds one run may take once its worker or lock client started
RUN_ATTEMPTS = 3  # a run whose calls did not all succeed is run again, at most this often
CLIENT_WARMUP = 20  # acquire + release pairs the lock client runs before it measures


# -- the apps (built the same way in the harness, which publishes, and in each worker) --------


def noop(i: int) -> None:
    """The measured task: nothing at all."""


@functools.cache
def _shape(url: str) -> OwnerShape:
    """This process's `OwnerShape` client of ``url`` (one per worker, made on first use)."""
    return OwnerShape(url)


def shape_noop_on(url: str) -> Any:
    """The ``shape`` variant's task: `noop` inside a bare lock on ``url`` (``SET NX`` waited
    for, the release only posted), the resource named after the call's argument."""

    def shape_noop(i: int) -> None:
        shape = _shape(url)
        name = f"benchmark.shape.{i}"
        token = shape.acquire(name, SHAPE_TTL_MS)
        if token is None:
            raise RuntimeError(f"{name} is held: the arguments were meant to be distinct")
        try:
            noop(i)
        finally:
            shape.release(name, token, wait=False)

    return shape_noop


def base_variant(variant: str) -> str:
    """``redlock-1`` for ``redlock-1-candidate``: which task (or lock client) the run uses."""
    return variant.removesuffix(CANDIDATE)


def label(variant: str) -> str:
    """The variant's name in the report."""
    kind = base_variant(variant)
    name = VARIANTS[kind] if kind in VARIANTS else f"lock client alone, {LOCK_CLIENTS[kind]} node"
    if kind in LOCK_CLIENTS and LOCK_CLIENTS[kind] > 1:
        name += "s"
    return name + (", candidate" if variant.endswith(CANDIDATE) else "")


def node_urls_of(variant: str, node_urls: list[str]) -> list[str]:
    """The lock nodes a variant's locks use: all five for ``redlock-5`` and ``client-5``, else
    node 0 (celery-singleton and celery-once keep their locks there too)."""
    return node_urls if base_variant(variant) in ("redlock-5", "client-5") else node_urls[:1]


def build_app(variant: str, broker_url: str, node_urls: list[str]) -> Celery:
    """The Celery app of one variant: ``noop`` with the variant's base, and ``report``."""
    app = Celery(f"bench_{variant.replace('-', '_')}", broker=broker_url, set_as_current=False)
    kind = base_variant(variant)
    app.conf.update(
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
        redlock_urls=node_urls_of(variant, node_urls),
        singleton_backend_url=node_urls[0],
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": node_urls[0], "default_timeout": 60},
        },
    )
    # Not shared: the harness builds an app per variant, and a shared task would be registered
    # in every one of them (the shape's task under the same name as everybody's noop).
    options: dict[str, Any] = {"name": NOOP, "ignore_result": True, "shared": False}
    if kind == "plain":
        app.task(**options)(noop)
    elif kind in ("redlock-1", "redlock-5"):
        singleton_task(app=app, **options)(noop)
    elif kind == "celery-singleton":
        app.task(base=Singleton, **options)(noop)
    elif kind == "celery-once":
        app.task(base=QueueOnce, **options)(noop)
    elif kind == SHAPE:
        app.task(**options)(shape_noop_on(node_urls[0]))
    else:
        raise ValueError(f"unknown variant {variant!r}")
    app.task(name=REPORT, ignore_result=True)(_report)
    return app


def _pin_from_environment() -> None:
    """Pin this process to the CPUs the harness chose (``--cpus``), if it chose any: workers and
    lock clients go through here alike."""
    cpus = os.environ.get(CPUS_VARIABLE)
    if cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})


# -- inside the worker -------------------------------------------------------------------------


@dataclass
class _Window:
    """What the worker measures, from the first ``noop``'s start to the last one's end."""

    started: float | None = None
    ended: float = 0.0
    ended_monotonic: float = 0.0  # the host's clock, which the harness reads too (end to end)
    cpu_started: float = 0.0
    cpu_ended: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    profile_path: str | None = None
    profile_timer: str = "wall"
    profiler: cProfile.Profile | None = None


_WINDOW = _Window()


def _on_task_prerun(sender: Any = None, **_: Any) -> None:
    """``task_prerun`` receiver, the same in every variant: the window starts with the first
    ``noop``."""
    if _WINDOW.started is None and getattr(sender, "name", None) == NOOP:
        if _WINDOW.profile_path:
            _WINDOW.profiler = (
                cProfile.Profile(time.thread_time)  # the worker's thread: its CPU, no waits
                if _WINDOW.profile_timer == "cpu"
                else cProfile.Profile()
            )
            _WINDOW.profiler.enable()
        _WINDOW.cpu_started = time.process_time()
        _WINDOW.started = time.perf_counter()


def _on_task_postrun(sender: Any = None, state: str | None = None, **_: Any) -> None:
    """``task_postrun`` receiver, the same in every variant: counts outcomes, and the window
    ends with the last ``noop``."""
    if getattr(sender, "name", None) == NOOP:
        _WINDOW.ended = time.perf_counter()
        _WINDOW.ended_monotonic = time.monotonic()
        _WINDOW.cpu_ended = time.process_time()
        _WINDOW.outcomes[state or "?"] += 1


def _report(report_key: str, broker_url: str) -> None:
    """Queued behind the calls: send the window's numbers to the harness, once, and start a new
    window for the calls queued next (the end-to-end half of the run)."""
    profiler, _WINDOW.profiler = _WINDOW.profiler, None
    if profiler is not None and _WINDOW.profile_path:
        profiler.disable()
        profiler.dump_stats(_WINDOW.profile_path)
        _WINDOW.profile_path = None  # one profile per worker: the worker-only half
    measurement = {
        "seconds": _WINDOW.ended - (_WINDOW.started or _WINDOW.ended),
        "ended_monotonic": _WINDOW.ended_monotonic,
        "cpu_seconds": _WINDOW.cpu_ended - _WINDOW.cpu_started,
        "outcomes": dict(_WINDOW.outcomes),
        "package": os.path.dirname(os.path.abspath(celery_redlock.__file__)),
    }
    _WINDOW.started = None
    _WINDOW.outcomes = Counter()
    client = redis.Redis.from_url(broker_url)
    try:
        client.rpush(report_key, json.dumps(measurement))
    finally:
        client.close()


def __getattr__(name: str) -> Any:
    """``app`` in a worker process (``celery -A bench_celery:app``): the app of the variant the
    harness chose in the environment, with the window's receivers connected."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _pin_from_environment()
    app = build_app(
        os.environ[VARIANT_VARIABLE],
        os.environ[BROKER_VARIABLE],
        os.environ[NODES_VARIABLE].split(","),
    )
    _WINDOW.profile_path = os.environ.get(PROFILE_VARIABLE) or None
    _WINDOW.profile_timer = os.environ.get(PROFILE_TIMER_VARIABLE) or "wall"
    signals.task_prerun.connect(_on_task_prerun, weak=False)
    signals.task_postrun.connect(_on_task_postrun, weak=False)
    globals()["app"] = app
    return app


# -- the lock client alone (``--lock-client``, its own process) -------------------------------


def run_lock_client(node_urls: list[str], pairs: int, output: Path) -> None:
    """``pairs`` times ``Redlock(urls).acquire`` + ``release`` on distinct resources; writes
    the wall and CPU seconds they took, and how many acquisitions failed, to ``output``."""
    _pin_from_environment()
    redlock = Redlock(node_urls)
    ttl = RedlockSettings.ttl  # what an app without redlock_ttl uses
    prefix = f"benchmark.client.{os.getpid()}."

    def pairs_of(resources: range) -> int:
        """Acquire and release each resource; return how many acquisitions failed."""
        failures = 0
        for index in resources:
            lock = redlock.acquire(f"{prefix}{index}", ttl)
            if lock is None:
                failures += 1
            else:
                redlock.release(lock)
        return failures

    pairs_of(range(-CLIENT_WARMUP, 0))  # connections, scripts loaded
    cpu_started = time.process_time()
    started = time.perf_counter()
    failures = pairs_of(range(pairs))
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    # Paced like tasks: a pause before each pair, as a worker does other work between two
    # locks; only the pairs are timed. Caches go cold and the node goes idle between pairs.
    paced_seconds = 0.0
    for index in range(pairs, pairs + pairs // 2):
        time.sleep(PACE_SECONDS)
        paced_started = time.perf_counter()
        failures += pairs_of(range(index, index + 1))
        paced_seconds += time.perf_counter() - paced_started
    redlock.close()
    measurement = {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "paced_seconds_per_pair": paced_seconds / max(1, pairs // 2),
        "outcomes": {"SUCCESS": pairs - failures, **({"held": failures} if failures else {})},
        "package": os.path.dirname(os.path.abspath(celery_redlock.__file__)),
    }
    output.write_text(json.dumps(measurement))


# -- the harness -------------------------------------------------------------------------------


class RunFailed(RuntimeError):
    """A run did not finish cleanly (timeout, a process gone, the wrong package imported)."""


class RunOutcomes(RunFailed):
    """Some calls of a run did not succeed (failed, retried, skipped, missing): worth a note, and
    a repeat of the run, rather than the end of the benchmark."""

    def __init__(self, variant: str, outcomes: dict[str, int], log_tail: str) -> None:
        super().__init__(f"{variant}: not every call succeeded: {outcomes}\n{log_tail}")
        self.variant = variant
        self.outcomes = outcomes


@dataclass(frozen=True)
class EndToEnd:
    """The end-to-end half of a worker run: calls per second from the first ``apply_async`` to
    the end of the last call, and the CPU microseconds per call of the producer (the harness,
    publishing), of the worker (its window) and of the lock nodes (publishing included)."""

    rate: float
    producer_cpu_us: float
    worker_cpu_us: float
    node_cpu_us: float


@dataclass(frozen=True)
class Sample:
    """One run: calls per second in the window, CPU microseconds per call of the worker (or the
    lock client) and of the lock nodes, and the machine's 1-minute load average at its start."""

    rate: float
    cpu_us: float
    node_cpu_us: float
    load: float
    node_bytes: float = 0.0  # lock node memory a worker run left, per call (workers only)
    paced_us: float = 0.0  # wall µs per pair paced like tasks (lock clients only)
    end_to_end: EndToEnd | None = None  # the end-to-end half of a worker run


LEFT_AFTER_SECONDS = 2.0
"""How long after a worker run the lock nodes' memory is read: what the run left on them, past
the second a released lock's fencing counter lives on."""


def _redis_memory_bytes(servers: RedisNodes) -> int:
    """The memory the servers use now (INFO ``used_memory``), after a SCAN of every key, which
    removes the keys that expired (Redis otherwise removes them gradually)."""
    total = 0
    for server in servers:
        client = server.client()
        try:
            for _ in client.scan_iter(count=1000):
                pass
            total += int(client.info("memory")["used_memory"])
        finally:
            client.close()
    return total


def _redis_cpu_seconds(servers: RedisNodes) -> float:
    """CPU time the servers have used so far (user + system, as their INFO reports it)."""
    total = 0.0
    for server in servers:
        client = server.client()
        try:
            cpu = client.info("cpu")
        finally:
            client.close()
        total += float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return total


@dataclass
class Benchmark:
    """What every run shares: the servers, the harness-side apps and the processes' setup."""

    broker: RedisServer
    nodes: RedisNodes
    directory: Path  # logs, lock client outputs, and the processes' working directory
    cpus: str
    candidate: Path | None
    profile_timer: str = "wall"
    end_to_end: bool = True  # each worker run also times calls from their first apply_async
    apps: dict[str, Celery] = field(default_factory=dict)
    runs: Iterator[int] = field(default_factory=itertools.count)
    next_argument: int = 0  # no two calls ever get the same arguments

    def app(self, variant: str) -> Celery:
        """The harness-side app of a variant, which publishes its calls."""
        if variant not in self.apps:
            self.apps[variant] = build_app(variant, self.broker.url, self.nodes.urls)
        return self.apps[variant]

    def python_path(self, variant: str) -> list[Path]:
        """The entries first on a process's path: the candidate's for candidate runs, and this
        script's directory (for ``celery -A bench_celery:app``)."""
        entries = [Path(__file__).resolve().parent]
        if variant.endswith(CANDIDATE):
            assert self.candidate is not None
            entries.insert(0, self.candidate)
        return entries

    def environment(self, variant: str, profile: Path | None) -> dict[str, str]:
        """The variables a worker or lock client process of ``variant`` gets."""
        return {
            VARIANT_VARIABLE: variant,
            BROKER_VARIABLE: self.broker.url,
            NODES_VARIABLE: ",".join(self.nodes.urls),
            CPUS_VARIABLE: self.cpus,
            PROFILE_VARIABLE: str(profile) if profile is not None else "",
            PROFILE_TIMER_VARIABLE: self.profile_timer,
        }

    def check_package(self, variant: str, package: str) -> None:
        """Raise unless the process imported the celery_redlock its variant is about."""
        expected = (
            self.candidate / "celery_redlock"
            if variant.endswith(CANDIDATE) and self.candidate is not None
            else Path(celery_redlock.__file__).resolve().parent
        )
        if Path(package).resolve() != expected.resolve():
            raise RunFailed(f"{variant}: the process imported {package}, not {expected}")

    def run(self, variant: str, calls: int, profile: Path | None = None) -> Sample:
        """One run of a worker variant or of a lock client."""
        if base_variant(variant) in LOCK_CLIENTS:
            return self.run_lock_client(variant, calls)
        return self.run_worker(variant, calls, profile, self.end_to_end)

    def run_worker(
        self, variant: str, calls: int, profile: Path | None, end_to_end: bool = True
    ) -> Sample:
        """Publish ``calls`` no-ops and a report to a fresh queue, then start a solo worker on it;
        with ``end_to_end``, then time ``calls`` more from their first ``apply_async``, that
        worker running. Return what its windows measured."""
        run = next(self.runs)
        queue = f"benchmark.{variant}.{run}"
        report_key = f"bench:report:{run}"
        app = self.app(variant)
        with app.producer_or_acquire() as producer:
            for argument in self.arguments(calls):
                app.tasks[NOOP].apply_async((argument,), queue=queue, producer=producer)
            app.tasks[REPORT].apply_async(
                (report_key, self.broker.url), queue=queue, producer=producer
            )
        load = os.getloadavg()[0]
        node_memory = _redis_memory_bytes(self.nodes)
        node_cpu = _redis_cpu_seconds(self.nodes)
        worker = CeleryWorker(
            f"{APP_MODULE}:app",
            f"bench-{variant}-{run}@localhost",
            pool="solo",
            concurrency=1,
            loglevel="WARNING",
            queues=[queue],
            environment=self.environment(variant, profile),
            python_path=self.python_path(variant),
            working_directory=self.directory,  # not the repository: the candidate must win
            log_path=self.directory / f"worker-{run}-{variant}.log",
        )
        control = self.broker.client(socket_timeout=10.0)
        timed: EndToEnd | None = None
        try:
            with celery_processes() as processes:
                processes.append(worker.start())
                reply = self._wait_for_report(control, report_key, worker)
                node_cpu = _redis_cpu_seconds(self.nodes) - node_cpu
                log_tail = worker.log_tail(10)
                measurement = json.loads(reply)
                self.check_outcomes(variant, measurement, calls, log_tail)
                if end_to_end:
                    timed = self.run_end_to_end(variant, calls, queue, f"{report_key}:e2e", worker)
                # The windows are over and every message acknowledged: no need to wait for a
                # warm shutdown (about a second here). SIGKILL to the worker's process group.
                worker.kill()
            control.delete(queue)
        finally:
            control.close()
        time.sleep(LEFT_AFTER_SECONDS)
        node_memory = _redis_memory_bytes(self.nodes) - node_memory
        return Sample(
            rate=calls / measurement["seconds"],
            cpu_us=measurement["cpu_seconds"] / calls * 1e6,
            node_cpu_us=node_cpu / calls * 1e6,
            load=load,
            node_bytes=node_memory / (calls * (2 if end_to_end else 1)),
            end_to_end=timed,
        )

    def run_end_to_end(
        self, variant: str, calls: int, queue: str, report_key: str, worker: CeleryWorker
    ) -> EndToEnd:
        """With ``worker`` idle on ``queue``: publish ``calls`` no-ops one ``apply_async`` at a
        time, as an application does (publish-time locks included), and a report; time them from
        the first ``apply_async`` to the end of the last call in the worker (both read the host's
        monotonic clock)."""
        app = self.app(variant)
        task = app.tasks[NOOP]
        arguments = self.arguments(calls)
        control = self.broker.client(socket_timeout=10.0)
        try:
            node_cpu = _redis_cpu_seconds(self.nodes)
            producer_cpu = time.process_time()
            started = time.monotonic()
            for argument in arguments:
                task.apply_async((argument,), queue=queue)
            producer_cpu = time.process_time() - producer_cpu
            app.tasks[REPORT].apply_async((report_key, self.broker.url), queue=queue)
            reply = self._wait_for_report(control, report_key, worker)
            node_cpu = _redis_cpu_seconds(self.nodes) - node_cpu
        finally:
            control.close()
        measurement = json.loads(reply)
        self.check_outcomes(variant, measurement, calls, worker.log_tail(10))
        return EndToEnd(
            rate=calls / (measurement["ended_monotonic"] - started),
            producer_cpu_us=producer_cpu / calls * 1e6,
            worker_cpu_us=measurement["cpu_seconds"] / calls * 1e6,
            node_cpu_us=node_cpu / calls * 1e6,
        )

    def arguments(self, calls: int) -> range:
        """Arguments for ``calls`` more calls: no two calls of the benchmark get the same."""
        first, self.next_argument = self.next_argument, self.next_argument + calls
        return range(first, first + calls)

    def check_outcomes(
        self, variant: str, measurement: dict[str, Any], calls: int, log_tail: str
    ) -> None:
        """Raise unless the worker imported the right package and every call succeeded."""
        self.check_package(variant, measurement["package"])
        if measurement["outcomes"] != {"SUCCESS": calls}:
            raise RunOutcomes(variant, measurement["outcomes"], log_tail)

    @staticmethod
    def _wait_for_report(control: redis.Redis, report_key: str, worker: CeleryWorker) -> str:
        """The report the worker sends at the end of its run (``RunFailed`` if it exits or
        takes too long first)."""
        deadline = time.monotonic() + RUN_TIMEOUT
        while time.monotonic() < deadline:
            reply = control.blpop([report_key], timeout=1)
            if reply is not None:
                value = reply[1]
                return value.decode() if isinstance(value, bytes) else str(value)
            try:
                worker.check_alive()
            except ProcessExitedError as error:
                raise RunFailed(str(error)) from None
        raise RunFailed(
            f"{worker.label}: no report within {RUN_TIMEOUT:.0f}s; end of its log:\n"
            f"{worker.log_tail()}"
        )

    def run_lock_client(self, variant: str, pairs: int) -> Sample:
        """The lock client alone, in its own process, ``pairs`` acquire + release pairs."""
        run = next(self.runs)
        output = self.directory / f"client-{run}-{variant}.json"
        urls = node_urls_of(variant, self.nodes.urls)
        process = ManagedProcess(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--lock-client",
                ",".join(urls),
                "--tasks",
                str(pairs),
                "--output",
                str(output),
            ],
            environment=self.environment(variant, None),
            python_path=self.python_path(variant)[:-1],  # the script's directory comes first
            working_directory=self.directory,
            log_path=self.directory / f"client-{run}-{variant}.log",
            label=variant,
        )
        load = os.getloadavg()[0]
        node_cpu = _redis_cpu_seconds(self.nodes)
        with celery_processes() as processes:
            processes.append(process.start())
            try:
                status = process.wait(RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise RunFailed(f"{variant}: not done within {RUN_TIMEOUT:.0f}s") from None
            node_cpu = _redis_cpu_seconds(self.nodes) - node_cpu
            if status != 0 or not output.is_file():
                raise RunFailed(f"{variant} exited with {status}:\n{process.log_tail()}")
        measurement = json.loads(output.read_text())
        self.check_package(variant, measurement["package"])
        if measurement["outcomes"] != {"SUCCESS": pairs}:
            raise RunOutcomes(variant, measurement["outcomes"], process.log_tail(10))
        # The nodes' CPU here includes the warm-up and the process's start and exit: small.
        return Sample(
            rate=pairs / measurement["seconds"],
            cpu_us=measurement["cpu_seconds"] / pairs * 1e6,
            node_cpu_us=node_cpu / pairs * 1e6,
            load=load,
            paced_us=measurement["paced_seconds_per_pair"] * 1e6,
        )


@dataclass
class Results:
    """Every measured run, by variant (workers and lock clients), in round order."""

    tasks: int
    warmup: int
    rounds: int
    cpus: str
    samples: dict[str, list[Sample]]
    orders: list[list[str]]
    failures: list[RunOutcomes]
    load_before: float
    load_after: float
    seconds: float = 0.0

    def workers(self) -> list[str]:
        """The worker variants, in the order of the table."""
        return [name for name in self.samples if base_variant(name) in VARIANTS]

    def clients(self) -> list[str]:
        """The lock client runs, in the order of the table."""
        return [name for name in self.samples if base_variant(name) in LOCK_CLIENTS]

    def median(self, variant: str, attribute: str = "rate") -> float:
        """The median over rounds of one of a variant's `Sample` attributes."""
        return float(
            statistics.median(getattr(sample, attribute) for sample in self.samples[variant])
        )

    def ratio(self, variant: str) -> float:
        """The variant's median rate over plain's."""
        return self.median(variant) / self.median(BASELINE)

    def timed_end_to_end(self) -> list[str]:
        """The worker variants whose every run timed its end-to-end half too."""
        return [
            variant
            for variant in self.workers()
            if all(sample.end_to_end is not None for sample in self.samples[variant])
        ]

    def end_to_end(self, variant: str, attribute: str = "rate") -> list[float]:
        """One `EndToEnd` attribute of each of the variant's runs, in round order."""
        return [
            getattr(sample.end_to_end, attribute)
            for sample in self.samples[variant]
            if sample.end_to_end is not None
        ]

    def end_to_end_median(self, variant: str, attribute: str = "rate") -> float:
        """The median over rounds of one of the variant's `EndToEnd` attributes."""
        return float(statistics.median(self.end_to_end(variant, attribute)))

    def end_to_end_overhead_us(self, variant: str) -> float:
        """Microseconds per call over plain end to end, from the median rates."""
        return (1 / self.end_to_end_median(variant) - 1 / self.end_to_end_median(BASELINE)) * 1e6

    def overhead_us(self, variant: str) -> float:
        """Microseconds per call over plain, from the median rates."""
        return (1 / self.median(variant) - 1 / self.median(BASELINE)) * 1e6

    def integrated(self) -> list[str]:
        """The ``@singleton_task`` variants whose lock client alone was measured too."""
        return [
            variant
            for variant in self.workers()
            if base_variant(variant) in CLIENT_OF and self.client_of(variant) in self.samples
        ]

    def client_of(self, variant: str) -> str:
        """The lock client run with the same nodes and the same package as ``variant``."""
        return CLIENT_OF[base_variant(variant)] + (CANDIDATE if variant.endswith(CANDIDATE) else "")

    def added_per_client_pair(self, variant: str) -> float:
        """What the integration adds per task over plain (wall time, from the median rates)
        divided by the lock client's own acquire + release (wall time per pair, from its median
        rate): 1.0x means ``@singleton_task`` costs a task exactly one lock client pair."""
        client_pair_us = 1e6 / self.median(self.client_of(variant))
        return self.overhead_us(variant) / client_pair_us

    def added_per_client_pair_by_round(self, variant: str) -> list[float]:
        """The same ratio computed within each round (its runs were minutes apart at most)."""
        return [
            (1 / own.rate - 1 / plain.rate) * alone.rate
            for own, plain, alone in zip(
                self.samples[variant],
                self.samples[BASELINE],
                self.samples[self.client_of(variant)],
                strict=True,
            )
        ]

    def integration_cpu_us(self, variant: str) -> list[float]:
        """Per round: the variant's worker CPU per call minus plain's minus its lock client's."""
        client = self.client_of(variant)
        return [
            own.cpu_us - plain.cpu_us - alone.cpu_us
            for own, plain, alone in zip(
                self.samples[variant], self.samples[BASELINE], self.samples[client], strict=True
            )
        ]


def run_benchmark(
    benchmark: Benchmark, variants: list[str], tasks: int, warmup: int, rounds: int, cpus: str
) -> Results:
    """Warm-up runs, then ``rounds`` rounds of every variant once, rotated every round."""
    samples: dict[str, list[Sample]] = {variant: [] for variant in variants}
    orders: list[list[str]] = []
    failures: list[RunOutcomes] = []
    load_before = os.getloadavg()[0]
    started = time.monotonic()

    def run(variant: str, calls: int) -> Sample:
        """One run; one whose calls did not all succeed is noted and run again."""
        for attempt in itertools.count(1):
            try:
                return benchmark.run(variant, calls)
            except RunOutcomes as failure:
                failures.append(failure)
                print(f"run failed, attempt {attempt}: {failure}", file=sys.stderr)
                if attempt == RUN_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    if warmup:
        for variant in variants:
            print(f"warming up {variant} ({warmup} calls)", file=sys.stderr)
            run(variant, warmup)
    for round_index in range(rounds):
        shift = round_index % len(variants)
        order = variants[shift:] + variants[:shift]
        orders.append(order)
        for variant in order:
            sample = run(variant, tasks)
            samples[variant].append(sample)
            timed = sample.end_to_end
            print(
                f"round {round_index + 1}/{rounds} {variant}: {sample.rate:,.0f}/s, CPU µs per "
                f"call: {sample.cpu_us:.0f}, lock nodes {sample.node_cpu_us:.0f}"
                + (f"; end to end {timed.rate:,.0f}/s" if timed is not None else "")
                + f" (load {sample.load:.1f})",
                file=sys.stderr,
            )
    return Results(
        tasks,
        warmup,
        rounds,
        cpus,
        samples,
        orders,
        failures,
        load_before,
        os.getloadavg()[0],
        time.monotonic() - started,
    )


def run_profiles(benchmark: Benchmark, variants: list[str], tasks: int, directory: Path) -> None:
    """One more run of every worker variant with cProfile on in the worker (not in the table)."""
    for variant in variants:
        if base_variant(variant) not in VARIANTS:
            continue
        path = directory / f"{variant}.pstats"
        print(f"profiling {variant} ({tasks} calls) into {path}", file=sys.stderr)
        benchmark.run_worker(variant, tasks, path, end_to_end=False)


# -- the report --------------------------------------------------------------------------------


def environment() -> dict[str, str]:
    """Versions and machine, for the report."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
        "celery": _version("celery"),
        "kombu": _version("kombu"),
        "redis-py": _version("redis"),
        "redis-server": server_version(find_redis_server()).removeprefix("Redis server "),
        "celery-redlock": f"{_version('celery-redlock')} from "
        f"{os.path.dirname(os.path.abspath(celery_redlock.__file__))}",
        "celery-singleton": _version("celery-singleton"),
        "celery-once": _version("celery-once"),
    }


def source_digest(package: Path) -> str:
    """A short digest of a package's Python sources, to tell which code a report measured
    (other people may be editing it while the benchmark runs)."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _spread(values: list[float], digits: int = 0) -> str:
    """``min - max`` of the values."""
    return f"{min(values):,.{digits}f} - {max(values):,.{digits}f}"


def markdown(results: Results) -> str:
    """The report: three tables, the checks of the targets, failures and the machine's load."""
    plural = "s" if "," in results.cpus else ""
    pinned = f"pinned to CPU{plural} {results.cpus}" if results.cpus else "not pinned"
    lines = [
        f"One worker per run: `-P solo -c 1` ({pinned}), started after its {results.tasks} "
        f"no-op calls were queued; first call's start to last call's end; "
        f"{results.rounds} interleaved rounds, medians over rounds.",
        "",
        "| variant | tasks/s | min - max | x plain | µs/task over plain "
        "| added / lock client pair | by round | worker CPU µs/task | lock nodes CPU µs/task "
        "| lock nodes bytes left/task |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    integrated = results.integrated()
    for variant in results.workers():
        rates = [sample.rate for sample in results.samples[variant]]
        overhead = "—" if variant == BASELINE else f"{results.overhead_us(variant):+.0f}"
        added, by_round = "—", "—"
        if variant in integrated:
            added = f"{results.added_per_client_pair(variant):.2f}x"
            by_round = _spread(results.added_per_client_pair_by_round(variant), 2)
        lines.append(
            f"| {label(variant)} | {results.median(variant):,.0f} | {_spread(rates)} | "
            f"{results.ratio(variant):.2f}x | {overhead} | {added} | {by_round} | "
            f"{results.median(variant, 'cpu_us'):.0f} | "
            f"{results.median(variant, 'node_cpu_us'):.0f} | "
            f"{results.median(variant, 'node_bytes'):.0f} |"
        )
    timed = results.timed_end_to_end()
    if BASELINE in timed:
        lines += [
            "",
            f"End to end, the same workers right after: {results.tasks} more calls, published "
            "one `apply_async` at a time while the worker runs (publish-time locks included), "
            "from the first `apply_async` to the last call's end.",
            "",
            "| variant, end to end | tasks/s | min - max | x plain | µs/task over plain "
            "| producer CPU µs/task | worker CPU µs/task | lock nodes CPU µs/task |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        plain_rate = results.end_to_end_median(BASELINE)
        for variant in timed:
            rate = results.end_to_end_median(variant)
            overhead = (
                "—" if variant == BASELINE else f"{results.end_to_end_overhead_us(variant):+.0f}"
            )
            lines.append(
                f"| {label(variant)} | {rate:,.0f} | {_spread(results.end_to_end(variant))} | "
                f"{rate / plain_rate:.2f}x | {overhead} | "
                f"{results.end_to_end_median(variant, 'producer_cpu_us'):.0f} | "
                f"{results.end_to_end_median(variant, 'worker_cpu_us'):.0f} | "
                f"{results.end_to_end_median(variant, 'node_cpu_us'):.0f} |"
            )
    if results.clients():
        lines += [
            "",
            "| lock client alone: `Redlock(urls).acquire` + `release` | pairs/s | wall µs/pair "
            "| client CPU µs/pair | lock nodes CPU µs/pair | wall µs/pair paced 1 ms apart |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for variant in results.clients():
            lines.append(
                f"| {label(variant)} | {results.median(variant):,.0f} | "
                f"{1e6 / results.median(variant):.0f} | {results.median(variant, 'cpu_us'):.0f} "
                f"| {results.median(variant, 'node_cpu_us'):.0f} "
                f"| {results.median(variant, 'paced_us'):.0f} |"
            )
    if integrated:
        lines += [
            "",
            "| integration CPU: worker CPU - plain's - the lock client's | µs/task (median) "
            "| min - max |",
            "|---|---:|---:|",
        ]
        for variant in integrated:
            values = results.integration_cpu_us(variant)
            lines.append(
                f"| {label(variant)} | {statistics.median(values):+.0f} | {_spread(values)} |"
            )
    lines.append("")
    for variant in results.workers():
        if base_variant(variant) not in TARGETS:
            continue
        ratio = results.ratio(variant)
        verdict = "PASS" if ratio >= TARGET_RATIO else "MISS"
        lines.append(
            f"- {verdict}: {label(variant)} at {ratio:.2f}x plain (target >= {TARGET_RATIO}x)"
        )
    for variant in integrated:
        added = results.added_per_client_pair(variant)
        verdict = "PASS" if added <= TARGET_ADDED_PER_CLIENT_PAIR else "MISS"
        lines.append(
            f"- {verdict}: {label(variant)} adds {results.overhead_us(variant):+.0f} µs per task "
            f"over plain, {added:.2f}x the lock client's own acquire + release "
            f"({1e6 / results.median(results.client_of(variant)):.0f} µs) "
            f"(target <= {TARGET_ADDED_PER_CLIENT_PAIR:.1f}x, issue 17)"
        )
        paced = results.median(results.client_of(variant), "paced_us")
        if paced > 0:
            lines.append(
                f"  - against the same pair paced like tasks ({paced:.0f} µs): "
                f"{results.overhead_us(variant) / paced:.2f}x"
            )
    for variant in integrated:
        value = statistics.median(results.integration_cpu_us(variant))
        verdict = "PASS" if value <= TARGET_INTEGRATION_CPU_US else "MISS"
        lines.append(
            f"- {verdict}: {label(variant)} integration CPU {value:.0f} µs per task "
            f"(target <= {TARGET_INTEGRATION_CPU_US:.0f} µs)"
        )
    for variant in integrated:
        left = results.median(variant, "node_bytes")
        verdict = "PASS" if left <= TARGET_BYTES_LEFT else "MISS"
        lines.append(
            f"- {verdict}: {label(variant)} leaves {left:.0f} bytes per task on the lock nodes "
            f"(target <= {TARGET_BYTES_LEFT:.0f}, issue 23)"
        )
    if "redlock-1" in results.samples and PEER in results.samples:
        ours, theirs = results.median("redlock-1"), results.median(PEER)
        verdict = "PASS" if ours >= theirs else "MISS"
        lines.append(
            f"- {verdict}: {label('redlock-1')} {ours:,.0f}/s vs {label(PEER)} {theirs:,.0f}/s "
            "(target: at least as fast, issue 23)"
        )
    timed = results.timed_end_to_end()
    if PEER in timed:
        theirs = results.end_to_end_median(PEER)
        for variant in timed:
            if base_variant(variant) != "redlock-1":
                continue
            ours = results.end_to_end_median(variant)
            verdict = "PASS" if ours >= theirs else "MISS"
            lines.append(
                f"- {verdict}: end to end, {label(variant)} {ours:,.0f}/s vs {label(PEER)} "
                f"{theirs:,.0f}/s (target: at least as fast, issue 40)"
            )
        if SHAPE in timed:
            shape = results.end_to_end_median(SHAPE)
            lines.append(
                f"  - the bare shape (issue 37) end to end: {shape:,.0f}/s, "
                f"{shape / theirs:.2f}x {label(PEER)}"
            )
            if "redlock-1" in timed:
                ours = results.end_to_end_median("redlock-1")
                lines.append(f"  - {label('redlock-1')} at {ours / shape:.2f}x the bare shape")
    if results.failures:
        lines.append("")
        lines.append(
            f"{len(results.failures)} run(s) were run again because not every call succeeded "
            "(a correctness problem, not noise):"
        )
        lines.extend(f"- {failure.variant}: {failure.outcomes}" for failure in results.failures)
    loads = [sample.load for samples in results.samples.values() for sample in samples]
    lines += [
        "",
        f"Load average (1 min): {results.load_before:.1f} before, {statistics.median(loads):.1f} "
        f"median at the runs' starts ({_spread(loads, 1)}), {results.load_after:.1f} after; "
        f"{os.cpu_count()} CPUs. Rounds took {results.seconds:.0f}s.",
    ]
    return "\n".join(lines)


def _candidate_path_entry(candidate: Path, stack: contextlib.ExitStack[Any]) -> Path:
    """A directory to put first on the candidate processes' path, so that ``import
    celery_redlock`` finds the candidate: DIR itself when it contains ``celery_redlock/``, else a
    temporary directory with a ``celery_redlock`` link to the package directory DIR."""
    candidate = candidate.resolve()
    if (candidate / "celery_redlock" / "__init__.py").is_file():
        return candidate
    entry = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-celery-cand-")))
    (entry / "celery_redlock").symlink_to(candidate, target_is_directory=True)
    return entry


def _json_document(results: Results, details: dict[str, str]) -> dict[str, Any]:
    """What ``--json`` writes: every sample, and the medians and ratios of the report."""

    def column(attribute: str) -> dict[str, list[float]]:
        """One `Sample` attribute of every run, by variant."""
        return {
            variant: [getattr(sample, attribute) for sample in samples]
            for variant, samples in results.samples.items()
        }

    integrated = results.integrated()
    return {
        "environment": details,
        "tasks": results.tasks,
        "warmup": results.warmup,
        "rounds": results.rounds,
        "cpus": results.cpus,
        "orders": results.orders,
        "rate_per_second": column("rate"),
        "cpu_us_per_call": column("cpu_us"),
        "lock_nodes_cpu_us_per_call": column("node_cpu_us"),
        "lock_nodes_bytes_left_per_call": column("node_bytes"),
        "lock_client_paced_us_per_pair": column("paced_us"),
        "load_average": column("load"),
        "end_to_end": {
            variant: {
                "rate_per_second": results.end_to_end(variant),
                "producer_cpu_us_per_call": results.end_to_end(variant, "producer_cpu_us"),
                "worker_cpu_us_per_call": results.end_to_end(variant, "worker_cpu_us"),
                "lock_nodes_cpu_us_per_call": results.end_to_end(variant, "node_cpu_us"),
            }
            for variant in results.timed_end_to_end()
        },
        "integration_cpu_us_per_task": {
            variant: results.integration_cpu_us(variant) for variant in integrated
        },
        "added_per_lock_client_pair": {
            variant: results.added_per_client_pair(variant) for variant in integrated
        },
        "added_per_lock_client_pair_by_round": {
            variant: results.added_per_client_pair_by_round(variant) for variant in integrated
        },
        "failed_runs": [
            {"variant": failure.variant, "outcomes": failure.outcomes}
            for failure in results.failures
        ],
        "median_rate": {variant: results.median(variant) for variant in results.samples},
        "ratio_to_plain": {variant: results.ratio(variant) for variant in results.workers()},
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; run the benchmark (or, internally, one lock client)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=3000, help="no-op calls per run")
    parser.add_argument(
        "--warmup", type=int, default=100, help="calls of the uncounted first run (0: none)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {', '.join(VARIANTS)} (plain is always included)",
    )
    parser.add_argument(
        "--cpus",
        default="",
        metavar="LIST",
        help="pin every worker and lock client to these CPUs (e.g. 1 or 0,1); default: not pinned",
    )
    parser.add_argument("--json", type=Path, help="also write the samples here")
    parser.add_argument(
        "--candidate",
        type=Path,
        metavar="DIR",
        help="a directory holding another celery_redlock package (a proposed change): adds "
        "redlock-1-candidate and redlock-5-candidate, whose workers import it, and their lock "
        "clients",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="after the rounds, run every variant once more with cProfile on in the worker "
        "(not in the table), into DIR/<variant>.pstats",
    )
    parser.add_argument(
        "--profile-timer",
        choices=("wall", "cpu"),
        default="wall",
        help="what --profile counts: wall-clock time (waits for Redis replies included, "
        "the default) or the worker thread's CPU time",
    )
    parser.add_argument(
        "--worker-only",
        action="store_true",
        help="skip the end-to-end half of every worker run (calls timed from their first "
        "apply_async, the worker running): only the worker-only table",
    )
    # Internal: the lock client alone, in its own process.
    parser.add_argument("--lock-client", metavar="URLS", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)

    if options.lock_client:
        run_lock_client(options.lock_client.split(","), options.tasks, options.output)
        return 0
    # SIGTERM unwinds like Ctrl-C: processes and redis-server are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # Celery reads these before its settings: a broker from the caller's environment must not
    # win over the benchmark's own, here or in the processes it starts.
    os.environ.pop("CELERY_BROKER_URL", None)
    os.environ.pop("CELERY_RESULT_BACKEND", None)

    workers = [BASELINE] + [
        name for name in options.variants.split(",") if name and name != BASELINE
    ]
    unknown = [name for name in workers if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    targets = [name for name in TARGETS if name in workers]
    variants = workers + [CLIENT_OF[name] for name in targets]
    if options.candidate is not None:
        if (
            not (options.candidate / "__init__.py").is_file()
            and not (options.candidate / "celery_redlock" / "__init__.py").is_file()
        ):
            parser.error(
                f"--candidate {options.candidate}: neither a package directory (with __init__.py) "
                "nor a directory containing celery_redlock/"
            )
        chosen = targets or list(TARGETS)
        variants += [name + CANDIDATE for name in chosen]
        variants += [CLIENT_OF[name] + CANDIDATE for name in chosen]
    if options.tasks < 1 or options.warmup < 0 or options.rounds < 1:
        parser.error("--tasks and --rounds must be at least 1, --warmup at least 0")
    if options.cpus:
        try:
            cpus = {int(cpu) for cpu in options.cpus.split(",")}
        except ValueError:
            parser.error(f"--cpus {options.cpus!r}: give CPU numbers separated by commas")
        if not cpus <= os.sched_getaffinity(0):
            parser.error(f"--cpus {options.cpus!r}: this process may use {os.sched_getaffinity(0)}")
    if options.profile is not None:
        options.profile.mkdir(parents=True, exist_ok=True)

    packages = {"celery_redlock": Path(celery_redlock.__file__).resolve().parent}
    if options.candidate is not None:
        packages["candidate"] = (
            options.candidate / "celery_redlock"
            if (options.candidate / "celery_redlock" / "__init__.py").is_file()
            else options.candidate
        ).resolve()
    digests = {name: source_digest(path) for name, path in packages.items()}
    started = time.monotonic()
    with (
        contextlib.ExitStack() as stack,
        tempfile.TemporaryDirectory(prefix="bench-celery-") as directory,
        RedisServer(extra_args=PRODUCTION_SERVER) as broker,
        RedisNodes(LOCK_NODES, extra_args=PRODUCTION_SERVER) as nodes,
    ):
        candidate = None
        if options.candidate is not None:
            candidate = _candidate_path_entry(options.candidate, stack)
        benchmark = Benchmark(
            broker,
            nodes,
            Path(directory),
            options.cpus,
            candidate,
            options.profile_timer,
            end_to_end=not options.worker_only,
        )
        results = run_benchmark(
            benchmark, variants, options.tasks, options.warmup, options.rounds, options.cpus
        )
        if options.profile is not None:
            run_profiles(benchmark, variants, options.tasks, options.profile)
    details = environment()
    if options.candidate is not None:
        details["candidate"] = str(options.candidate.resolve())
    warnings = []
    for name, path in packages.items():
        digest = source_digest(path)
        details[f"{name} sources sha256"] = digest
        if digest != digests[name]:
            details[f"{name} sources sha256"] = f"{digests[name]} at the start, {digest} at the end"
            warnings.append(
                f"WARNING: {name}'s sources ({path}) changed during the benchmark: later runs "
                "measured other code than earlier ones; run it again."
            )
    print()
    print(markdown(results))
    if warnings:
        print("\n" + "\n".join(warnings))
    print()
    print(
        "Environment: " + ", ".join(f"{name} {value}" for name, value in details.items()),
        f"\nTotal time: {time.monotonic() - started:.0f}s",
    )
    if options.profile is not None:
        print(
            f"Profiles of one more run of each worker variant: {options.profile}/<variant>.pstats"
        )
    if options.json is not None:
        options.json.write_text(json.dumps(_json_document(results, details), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
