"""A worker fleet on one machine: 8 ``celery worker -P threads -c 50`` against 5 lock nodes.

Run from the repository root::

    python benchmarks/bench_fleet.py                  # defaults: about two minutes on 2 CPUs
    python benchmarks/bench_fleet.py --tasks 3000     # a quick look
    python benchmarks/bench_fleet.py --node-timeout 0.5 --on-duplicate retry
    python benchmarks/bench_fleet.py --json fleet.json

Six fresh ``redis-server`` processes are started on free ports of 127.0.0.1 through
``celery_redlock.testing`` (never a Redis you already run): one broker and five lock nodes. Then:

1. ``--tasks`` calls of one ``@singleton_task`` are published to a queue nobody consumes yet:
   ``work(key, milliseconds)`` sleeps 5 to 20 ms; ``key`` is one of 200 (``lock_args=("key",)``,
   so the lock is per key) and ``on_duplicate="wait"``: a run whose key is held blocks in its
   worker thread until the holder's release wakes it (a Redis pub/sub notification), which is
   what makes lock waits happen: with 400 threads on 200 keys, most keys have a waiter. (With
   ``"retry"`` a duplicate would go back through the broker with a countdown of a second or
   more, and ``waited`` would only show the acquisition of the run that finally gets the lock.)
   Keys and durations are drawn from a seeded random generator (``--seed``);
2. eight real workers start (``celery_redlock.testing.CeleryWorker``: ``-P threads -c 50``, no
   gossip, mingle or heartbeat, log level WARNING, Celery's default prefetch) on an idle queue;
   once all eight answer ``ping``, the lock nodes' counters are read and every worker is told
   to consume the task queue at once (``app.control.add_consumer``), so that no worker starts
   ahead of the others while the rest are still importing;
3. inside each worker, receivers of ``task_prerun``, ``task_postrun``, ``lock_acquired`` and
   ``lock_duplicate`` keep counts, the first start and last end, and every ``waited`` of
   ``lock_acquired`` (seconds from the start of the task's ``__call__`` to the lock acquired,
   waiting for the holder included); a thread sends them to the broker Redis four times a
   second (never to the lock nodes);
4. meanwhile the harness samples ``CLIENT LIST`` on every lock node twice a second;
5. once every call has finished (SUCCESS or FAILURE; calls run with ``max_retries=None``), or
   after ``--timeout`` seconds (then the report says so and covers the calls that finished), the
   lock nodes' counters are read again and the workers are killed.

The workers use the library's ``redlock_node_timeout`` unless ``--node-timeout`` gives another:
on a machine this small, replies that arrive in time often reach their thread too late for
50 ms, so nodes get skipped and rounds end as split votes (see benchmarks/README.md).

Reported: tasks per second from the first call's start to the last call's end; p50, p99 and max
lock wait; connections per lock node during the run (median and most of the samples, and how
many of them are pub/sub subscriptions); and the CPU each lock node spent (``used_cpu_sys +
used_cpu_user`` from ``INFO cpu``, after minus before) per command, per ``EVALSHA`` and per task,
with the commands per task from ``INFO commandstats``; the workers' CPU per task (from /proc);
then the same figures extrapolated, on paper, to 1,000 workers of this shape.

Every process shares this machine: broker, lock nodes and 400 worker threads compete for its
CPUs, so the throughput is that of this machine, not of the library. The report names the
machine. It always exits 0 when the benchmark itself ran: it is a report, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from benchmark_support import PRODUCTION_SERVER, cpu_model, percentile, server_version
from celery import Celery, signals

import celery_redlock
from celery_redlock import Redlock, singleton_task
from celery_redlock import signals as lock_signals
from celery_redlock.testing import (
    CeleryWorker,
    ProcessExitedError,
    RedisNodes,
    RedisServer,
    celery_processes,
    find_redis_server,
    wait_for_workers,
)

WORKERS = 8
THREADS = 50
LOCK_NODES = 5
KEYS = 200
SHORTEST_MS, LONGEST_MS = 5.0, 20.0
ON_DUPLICATE = "wait"  # the default of --on-duplicate
TASK = "fleet.work"
TASK_QUEUE = "fleet.tasks"
IDLE_QUEUE = "fleet.idle"
APP_MODULE = Path(__file__).stem  # the workers run ``celery -A bench_fleet:app``

# Environment of a worker process, and where workers report in the broker Redis.
BROKER_VARIABLE = "BENCH_FLEET_BROKER"
NODES_VARIABLE = "BENCH_FLEET_NODES"
ON_DUPLICATE_VARIABLE = "BENCH_FLEET_ON_DUPLICATE"
NODE_TIMEOUT_VARIABLE = "BENCH_FLEET_NODE_TIMEOUT"
WAITED_KEY = "bench-fleet:waited"  # a list: every ``waited``, in seconds
SUMMARY_KEY = "bench-fleet:summary"  # a hash: process id -> JSON counts
FINAL_STATES = ("SUCCESS", "FAILURE")
FLUSH_INTERVAL = 0.25  # seconds between two reports of a worker
SAMPLE_INTERVAL = 0.5  # seconds between two CLIENT LIST samples
EXTRAPOLATED_WORKERS = 1000
CLUSTER_MASTERS = 3  # "one group against a 3-master cluster per node"


# -- the app (built the same way in the harness, which publishes, and in each worker) ---------


def work(key: int, milliseconds: float) -> None:
    """The measured task: a short piece of work on ``key``."""
    time.sleep(milliseconds / 1000)


def build_app(
    broker_url: str, node_urls: list[str], on_duplicate: str, node_timeout: float | None
) -> Celery:
    """The fleet's app: ``work`` as a singleton task per key (``node_timeout``: the
    ``redlock_node_timeout`` setting, None for the library's default)."""
    app = Celery("bench_fleet", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        redlock_urls=node_urls,
    )
    if node_timeout is not None:
        app.conf.redlock_node_timeout = node_timeout
    # max_retries=None: a call re-queued by "retry" (or by "wait" after lock_wait) runs in the
    # end instead of failing after three retries; the benchmark measures work done.
    singleton_task(
        app=app,
        name=TASK,
        ignore_result=True,
        lock_args=("key",),
        on_duplicate=on_duplicate,
        max_retries=None,
    )(work)
    return app


