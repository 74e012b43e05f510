"""Throughput of a no-op task through one real Celery worker: plain, singleton_task and peers.

Run from the repository root::

    python benchmarks/bench_celery.py                       # defaults: two to three minutes
    python benchmarks/bench_celery.py --tasks 500 --rounds 3   # a quick look
    python benchmarks/bench_celery.py --json results.json   # the table, plus raw numbers as JSON
    python benchmarks/bench_celery.py --profile /tmp/prof   # cProfile the worker children too
    python benchmarks/bench_celery.py --candidate /tmp/patched  # A/B a changed celery_redlock

Six fresh ``redis-server`` processes are started on free ports of 127.0.0.1 through
``celery_redlock.testing`` (never the shared Redis on 6379) and stopped at the end, also on
Ctrl-C and on errors: one is the broker (and the harness's control channel), five are lock nodes.
The same no-op task, ``noop(i)``, is measured in five variants, all on that one broker:

* ``plain``: ``@app.task``;
* ``redlock-1``: ``@singleton_task`` with ``redlock_urls`` = lock node 0;
* ``redlock-5``: ``@singleton_task`` with ``redlock_urls`` = lock nodes 0-4;
* ``celery-singleton``: ``@app.task(base=Singleton)``, its Redis backend on lock node 0;
* ``celery-once``: ``@app.task(base=QueueOnce)``, its Redis backend on lock node 0.

Every call gets distinct arguments, so no variant ever sees a duplicate. celery-singleton and
celery-once take their lock when the task is *published* and only release it in the worker,
while singleton_task takes and releases it in the worker; this benchmark times the worker only.

The worker: one real ``celery worker`` process per variant (started by this script through
``app.worker_main``, the code path of the ``celery worker`` command), with Celery's default
prefork pool at concurrency 1, the default prefetch and scheduling (pass ``--optimization fair``
for ``-O fair``), ``--loglevel WARNING`` and without gossip, mingle and heartbeat. Results are
ignored (``ignore_result=True``, no result backend). The worker processes import celery_redlock,
celery-singleton and celery-once alike, whatever their variant, and each consumes its own queue.
Workers are started once and kept for every round; each is warmed up with a discarded batch.

One measured batch, on the variant's queue, in this order:

1. ``gate``: a plain task that blocks the worker's single child until the harness says go;
2. the ``--tasks`` no-op calls, published while the gate holds the worker (so publishing, and the
   publish-side locking of celery-singleton and celery-once, is never timed);
3. ``report``: a plain task that sends the child's measurements back over the broker Redis.

The window runs, in the worker child, from the gate's return to the start of ``report``: every
no-op call's full cycle (delivery to the child, lock, run, release, result to the parent) and
nothing else. The only instrumentation inside the window is a ``task_postrun`` receiver that
counts outcomes (a dictionary increment), the same in every variant, so a batch where any call
failed, retried or was skipped is not counted as fast: it is noted in the report and run again
(at most three times). CPU time per task is reported too (medians), for the worker's main
process (from /proc, 10 ms ticks), for its pool child (all its threads) and for the five lock
nodes together (from their INFO); the main process's and the nodes' are read just before "go"
and just after the report arrives. CPU time moves less than wall time on a busy machine; it shows
which process the no-op's cycle waits for (with one child, usually the main process, which
receives, dispatches and acknowledges while the child runs) and what the lock nodes take from the
worker when they share its CPUs, as they do here.

``--candidate DIR`` adds ``redlock-1-candidate`` and ``redlock-5-candidate``: the same tasks in
workers that import another copy of ``celery_redlock`` (a proposed change), measured in the same
rounds as everything else. DIR is that copy's package directory (holding its ``__init__.py``, as
for ``bench_locks.py --variant``) or a directory that contains it as ``celery_redlock/``.

Batches run in rounds: every round runs every variant once, in an order rotated each round, so
machine noise falls on all of them alike. The report is a Markdown table of the median tasks per
second of each variant, its spread over rounds, its ratio to ``plain`` and its cost per task over
``plain``, then the check of the target: singleton_task at least 0.85x plain with 1 and with 5
lock nodes. It always exits 0 when the benchmark itself ran: it is a report, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
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
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_redlock import singleton_task
from celery_redlock.testing import RedisNodes, RedisServer, find_redis_server


def _version(distribution: str) -> str:
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
}
BASELINE = "plain"
CANDIDATE = "-candidate"  # variants whose worker imports celery_redlock from --candidate
TARGETS = ("redlock-1", "redlock-5")
TARGET_RATIO = 0.85
LOCK_NODES = 5

NOOP = "bench.noop"
GATE = "bench.gate"
REPORT = "bench.report"

GATE_TIMEOUT = 120  # seconds a gate waits for "go" before letting the worker run anyway
BATCH_TIMEOUT = 300.0  # seconds the harness waits for one batch's report
WORKER_STOP_TIMEOUT = 15.0
BATCH_ATTEMPTS = 3  # a batch whose calls did not all succeed is run again, at most this often


# -- the apps (built the same way in the harness, which publishes, and in each worker) --------


def noop(i: int) -> None:
    """The measured task: nothing at all."""


def queue_name(variant: str) -> str:
    return f"bench.{variant}"


def base_variant(variant: str) -> str:
    """``redlock-1`` for ``redlock-1-candidate``: which task the variant runs."""
    return variant.removesuffix(CANDIDATE)


def label(variant: str) -> str:
    return VARIANTS[base_variant(variant)] + (", candidate" if variant.endswith(CANDIDATE) else "")


def build_app(variant: str, broker_url: str, node_urls: list[str]) -> Celery:
    """The Celery app of one variant: ``noop`` with the variant's base, plus ``gate``/``report``."""
    app = Celery(f"bench_{variant.replace('-', '_')}", broker=broker_url, set_as_current=False)
    kind = base_variant(variant)
    app.conf.update(
        task_default_queue=queue_name(variant),
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
        # celery_redlock: the variant's lock nodes (redlock-1: node 0, redlock-5: nodes 0-4).
        redlock_urls=node_urls[:1] if kind != "redlock-5" else node_urls,
        # celery-singleton and celery-once: their Redis backend on lock node 0.
        singleton_backend_url=node_urls[0],
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": node_urls[0], "default_timeout": 60},
        },
    )
    options: dict[str, Any] = {"name": NOOP, "ignore_result": True}
    if kind == "plain":
        app.task(**options)(noop)
    elif kind in ("redlock-1", "redlock-5"):
        singleton_task(app=app, **options)(noop)
    elif kind == "celery-singleton":
        app.task(base=Singleton, **options)(noop)
    elif kind == "celery-once":
        app.task(base=QueueOnce, **options)(noop)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    app.task(name=GATE, ignore_result=True)(_gate)
    app.task(name=REPORT, ignore_result=True)(_report)
    return app