# -- inside a worker ----------------------------------------------------------------------


@dataclass
class _Tally:
    """What one worker process saw, sent to the broker Redis by `_flush_forever`."""

    guard: threading.Lock = field(default_factory=threading.Lock)
    waited: list[float] = field(default_factory=list)  # not yet sent
    waits_seen: int = 0
    states: Counter[str] = field(default_factory=Counter)
    duplicates: Counter[str] = field(default_factory=Counter)
    first_start: float | None = None  # time.time(): comparable across processes
    last_end: float = 0.0


_TALLY = _Tally()


def _on_prerun(sender: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) == TASK and _TALLY.first_start is None:
        with _TALLY.guard:
            if _TALLY.first_start is None:
                _TALLY.first_start = time.time()


def _on_postrun(sender: Any = None, state: str | None = None, **_: Any) -> None:
    if getattr(sender, "name", None) == TASK:
        now = time.time()
        with _TALLY.guard:
            _TALLY.states[state or "?"] += 1
            _TALLY.last_end = max(_TALLY.last_end, now)


def _on_lock_acquired(sender: Any = None, waited: float = 0.0, **_: Any) -> None:
    with _TALLY.guard:
        _TALLY.waited.append(waited)
        _TALLY.waits_seen += 1


def _on_lock_duplicate(sender: Any = None, policy: str = "?", **_: Any) -> None:
    with _TALLY.guard:
        _TALLY.duplicates[policy] += 1


def _flush_forever(broker_url: str) -> None:
    """Send the tally to the broker Redis every `FLUSH_INTERVAL` seconds (a daemon thread)."""
    client = redis.Redis.from_url(broker_url, socket_timeout=10.0)
    field_name = str(os.getpid())
    while True:
        time.sleep(FLUSH_INTERVAL)
        with _TALLY.guard:
            batch, _TALLY.waited = _TALLY.waited, []
            summary = {
                "states": dict(_TALLY.states),
                "duplicates": dict(_TALLY.duplicates),
                "first_start": _TALLY.first_start,
                "last_end": _TALLY.last_end,
                "waits_seen": _TALLY.waits_seen,
                "package": os.path.dirname(os.path.abspath(celery_redlock.__file__)),
            }
        try:
            with client.pipeline(transaction=False) as pipeline:
                if batch:
                    pipeline.rpush(WAITED_KEY, *(repr(value) for value in batch))
                pipeline.hset(SUMMARY_KEY, field_name, json.dumps(summary))
                pipeline.execute()
        except redis.RedisError:
            with _TALLY.guard:
                _TALLY.waited[:0] = batch  # try again next time


def __getattr__(name: str) -> Any:
    """``app`` in a worker process (``celery -A bench_fleet:app``): the fleet's app, with the
    tally's receivers connected and its reporting thread started."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    broker_url = os.environ[BROKER_VARIABLE]
    node_timeout = os.environ.get(NODE_TIMEOUT_VARIABLE)
    app = build_app(
        broker_url,
        os.environ[NODES_VARIABLE].split(","),
        os.environ[ON_DUPLICATE_VARIABLE],
        float(node_timeout) if node_timeout else None,
    )
    signals.task_prerun.connect(_on_prerun, weak=False)
    signals.task_postrun.connect(_on_postrun, weak=False)
    lock_signals.lock_acquired.connect(_on_lock_acquired, weak=False)
    lock_signals.lock_duplicate.connect(_on_lock_duplicate, weak=False)
    threading.Thread(
        target=_flush_forever, args=(broker_url,), name="bench-fleet-report", daemon=True
    ).start()
    globals()["app"] = app
    return app


# -- the harness: the lock nodes' counters ------------------------------------------------


@dataclass(frozen=True)
class NodeCounters:
    """One lock node's counters at one moment: CPU seconds, commands, calls per command."""

    cpu_seconds: float
    commands: int
    calls: dict[str, int]  # command name (lower case) -> calls
    command_usec: dict[str, int]  # command name -> microseconds spent executing it

    @classmethod
    def read(cls, client: redis.Redis) -> NodeCounters:
        """Read them from ``INFO cpu``, ``INFO stats`` and ``INFO commandstats``."""
        cpu = client.info("cpu")
        stats = client.info("stats")
        commandstats = client.info("commandstats")
        calls, usec = {}, {}
        for key, value in commandstats.items():
            command = key.removeprefix("cmdstat_")
            calls[command] = int(value["calls"])
            usec[command] = int(value["usec"])
        return cls(
            float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            int(stats["total_commands_processed"]),
            calls,
            usec,
        )

    def minus(self, before: NodeCounters) -> NodeCounters:
        """What happened between ``before`` and this reading."""
        return NodeCounters(
            self.cpu_seconds - before.cpu_seconds,
            self.commands - before.commands,
            {
                name: count - before.calls.get(name, 0)
                for name, count in self.calls.items()
                if count - before.calls.get(name, 0)
            },
            {
                name: spent - before.command_usec.get(name, 0)
                for name, spent in self.command_usec.items()
                if spent - before.command_usec.get(name, 0)
            },
        )


@dataclass
class ConnectionSample:
    """Connections one node held at one moment (the observer's own left out)."""

    total: int
    subscribed: int  # of which pub/sub subscriptions