# -- inside the worker child -------------------------------------------------------------------


@dataclass
class _ChildState:
    """What the worker child measures; reset by every gate."""

    control: redis.Redis | None = None
    pid: int = 0
    started: float = 0.0
    cpu_started: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    profile_path: str | None = None
    profiler: cProfile.Profile | None = None


_CHILD = _ChildState()


def _count_outcome(sender: Any = None, state: str | None = None, **_: Any) -> None:
    if getattr(sender, "name", None) == NOOP:
        _CHILD.outcomes[state or "?"] += 1


def _gate(control_url: str, go_key: str) -> None:
    """Hold the worker until the harness pushes to ``go_key``; the window starts on return."""
    if _CHILD.control is None or _CHILD.pid != os.getpid():
        # redis-py 8 times reads out after 5 s by default; BLPOP may block longer.
        _CHILD.control = redis.Redis.from_url(control_url, socket_timeout=GATE_TIMEOUT + 10)
        _CHILD.pid = os.getpid()
    _CHILD.control.blpop([go_key], timeout=GATE_TIMEOUT)
    _CHILD.outcomes = Counter()
    if _CHILD.profile_path:
        _CHILD.profiler = cProfile.Profile()
        _CHILD.profiler.enable()
    _CHILD.cpu_started = time.process_time()
    _CHILD.started = time.perf_counter()