class ConnectionSampler:
    """A thread counting every lock node's clients (``CLIENT LIST``) every `SAMPLE_INTERVAL`."""

    def __init__(self, observers: Sequence[redis.Redis]) -> None:
        self._observers = observers
        self._own = [observer.client_id() for observer in observers]
        self.samples: list[list[ConnectionSample]] = [[] for _ in observers]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-fleet-sampler", daemon=True)

    def start(self) -> None:
        """Start sampling."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (one last sample is taken first)."""
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            for index, observer in enumerate(self._observers):
                with contextlib.suppress(redis.RedisError):
                    clients = [
                        client
                        for client in observer.client_list()
                        if int(client["id"]) != self._own[index]
                    ]
                    subscribed = sum(
                        1
                        for client in clients
                        if int(client.get("sub", 0)) or int(client.get("psub", 0))
                    )
                    self.samples[index].append(ConnectionSample(len(clients), subscribed))
            if self._stop.wait(SAMPLE_INTERVAL):
                return


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its reaped children (from /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    # After the command name: state is field 3, utime 14, stime 15, cutime 16, cstime 17.
    return sum(int(value) for value in fields[11:15]) / ticks


# -- the harness: one run -------------------------------------------------------------------


@dataclass
class FleetResult:
    """What one fleet run measured."""

    settings: FleetSettings
    seconds: float  # first call's start to last call's end
    waited: list[float]
    states: Counter[str]
    duplicates: Counter[str]
    nodes: list[NodeCounters]  # deltas over the run, per node
    connections: list[list[ConnectionSample]]  # samples, per node
    worker_cpu_seconds: float | None
    startup_seconds: float
    packages: set[str]
    complete: bool
    timeout_note: str = ""
    bare_pair_node_cpu_us: float = 0.0  # median node CPU per uncontended acquire + release

    @property
    def tasks(self) -> int:
        """The calls queued."""
        return self.settings.tasks

    @property
    def rate(self) -> float:
        """Tasks (succeeded) per second, first start to last end."""
        return self.states.get("SUCCESS", 0) / self.seconds if self.seconds > 0 else 0.0


def publish(app: Celery, tasks: int, seed: int) -> None:
    """Queue ``tasks`` calls of ``work`` on random keys with random durations."""
    generator = random.Random(seed)
    task = app.tasks[TASK]
    with app.producer_or_acquire() as producer:
        for _ in range(tasks):
            task.apply_async(
                (generator.randrange(KEYS), round(generator.uniform(SHORTEST_MS, LONGEST_MS), 2)),
                queue=TASK_QUEUE,
                producer=producer,
            )


def read_tallies(control: redis.Redis) -> list[dict[str, Any]]:
    """Every worker's latest tally."""
    return [json.loads(value) for value in control.hvals(SUMMARY_KEY)]


@dataclass(frozen=True)
class FleetSettings:
    """What one fleet run is asked to do."""

    tasks: int
    seed: int
    timeout: float  # seconds the workers may take to drain the queue
    on_duplicate: str
    node_timeout: float | None  # redlock_node_timeout; None: the library's default
    loglevel: str
    log_directory: Path | None  # where the workers' logs stay, if anywhere
    busy: int = 0  # busy processes beside the fleet (a noisy neighbour)


def run_fleet(
    broker: RedisServer, nodes: RedisNodes, settings: FleetSettings, directory: Path
) -> FleetResult:
    """Publish, start the workers, let them drain the queue, and collect what they saw."""
    tasks, timeout = settings.tasks, settings.timeout
    app = build_app(broker.url, nodes.urls, settings.on_duplicate, settings.node_timeout)
    control = broker.client(socket_timeout=10.0)
    observers = [server.client(socket_timeout=10.0) for server in nodes]
    logs = settings.log_directory or directory
    try:
        control.delete(WAITED_KEY, SUMMARY_KEY)
        print(f"publishing {tasks} tasks", file=sys.stderr, flush=True)
        publish(app, tasks, settings.seed)
        environment = {
            BROKER_VARIABLE: broker.url,
            NODES_VARIABLE: ",".join(nodes.urls),
            ON_DUPLICATE_VARIABLE: settings.on_duplicate,
            NODE_TIMEOUT_VARIABLE: ""
            if settings.node_timeout is None
            else str(settings.node_timeout),
        }
        workers = [
            CeleryWorker(
                f"{APP_MODULE}:app",
                f"fleet-{index}@localhost",
                pool="threads",
                concurrency=THREADS,
                loglevel=settings.loglevel,
                queues=[IDLE_QUEUE],
                environment=environment,
                python_path=[Path(__file__).resolve().parent],
                working_directory=directory,
                log_path=logs / f"worker-{index}.log",
            )
            for index in range(WORKERS)
        ]
        with celery_processes(remove_logs=settings.log_directory is None) as processes:
            started = time.monotonic()
            for worker in workers:
                processes.append(worker.start())
            wait_for_workers(app, workers, timeout=180.0)
            startup = time.monotonic() - started
            print(f"{WORKERS} workers ready in {startup:.1f} s", file=sys.stderr, flush=True)
            cpu_before = [process_cpu_seconds(worker.pid) for worker in workers]
            before = [NodeCounters.read(observer) for observer in observers]
            sampler = ConnectionSampler(observers)
            sampler.start()
            try:
                _consume_everywhere(app, workers)
                complete, note = _wait_for_all(control, workers, tasks, timeout)
            finally:
                sampler.stop()
            after = [NodeCounters.read(observer) for observer in observers]
            cpu_after = [process_cpu_seconds(worker.pid) for worker in workers]
            time.sleep(FLUSH_INTERVAL * 2)  # the last waits reach the broker
            tallies = read_tallies(control)
            waited = [float(value) for value in control.lrange(WAITED_KEY, 0, -1)]
            for worker in workers:
                worker.kill()
    finally:
        control.close()
        for observer in observers:
            observer.close()
    states: Counter[str] = Counter()
    duplicates: Counter[str] = Counter()
    for tally in tallies:
        states.update(tally["states"])
        duplicates.update(tally["duplicates"])
    starts = [tally["first_start"] for tally in tallies if tally["first_start"] is not None]
    ends = [tally["last_end"] for tally in tallies if tally["last_end"]]
    worker_cpu = None
    if all(value is not None for value in cpu_before + cpu_after):
        worker_cpu = sum(
            (after_value or 0.0) - (before_value or 0.0)
            for after_value, before_value in zip(cpu_after, cpu_before, strict=True)
        )
    return FleetResult(
        settings=settings,
        seconds=(max(ends) - min(starts)) if starts and ends else 0.0,
        waited=waited,
        states=states,
        duplicates=duplicates,
        nodes=[a.minus(b) for a, b in zip(after, before, strict=True)],
        connections=sampler.samples,
        worker_cpu_seconds=worker_cpu,
        startup_seconds=startup,
        packages={tally["package"] for tally in tallies},
        complete=complete,
        timeout_note=note,
    )


TARGET_NODE_CPU_RATIO = 1.5  # issue 23: a task costs a node at most this many bare lock pairs
BARE_PAIRS = 2000
"""Uncontended acquire + release pairs of the bare lock client, after the fleet, on its nodes."""


def bare_pair_node_cpu_us(nodes: RedisNodes, node_timeout: float | None) -> float:
    """The lock nodes' CPU per uncontended ``Redlock.acquire`` + ``release`` pair (distinct
    resources, released with confirmation), median over the nodes: the lock's own cost, which a
    task is compared with."""
    options = {} if node_timeout is None else {"node_timeout": node_timeout}
    redlock = Redlock(nodes.urls, **options)
    observers = [server.client(socket_timeout=10.0) for server in nodes]
    try:
        for index in range(100):  # connections and scripts loaded before the count starts
            lock = redlock.acquire(f"bare-warm-{index}", ttl=60)
            if lock is not None:
                redlock.release(lock)
        before = [NodeCounters.read(observer) for observer in observers]
        for index in range(BARE_PAIRS):
            lock = redlock.acquire(f"bare-{index}", ttl=60)
            if lock is not None:
                redlock.release(lock)
        after = [NodeCounters.read(observer) for observer in observers]
    finally:
        redlock.close()
        for observer in observers:
            observer.close()
    return statistics.median(
        (a.cpu_seconds - b.cpu_seconds) / BARE_PAIRS * 1e6
        for a, b in zip(after, before, strict=True)
    )


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes that spin on a CPU each until the block ends: a noisy neighbour."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def _consume_everywhere(app: Celery, workers: Sequence[CeleryWorker]) -> None:
    """Tell every worker to consume the task queue, and make sure each one did."""
    waiting = {worker.hostname for worker in workers}
    deadline = time.monotonic() + 60
    while waiting and time.monotonic() < deadline:
        replies = app.control.add_consumer(
            TASK_QUEUE, destination=sorted(waiting), reply=True, timeout=2.0
        )
        for reply in replies or []:
            waiting -= set(reply)
    if waiting:
        raise RuntimeError(f"workers {sorted(waiting)} did not start consuming {TASK_QUEUE}")


def _wait_for_all(
    control: redis.Redis, workers: Sequence[CeleryWorker], tasks: int, timeout: float
) -> tuple[bool, str]:
    """Wait until every call has finished, SUCCESS or FAILURE (or ``timeout`` seconds pass);
    RETRY and IGNORED are not final: the call was published again."""
    deadline = time.monotonic() + timeout
    last_report = time.monotonic()
    done = 0
    while time.monotonic() < deadline:
        time.sleep(FLUSH_INTERVAL)
        done = sum(
            tally["states"].get(state, 0)
            for tally in read_tallies(control)
            for state in FINAL_STATES
        )
        if done >= tasks:
            return True, ""
        for worker in workers:
            try:
                worker.check_alive()
            except ProcessExitedError as error:
                return False, f"a worker exited: {error}"
        if time.monotonic() - last_report >= 10:
            last_report = time.monotonic()
            print(f"  {done}/{tasks} done", file=sys.stderr, flush=True)
    return False, (
        f"only {done} of {tasks} calls finished within {timeout:.0f} s (--timeout); the "
        "figures are over the calls that finished, and the lock waits leave out the calls "
        "still waiting"
    )


# -- the report -----------------------------------------------------------------------------


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def machine() -> str:
    """The CPU model and count, and the memory, of this machine."""
    memory = ""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("MemTotal:"):
                memory = f", {int(line.split()[1]) / 1024 / 1024:.1f} GiB RAM"
                break
    return f"{os.cpu_count()} CPUs ({cpu_model()}){memory}, {platform.platform()}"


def markdown(result: FleetResult, load_before: float, load_after: float, took: float) -> str:
    """The report."""
    waited = result.waited
    node_timeout = (
        "the default (0.05 s)"
        if result.settings.node_timeout is None
        else f"{result.settings.node_timeout:g} s"
    )
    lines = [
        f"## A fleet on one machine: {WORKERS} workers x `-P threads -c {THREADS}`, "
        f"{LOCK_NODES} lock nodes",
        "",
        f"{result.tasks:,} `@singleton_task` calls (sleep {SHORTEST_MS:g}-{LONGEST_MS:g} ms) on "
        f'{KEYS} keys, `on_duplicate="{result.settings.on_duplicate}"`, '
        f"`redlock_node_timeout` {node_timeout}, {result.settings.busy} busy processes beside "
        "the fleet, queued before the workers started; first "
        "call's start to last call's end. Lock wait: `waited` of `lock_acquired`, from the start "
        "of the task's `__call__` to its lock acquired.",
        "",
        "| tasks/s | window | lock wait p50 | p99 | max | runs that waited for a holder | states |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    states = ", ".join(f"{state} {count:,}" for state, count in sorted(result.states.items()))
    waits = sum(result.duplicates.values())
    duplicate_detail = ", ".join(
        f"{policy} {count:,}" for policy, count in sorted(result.duplicates.items())
    )
    if waited:
        lines.append(
            f"| {result.rate:,.0f} | {result.seconds:.1f} s "
            f"| {_milliseconds(percentile(waited, 0.5))} "
            f"| {_milliseconds(percentile(waited, 0.99))} | {_milliseconds(max(waited))} "
            f"| {waits:,} ({duplicate_detail or 'none'}) | {states} |"
        )
    else:
        lines.append(f"| {result.rate:,.0f} | {result.seconds:.1f} s | — | — | — | — | {states} |")
    lines += [
        "",
        "Per lock node, over the run (connections: `CLIENT LIST` every "
        f"{SAMPLE_INTERVAL:g} s, the observer's own left out; CPU: `used_cpu_sys + used_cpu_user` "
        "of `INFO cpu`, after minus before):",
        "",
        "| node | connections median | most | of which pub/sub (most) | CPU s | commands "
        "| CPU µs/command | EVALSHA | CPU µs/EVALSHA | EVALSHA own µs | CPU µs/task "
        "| commands/task |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    tasks_done = max(1, result.states.get("SUCCESS", 0))
    for index, (counters, samples) in enumerate(zip(result.nodes, result.connections, strict=True)):
        totals = [sample.total for sample in samples] or [0]
        subscribed = [sample.subscribed for sample in samples] or [0]
        evalsha = counters.calls.get("evalsha", 0)
        own = counters.command_usec.get("evalsha", 0) / evalsha if evalsha else None
        per_task = ", ".join(
            f"{name} {count / tasks_done:.2f}"
            for name, count in sorted(counters.calls.items(), key=lambda item: -item[1])
            if count / tasks_done >= 0.01
        )
        lines.append(
            f"| {index} | {statistics.median(totals):,.0f} | {max(totals):,} "
            f"| {max(subscribed):,} | {counters.cpu_seconds:.2f} | {counters.commands:,} "
            f"| {counters.cpu_seconds / max(1, counters.commands) * 1e6:.1f} | {evalsha:,} "
            f"| {counters.cpu_seconds / evalsha * 1e6 if evalsha else 0:.1f} "
            f"| {'—' if own is None else f'{own:.1f}'} "
            f"| {counters.cpu_seconds / tasks_done * 1e6:.1f} | {per_task} |"
        )
    node_cpu_per_task = statistics.median(
        [counters.cpu_seconds / tasks_done * 1e6 for counters in result.nodes]
    )
    most_connections = max(
        (max(sample.total for sample in samples) for samples in result.connections if samples),
        default=0,
    )
    per_process = most_connections / WORKERS
    bare = result.bare_pair_node_cpu_us
    if bare > 0:
        ratio = node_cpu_per_task / bare
        verdict = "PASS" if ratio <= TARGET_NODE_CPU_RATIO else "MISS"
        lines += [
            "",
            f"The bare lock client on the same nodes afterwards ({BARE_PAIRS:,} uncontended "
            f"`acquire` + `release` pairs): {bare:.1f} µs of node CPU per pair per node. A task: "
            f"{node_cpu_per_task:.1f} µs, {ratio:.2f}x.",
            f"- {verdict}: node CPU per task at most {TARGET_NODE_CPU_RATIO}x the bare lock "
            "pair's (issue 23)",
        ]
    lines += [""]
    if result.worker_cpu_seconds is not None:
        lines.append(
            f"Workers: {result.worker_cpu_seconds:.1f} CPU s in all, "
            f"{result.worker_cpu_seconds / tasks_done * 1e6:,.0f} µs per task (from /proc; "
            f"the run only, not the start-up of {result.startup_seconds:.1f} s)."
        )
    fleet_rate = result.rate / WORKERS * EXTRAPOLATED_WORKERS
    cores = node_cpu_per_task * fleet_rate / 1e6
    lines += [
        "",
        f"On paper, {EXTRAPOLATED_WORKERS:,} workers of this shape (`-P threads -c {THREADS}`): "
        f"{per_process:.1f} connections per worker process per node (the most sampled, / "
        f"{WORKERS}) make {per_process * EXTRAPOLATED_WORKERS:,.0f} connections per lock node "
        "(Redis's default `maxclients` is 10,000). At this run's rate per worker "
        f"({result.rate / WORKERS:,.0f} tasks/s, bounded by this machine) the fleet would run "
        f"{fleet_rate:,.0f} tasks/s; at {node_cpu_per_task:.0f} µs of node CPU per task, each lock "
        f"node would need {cores:,.1f} CPU cores (one core per "
        f"{1e6 / node_cpu_per_task:,.0f} tasks/s). With each lock node a "
        f"{CLUSTER_MASTERS}-master Redis Cluster, the keys spread over the masters: about "
        f"{cores / CLUSTER_MASTERS:,.1f} cores per master, while every process still connects "
        f"to every master: {per_process * EXTRAPOLATED_WORKERS:,.0f} connections per master.",
    ]
    lines += [
        "",
        "States are those of `task_postrun`: RETRY is a call the policy sent back to the broker "
        "(it runs again later), IGNORED a delivery celery_redlock deferred (published again "
        "with a countdown: a split vote after a wait, or a copy of a running attempt); only "
        "SUCCESS and FAILURE are final.",
    ]
    if not result.complete:
        lines += ["", f"WARNING: the run did not finish: {result.timeout_note}."]
    if len(result.packages) > 1:
        lines += ["", f"WARNING: the workers imported different packages: {result.packages}"]
    lines += [
        "",
        f"Machine: {machine()}; everything (broker, {LOCK_NODES} lock nodes, {WORKERS} workers x "
        f"{THREADS} threads, the harness) on it. Load average (1 min) {load_before:.1f} before, "
        f"{load_after:.1f} after. Python {platform.python_version()}, celery "
        f"{importlib.metadata.version('celery')}, redis-py {importlib.metadata.version('redis')}, "
        f"{server_version(find_redis_server())}; celery_redlock from "
        f"{', '.join(sorted(result.packages)) or '?'}. Workers ready in "
        f"{result.startup_seconds:.1f} s; took {took:.0f} s in all.",
    ]
    return "\n".join(lines)


def to_json(result: FleetResult) -> dict[str, Any]:
    """The raw numbers."""
    settings = {
        name: str(value) if isinstance(value, Path) else value
        for name, value in result.settings.__dict__.items()
    }
    return {
        "settings": settings,
        "tasks": result.tasks,
        "seconds": result.seconds,
        "rate": result.rate,
        "states": dict(result.states),
        "duplicates": dict(result.duplicates),
        "waited_seconds": result.waited,
        "nodes": [counters.__dict__ for counters in result.nodes],
        "connections": [[sample.__dict__ for sample in samples] for samples in result.connections],
        "worker_cpu_seconds": result.worker_cpu_seconds,
        "startup_seconds": result.startup_seconds,
        "complete": result.complete,
        "bare_pair_node_cpu_us": result.bare_pair_node_cpu_us,
        "packages": sorted(result.packages),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the fleet once and print the report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10000, help="calls to queue (10000)")
    parser.add_argument("--seed", type=int, default=17, help="seed of keys and durations (17)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=90.0,
        help="seconds the workers may take to drain the queue (90); a run stopped by it reports "
        "the calls that finished, and says so",
    )
    parser.add_argument(
        "--on-duplicate",
        choices=("wait", "retry"),
        default=ON_DUPLICATE,
        help=f"the task's on_duplicate ({ON_DUPLICATE})",
    )
    parser.add_argument(
        "--node-timeout",
        type=float,
        help="the workers' redlock_node_timeout in seconds (default: the library's, 0.05)",
    )
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="N processes spinning on the CPUs beside the fleet, a noisy neighbour (0)",
    )
    parser.add_argument("--loglevel", default="WARNING", help="the workers' --loglevel (WARNING)")
    parser.add_argument("--log-directory", type=Path, help="keep the workers' logs here")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    options = parser.parse_args(argv)
    if options.tasks < 1:
        parser.error("--tasks must be at least 1")
    # SIGTERM unwinds like Ctrl-C: workers and redis-server are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    os.environ.pop("CELERY_BROKER_URL", None)
    os.environ.pop("CELERY_RESULT_BACKEND", None)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="bench-fleet-") as directory,
        RedisServer(extra_args=PRODUCTION_SERVER) as broker,
        RedisNodes(LOCK_NODES, extra_args=PRODUCTION_SERVER) as nodes,
        busy_processes(options.busy),
    ):
        settings = FleetSettings(
            options.tasks,
            options.seed,
            options.timeout,
            options.on_duplicate,
            options.node_timeout,
            options.loglevel,
            options.log_directory,
            options.busy,
        )
        if options.log_directory is not None:
            options.log_directory.mkdir(parents=True, exist_ok=True)
        result = run_fleet(broker, nodes, settings, Path(directory))
        result.bare_pair_node_cpu_us = bare_pair_node_cpu_us(nodes, options.node_timeout)
    print()
    print(markdown(result, load_before, os.getloadavg()[0], time.monotonic() - started))
    if options.json is not None:
        options.json.write_text(json.dumps(to_json(result), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