def _report(report_key: str) -> None:
    """End the window and send the measurements to the harness."""
    ended = time.perf_counter()
    cpu_ended = time.process_time()
    profiler, _CHILD.profiler = _CHILD.profiler, None
    if profiler is not None and _CHILD.profile_path:
        profiler.disable()
        profiler.dump_stats(_CHILD.profile_path)
    assert _CHILD.control is not None, "report ran before any gate"
    measurement = {
        "seconds": ended - _CHILD.started,
        "cpu_seconds": cpu_ended - _CHILD.cpu_started,
        "pid": os.getpid(),
        "gate_pid": _CHILD.pid,
        "outcomes": dict(_CHILD.outcomes),
    }
    _CHILD.control.rpush(report_key, json.dumps(measurement))


def _stop_when_orphaned() -> None:
    """Warm-shut this worker down if the harness dies without stopping it (SIGKILL)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def run_worker(variant: str, broker_url: str, node_urls: list[str], optimization: str) -> None:
    """The worker process of one variant (``--worker``): a real ``celery worker``."""
    threading.Thread(target=_stop_when_orphaned, name="bench-orphan-watch", daemon=True).start()
    app = build_app(variant, broker_url, node_urls)
    _CHILD.profile_path = os.environ.get("BENCH_CELERY_PROFILE") or None
    signals.task_postrun.connect(_count_outcome, weak=False)
    app.worker_main(
        [
            "worker",
            "--pool=prefork",
            "--concurrency=1",
            f"--optimization={optimization}",
            "--loglevel=WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            f"--hostname=bench-{variant}@%h",
            f"--queues={queue_name(variant)}",
        ]
    )


# -- the harness -------------------------------------------------------------------------------


class BatchFailed(RuntimeError):
    """A batch did not run cleanly (timeout, worker gone, a replaced worker child)."""


class BatchOutcomes(BatchFailed):
    """Some calls of a batch did not succeed (failed, retried, skipped): worth a note, and a
    repeat of the batch, rather than the end of the benchmark."""

    def __init__(self, variant: str, outcomes: dict[str, int], log_tail: str) -> None:
        super().__init__(f"worker {variant}: not every call succeeded: {outcomes}\n{log_tail}")
        self.variant = variant
        self.outcomes = outcomes


@dataclass(frozen=True)
class Sample:
    """One batch: tasks per second, and CPU microseconds per task of the worker's main process,
    of its pool child and of the lock nodes (all five together; idle nodes cost next to nothing).
    """

    rate: float
    main_cpu_us: float
    child_cpu_us: float
    node_cpu_us: float


def _process_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of one process so far, from /proc; NaN where there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    # After the command name: state is field 3, utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _redis_cpu_seconds(servers: RedisNodes) -> float:
    """CPU time the servers have used so far (user + system, as their INFO reports it)."""
    total = 0.0
    for server in servers:
        client = server.client()
        try:
            info = client.info("cpu")
        finally:
            client.close()
        total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total


class Worker:
    """One worker subprocess for one variant, plus the harness-side app that publishes to it."""

    def __init__(
        self,
        variant: str,
        broker: RedisServer,
        nodes: RedisNodes,
        optimization: str,
        log_dir: Path,
        profile_dir: Path | None,
        candidate: Path | None = None,
    ) -> None:
        node_urls = nodes.urls
        self.variant = variant
        self.broker = broker
        self.nodes = nodes
        self.app = build_app(variant, broker.url, node_urls)
        self.noop = self.app.tasks[NOOP]
        self.log_path = log_dir / f"worker-{variant}.log"
        environment = dict(os.environ)
        environment.pop("BENCH_CELERY_PROFILE", None)
        if variant.endswith(CANDIDATE):
            assert candidate is not None
            # The candidate's directory first on the path: its celery_redlock wins the import.
            path = environment.get("PYTHONPATH")
            environment["PYTHONPATH"] = os.pathsep.join(
                [str(candidate.resolve())] + ([path] if path else [])
            )
        if profile_dir is not None:
            environment["BENCH_CELERY_PROFILE"] = str(profile_dir / f"{variant}.pstats")
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            variant,
            "--broker",
            broker.url,
            "--nodes",
            ",".join(node_urls),
            "--optimization",
            optimization,
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment,
                start_new_session=True,  # its own process group: the prefork child stops with it
            )
        self._batches = itertools.count()
        self._pending_go: str | None = None  # the go key of a batch in flight

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def run_batch(self, tasks: int, first_argument: int) -> Sample:
        """Publish gate, ``tasks`` no-ops and report; let them run; return what was measured."""
        if self.process.poll() is not None:
            raise BatchFailed(f"worker {self.variant} exited:\n{self.log_tail()}")
        batch = next(self._batches)
        go_key = f"bench:go:{self.variant}:{batch}"
        report_key = f"bench:report:{self.variant}:{batch}"
        control = self.broker.client(socket_timeout=BATCH_TIMEOUT + 10)  # BLPOP blocks long
        self._pending_go = go_key
        try:
            with self.app.producer_or_acquire() as producer:
                self.app.tasks[GATE].apply_async((self.broker.url, go_key), producer=producer)
                for i in range(first_argument, first_argument + tasks):
                    self.noop.apply_async((i,), producer=producer)
                self.app.tasks[REPORT].apply_async((report_key,), producer=producer)
            node_cpu = _redis_cpu_seconds(self.nodes)
            main_cpu = _process_cpu_seconds(self.process.pid)
            control.rpush(go_key, "go")
            reply = control.blpop([report_key], timeout=BATCH_TIMEOUT)
            main_cpu = _process_cpu_seconds(self.process.pid) - main_cpu
            node_cpu = _redis_cpu_seconds(self.nodes) - node_cpu
            self._pending_go = None
        finally:
            control.close()
        if reply is None:
            raise BatchFailed(
                f"worker {self.variant}: no report within {BATCH_TIMEOUT:.0f}s:\n{self.log_tail()}"
            )
        measurement = json.loads(reply[1])
        if measurement["pid"] != measurement["gate_pid"]:
            raise BatchFailed(f"worker {self.variant}: the child was replaced during the batch")
        if measurement["outcomes"] != {"SUCCESS": tasks}:
            raise BatchOutcomes(self.variant, measurement["outcomes"], self.log_tail(10))
        return Sample(
            rate=tasks / measurement["seconds"],
            main_cpu_us=main_cpu / tasks * 1e6,
            child_cpu_us=measurement["cpu_seconds"] / tasks * 1e6,
            node_cpu_us=node_cpu / tasks * 1e6,
        )

    def request_stop(self) -> None:
        """Start a warm shutdown (SIGTERM), first letting a gate that still holds the child go."""
        if self.process.poll() is not None:
            return
        if self._pending_go is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                client = self.broker.client(socket_timeout=1.0)
                try:
                    client.rpush(self._pending_go, "go")
                finally:
                    client.close()
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> None:
        """Wait for the warm shutdown; the whole process group is killed if it takes too long."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(WORKER_STOP_TIMEOUT)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the group this script started
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


@dataclass
class Results:
    tasks: int
    warmup: int
    rounds: int
    optimization: str
    samples: dict[str, list[float]]
    main_cpu_us: dict[str, list[float]]
    cpu_us: dict[str, list[float]]
    node_cpu_us: dict[str, list[float]]
    orders: list[list[str]]
    failures: list[BatchOutcomes]

    def median(self, variant: str) -> float:
        return statistics.median(self.samples[variant])

    def ratio(self, variant: str) -> float:
        return self.median(variant) / self.median(BASELINE)

    def overhead_us(self, variant: str) -> float:
        return (1 / self.median(variant) - 1 / self.median(BASELINE)) * 1e6


def run_benchmark(
    variants: list[str],
    tasks: int,
    warmup: int,
    rounds: int,
    optimization: str,
    profile_dir: Path | None,
    candidate: Path | None = None,
) -> Results:
    samples: dict[str, list[float]] = {variant: [] for variant in variants}
    main_cpu_us: dict[str, list[float]] = {variant: [] for variant in variants}
    cpu_us: dict[str, list[float]] = {variant: [] for variant in variants}
    node_cpu_us: dict[str, list[float]] = {variant: [] for variant in variants}
    orders: list[list[str]] = []
    failures: list[BatchOutcomes] = []
    arguments = itertools.count(step=max(tasks, warmup))

    def batch(worker: Worker, size: int) -> Sample:
        """One batch; one whose calls did not all succeed is noted and run again."""
        for attempt in itertools.count(1):
            try:
                return worker.run_batch(size, next(arguments))
            except BatchOutcomes as failure:
                failures.append(failure)
                print(f"batch failed, attempt {attempt}: {failure}", file=sys.stderr)
                if attempt == BATCH_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    with (
        tempfile.TemporaryDirectory(prefix="bench-celery-") as log_dir,
        RedisServer() as broker,
        RedisNodes(LOCK_NODES) as nodes,
    ):
        workers: list[Worker] = []
        try:
            for variant in variants:
                workers.append(
                    Worker(
                        variant,
                        broker,
                        nodes,
                        optimization,
                        Path(log_dir),
                        profile_dir,
                        candidate,
                    )
                )
            for worker in workers:
                print(f"warming up {worker.variant} ({warmup} tasks)", file=sys.stderr)
                batch(worker, warmup)
            for round_index in range(rounds):
                shift = round_index % len(workers)
                order = workers[shift:] + workers[:shift]
                orders.append([worker.variant for worker in order])
                for worker in order:
                    sample = batch(worker, tasks)
                    samples[worker.variant].append(sample.rate)
                    main_cpu_us[worker.variant].append(sample.main_cpu_us)
                    cpu_us[worker.variant].append(sample.child_cpu_us)
                    node_cpu_us[worker.variant].append(sample.node_cpu_us)
                    print(
                        f"round {round_index + 1}/{rounds} {worker.variant}: "
                        f"{sample.rate:,.0f} tasks/s, CPU µs/task: worker main "
                        f"{sample.main_cpu_us:.0f}, child {sample.child_cpu_us:.0f}, "
                        f"lock nodes {sample.node_cpu_us:.0f}",
                        file=sys.stderr,
                    )
        finally:
            for worker in workers:
                worker.request_stop()
            for worker in workers:
                worker.wait_stopped()
    return Results(
        tasks,
        warmup,
        rounds,
        optimization,
        samples,
        main_cpu_us,
        cpu_us,
        node_cpu_us,
        orders,
        failures,
    )


# -- the report --------------------------------------------------------------------------------


def _redis_server_version() -> str:
    try:
        output = subprocess.run(
            [find_redis_server(), "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return "?"
    for part in output.split():
        if part.startswith("v="):
            return part[2:]
    return output.strip() or "?"


def _package_directory() -> str:
    import celery_redlock

    return os.path.dirname(os.path.abspath(celery_redlock.__file__))


def environment() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
        "celery": _version("celery"),
        "kombu": _version("kombu"),
        "redis-py": _version("redis"),
        "redis-server": _redis_server_version(),
        "celery-redlock": f"{_version('celery-redlock')} from {_package_directory()}",
        "celery-singleton": _version("celery-singleton"),
        "celery-once": _version("celery-once"),
    }


def markdown(results: Results) -> str:
    lines = [
        f"One worker: prefork, concurrency 1, -O {results.optimization}; "
        f"{results.tasks} no-op tasks per batch, {results.rounds} interleaved rounds "
        f"(after a {results.warmup}-task warm-up per worker); median over rounds.",
        "",
        "| variant | tasks/s (median) | min - max | ratio to plain | µs/task over plain "
        "| CPU µs/task: worker main / child / lock nodes |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for variant, rates in results.samples.items():
        overhead = "—" if variant == BASELINE else f"{results.overhead_us(variant):+.0f}"
        lines.append(
            f"| {label(variant)} | {results.median(variant):,.0f} | "
            f"{min(rates):,.0f} - {max(rates):,.0f} | {results.ratio(variant):.2f}x | {overhead} "
            f"| {statistics.median(results.main_cpu_us[variant]):.0f} / "
            f"{statistics.median(results.cpu_us[variant]):.0f} / "
            f"{statistics.median(results.node_cpu_us[variant]):.0f} |"
        )
    lines.append("")
    for variant in results.samples:
        if base_variant(variant) not in TARGETS:
            continue
        ratio = results.ratio(variant)
        verdict = "PASS" if ratio >= TARGET_RATIO else "MISS"
        lines.append(
            f"- {verdict}: {label(variant)} at {ratio:.3f}x plain (target >= {TARGET_RATIO}x)"
        )
    if results.failures:
        lines.append("")
        lines.append(
            f"{len(results.failures)} batch(es) were run again because not every call succeeded "
            "(a correctness problem, not noise):"
        )
        lines.extend(f"- {failure.variant}: {failure.outcomes}" for failure in results.failures)
    return "\n".join(lines)


def _candidate_path_entry(candidate: Path, stack: contextlib.ExitStack[Any]) -> Path:
    """A directory to put first on the candidate workers' path, so that ``import
    celery_redlock`` finds the candidate: DIR itself when it contains ``celery_redlock/``, else a
    temporary directory with a ``celery_redlock`` link to the package directory DIR."""
    candidate = candidate.resolve()
    if (candidate / "celery_redlock" / "__init__.py").is_file():
        return candidate
    entry = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-celery-cand-")))
    (entry / "celery_redlock").symlink_to(candidate, target_is_directory=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000, help="no-op tasks per batch")
    parser.add_argument("--warmup", type=int, default=300, help="warm-up tasks per worker")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {', '.join(VARIANTS)} (plain is always included)",
    )
    parser.add_argument("--optimization", choices=("default", "fair"), default="default")
    parser.add_argument("--json", type=Path, help="also write the samples here")
    parser.add_argument(
        "--candidate",
        type=Path,
        metavar="DIR",
        help="a directory holding another celery_redlock package (a proposed change): adds "
        "the variants redlock-1-candidate and redlock-5-candidate, whose workers import it",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="cProfile the worker children (every batch: slower, not for the table); the last "
        "batch of each variant is kept in DIR/<variant>.pstats",
    )
    # Internal: the worker subprocess of one variant.
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--broker", help=argparse.SUPPRESS)
    parser.add_argument("--nodes", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run_worker(args.worker, args.broker, args.nodes.split(","), args.optimization)
        return 0
    # SIGTERM unwinds like Ctrl-C: workers and redis-server processes are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    variants = [BASELINE] + [name for name in args.variants.split(",") if name and name != BASELINE]
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.candidate is not None:
        if (
            not (args.candidate / "__init__.py").is_file()
            and not (args.candidate / "celery_redlock" / "__init__.py").is_file()
        ):
            parser.error(
                f"--candidate {args.candidate}: neither a package directory (with __init__.py) "
                "nor a directory containing celery_redlock/"
            )
        chosen = [name for name in TARGETS if name in variants] or list(TARGETS)
        variants += [name + CANDIDATE for name in chosen]
    if args.tasks < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error("--tasks, --warmup and --rounds must be at least 1")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        candidate_path = None
        if args.candidate is not None:
            candidate_path = _candidate_path_entry(args.candidate, stack)
        results = run_benchmark(
            variants,
            args.tasks,
            args.warmup,
            args.rounds,
            args.optimization,
            args.profile,
            candidate_path,
        )
    info = environment()
    info["load average (1 min) before / after"] = f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
    if args.candidate is not None:
        info["candidate"] = str(args.candidate.resolve())
    print()
    print(markdown(results))
    print()
    print(
        "Environment: " + ", ".join(f"{name} {value}" for name, value in info.items()),
        f"\nTotal time: {time.monotonic() - started:.0f}s",
    )
    if args.profile is not None:
        print(f"Profiles of the last batch of each worker child: {args.profile}/<variant>.pstats")
    if args.json is not None:
        document = {
            "environment": info,
            "tasks": results.tasks,
            "warmup": results.warmup,
            "rounds": results.rounds,
            "optimization": results.optimization,
            "orders": results.orders,
            "samples": results.samples,
            "worker_main_cpu_us_per_task": results.main_cpu_us,
            "child_cpu_us_per_task": results.cpu_us,
            "lock_nodes_cpu_us_per_task": results.node_cpu_us,
            "failed_batches": [
                {"variant": failure.variant, "outcomes": failure.outcomes}
                for failure in results.failures
            ],
            "median": {variant: results.median(variant) for variant in results.samples},
            "ratio": {variant: results.ratio(variant) for variant in results.samples},
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
