"""Latency of one uncontended lock (acquire + release) in celery_redlock and its peers.

Run from the repository root::

    python benchmarks/bench_locks.py                 # defaults: about two minutes
    python benchmarks/bench_locks.py --rounds 4 --json results.json

Five fresh ``redis-server`` processes are started on free ports of 127.0.0.1 through
``celery_redlock.testing`` (never the shared Redis on 6379) and stopped at the end, also on
Ctrl-C and on errors. Every library talks to the same nodes from this one process:

* ``celery_redlock`` ``Redlock`` over N = 1, 3 and 5 nodes;
* redis-py's own lock (``redis.Redis(...).lock(name, timeout=10)``) on one node;
* python-redis-lock (``redis_lock.Lock``) on one node;
* pottery ``Redlock`` over N = 1 and 5 nodes;
* redlock-py ``Redlock`` over N = 1 and 5 nodes;

and then, with two of the five nodes frozen by SIGSTOP (hung, not dead: connections stay open
and nothing answers), every N = 5 Redlock implementation again: each with a fresh instance and
lock name, warmed up while the nodes were healthy (a long-lived process whose nodes hang under
it). Slow peers get a bounded number of iterations and a time budget there. pottery gets a
second row whose lock is first used only after the hang (see "stale keys" below).

Fairness: every case measures acquire + release of a lock nobody else holds, with the lock
object built beforehand where the library has one (redis-py, python-redis-lock, pottery), so
construction costs nobody anything. Every Redis client of every library gets the same per-node
settings celery_redlock uses: a 50 ms socket and connect timeout and no redis-py retries (the
peers' defaults, no timeout at all, would hang for ever on a frozen node). Cases are measured
in rounds, each round running every case for a batch of iterations in a rotated order, so
machine noise falls on all of them alike; each case is warmed up first. Stray threads a library
leaves behind (pottery's executor) are joined between batches, outside the timed latency but
inside the client CPU time.

The report is a Markdown table (median, p99 and max in microseconds over the successful runs,
ratios, the client process's CPU time per attempt, outcomes) and a check of the project's
latency targets. Failures are reported as such ("fails" when nothing succeeded). After the
healthy runs every node is scanned for lock keys still present although every lock was
released ("stale keys": a release that lost a race with its own acquisition). It always exits 0:
it is a report, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from benchmark_support import (
    PRODUCTION_SERVER,
    interrupt_on_sigterm,
    percentile,
    server_version,
    variant_argument,
)
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redlock import Redlock as CeleryRedlock
from celery_redlock.testing import RedisNodes, find_redis_server

NODE_TIMEOUT = 0.05  # seconds; celery_redlock's default node_timeout, given to every client
LOCK_TTL = 10.0  # seconds
NODES = 5
HUNG = 2
HEALTHY = "healthy"
HUNG_SCENARIO = f"{HUNG} of {NODES} hung (SIGSTOP)"
HUNG_SCENARIO_FRESH = f"{HUNG} of {NODES} hung, lock first used after the hang"
BASELINE = ("redis-py Lock", 1, HEALTHY)

# Keys that are left behind on purpose and hold no lock: python-redis-lock's release pushes to
# a short-lived "lock-signal:" list, celery_redlock keeps a per-resource fencing counter.
NOT_LOCK_KEY_PREFIXES = (b"lock-signal:",)

Operation = Callable[[int], str]
"""One acquire + release; returns an outcome ("ok", "not acquired", ...) or raises."""

OK = "ok"


# -- the libraries ----------------------------------------------------------------------------


def client_options() -> dict[str, Any]:
    """The same per-node client settings for every library: bounded, no retries."""
    return {
        "socket_timeout": NODE_TIMEOUT,
        "socket_connect_timeout": NODE_TIMEOUT,
        "retry": Retry(NoBackoff(), 0),
    }


_instances = itertools.count(1)


def lock_name(library: str, nodes: int) -> str:
    """A lock name (or name prefix) no other case uses."""
    slug = library.lower().replace(" ", "-").replace("_", "-")
    return f"bench:{slug}:{nodes}:{next(_instances)}"


def make_celery_redlock(
    urls: list[str], ports: list[int], name: str, redlock_class: Any = CeleryRedlock
) -> Operation:
    dlm = redlock_class(urls, node_timeout=NODE_TIMEOUT)
    prefix = f"{name}:"

    def operation(iteration: int) -> str:
        lock = dlm.acquire(prefix + str(iteration), ttl=LOCK_TTL)
        if lock is None:
            return "not acquired"
        return OK if dlm.release(lock) else "release not confirmed"

    return operation


def load_variant(label: str, directory: str) -> Factory:
    """A factory for a celery_redlock copy in ``directory`` (a package directory holding
    ``__init__.py``), imported under another name so both versions run in this process."""
    init = os.path.join(directory, "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(f"--variant {label}={directory}: no __init__.py there")
    module_name = "celery_redlock_variant_" + "".join(c if c.isalnum() else "_" for c in label)
    spec = importlib.util.spec_from_file_location(
        module_name, init, submodule_search_locations=[directory]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return functools.partial(make_celery_redlock, redlock_class=module.Redlock)


def make_redis_py(urls: list[str], ports: list[int], name: str) -> Operation:
    (port,) = ports
    client = redis.Redis(host="127.0.0.1", port=port, **client_options())
    lock = client.lock(name, timeout=LOCK_TTL)

    def operation(iteration: int) -> str:
        if not lock.acquire(blocking=False):
            return "not acquired"
        lock.release()
        return OK

    return operation


def make_python_redis_lock(urls: list[str], ports: list[int], name: str) -> Operation:
    import redis_lock

    (port,) = ports
    client = redis.Redis(host="127.0.0.1", port=port, **client_options())
    lock = redis_lock.Lock(client, name, expire=int(LOCK_TTL))

    def operation(iteration: int) -> str:
        if not lock.acquire(blocking=False):
            return "not acquired"
        lock.release()
        return OK

    return operation


def make_pottery(urls: list[str], ports: list[int], name: str) -> Operation:
    from pottery import Redlock as PotteryRedlock

    masters = {redis.Redis(host="127.0.0.1", port=port, **client_options()) for port in ports}
    lock = PotteryRedlock(key=name, masters=masters, auto_release_time=LOCK_TTL)

    def operation(iteration: int) -> str:
        if not lock.acquire(blocking=False):
            return "not acquired"
        lock.release()
        return OK

    return operation


def make_redlock_py(urls: list[str], ports: list[int], name: str) -> Operation:
    import redlock

    dlm = redlock.Redlock(
        [{"host": "127.0.0.1", "port": port, **client_options()} for port in ports]
    )
    prefix = f"{name}:"
    ttl_ms = int(LOCK_TTL * 1000)

    def operation(iteration: int) -> str:
        # A fresh resource each time: when redlock-py raises after reaching a quorum it does not
        # release, and that leaked lock must not turn the next attempt into a contended one.
        lock = dlm.lock(prefix + str(iteration), ttl_ms)
        if not lock:
            return "not acquired"
        dlm.unlock(lock)
        return OK

    return operation


Factory = Callable[[list[str], list[int], str], Operation]

LIBRARIES: dict[str, Factory] = {
    "celery_redlock": make_celery_redlock,
    "redis-py Lock": make_redis_py,
    "python-redis-lock": make_python_redis_lock,
    "pottery Redlock": make_pottery,
    "redlock-py": make_redlock_py,
}

HEALTHY_CASES = [
    ("celery_redlock", 1),
    ("celery_redlock", 3),
    ("celery_redlock", 5),
    ("redis-py Lock", 1),
    ("python-redis-lock", 1),
    ("pottery Redlock", 1),
    ("pottery Redlock", 5),
    ("redlock-py", 1),
    ("redlock-py", 5),
]
HUNG_LIBRARIES = ["celery_redlock", "pottery Redlock", "redlock-py"]
DISTRIBUTIONS = {
    "celery_redlock": "celery-redlock",
    "redis-py Lock": "redis",
    "python-redis-lock": "python-redis-lock",
    "pottery Redlock": "pottery",
    "redlock-py": "redlock-py",
}


# -- measuring --------------------------------------------------------------------------------


@dataclass
class Case:
    library: str
    nodes: int
    scenario: str
    name: str  # the lock name, or the prefix of the lock names, this case uses
    operation: Operation
    max_samples: int
    budget: float  # seconds of timed work, at most
    note: str = ""
    stale_keys: int | None = None  # lock keys left on the nodes after every lock was released
    samples: list[int] = field(default_factory=list)  # ns, successful runs only
    failed_samples: list[int] = field(default_factory=list)  # ns, runs that did not succeed
    outcomes: Counter[str] = field(default_factory=Counter)
    spent: float = 0.0
    next_iteration: int = 0
    cpu_ns: int = 0  # CPU time of this process (all threads) over the timed batches

    @property
    def attempts(self) -> int:
        return sum(self.outcomes.values())

    def run(self, count: int, timed: bool = True, budget: float | None = None) -> None:
        """Run ``count`` iterations (fewer once ``budget`` seconds of them have passed)."""
        clock = time.perf_counter_ns
        started = time.perf_counter()
        for _ in range(count):
            iteration = self.next_iteration
            self.next_iteration += 1
            before = clock()
            try:
                outcome = self.operation(iteration)
            except Exception as error:
                outcome = f"raised {type(error).__name__}"
            elapsed = clock() - before
            if timed:
                self.outcomes[outcome] += 1
                (self.samples if outcome == OK else self.failed_samples).append(elapsed)
            if budget is not None and time.perf_counter() - started >= budget:
                break
        if timed:
            self.spent += time.perf_counter() - started


def settle_threads(limit: float = 1.0) -> None:
    """Wait (briefly) for threads a library left running, so they do not slow the next case."""
    deadline = time.monotonic() + limit
    for thread in threading.enumerate():
        if thread is threading.main_thread():
            continue
        thread.join(max(0.0, deadline - time.monotonic()))


def measure(cases: list[Case], rounds: int, warmup: int, label: str) -> None:
    """Warm every case up, then run them in rounds, rotating the order each round."""
    if not cases:
        return
    for case in cases:
        case.run(warmup, timed=False, budget=case.budget / 4)
        settle_threads()
    for round_index in range(rounds):
        shift = round_index % len(cases)
        order = cases[shift:] + cases[:shift]
        if round_index % 2:
            order.reverse()
        for case in order:
            remaining = case.max_samples - case.attempts
            budget_left = case.budget - case.spent
            if remaining <= 0 or budget_left <= 0:
                continue
            batch = math.ceil(remaining / (rounds - round_index))
            share = budget_left / (rounds - round_index)
            gc.collect()
            cpu_before = time.process_time_ns()
            case.run(batch, budget=share)
            settle_threads()  # a library's leftover threads are its cost too
            case.cpu_ns += time.process_time_ns() - cpu_before
        print(f"  {label}: round {round_index + 1}/{rounds} done", file=sys.stderr, flush=True)


# -- reporting --------------------------------------------------------------------------------


@dataclass
class Row:
    library: str
    nodes: int
    scenario: str
    attempts: int
    succeeded: int
    outcomes: dict[str, int]
    median_us: float | None
    p99_us: float | None
    max_us: float | None
    failed_median_us: float | None
    stale_keys: int | None
    note: str
    cpu_us: float | None
    vs_redis_py: float | None = None
    vs_healthy: float | None = None
    p99_vs_healthy: float | None = None

    @property
    def fails(self) -> bool:
        return self.succeeded == 0


def summarize(case: Case) -> Row:
    ok = case.samples
    return Row(
        library=case.library,
        nodes=case.nodes,
        scenario=case.scenario,
        attempts=case.attempts,
        succeeded=len(ok),
        outcomes=dict(case.outcomes),
        median_us=statistics.median(ok) / 1000 if ok else None,
        p99_us=percentile(ok, 0.99) / 1000 if ok else None,
        max_us=max(ok) / 1000 if ok else None,
        failed_median_us=(
            statistics.median(case.failed_samples) / 1000 if case.failed_samples else None
        ),
        stale_keys=case.stale_keys,
        note=case.note,
        cpu_us=case.cpu_ns / case.attempts / 1000 if case.attempts else None,
    )


def add_ratios(rows: list[Row]) -> None:
    by_key = {(row.library, row.nodes, row.scenario): row for row in rows}
    baseline = by_key.get(BASELINE)
    for row in rows:
        if row.median_us is None:
            continue
        if baseline is not None and baseline.median_us:
            row.vs_redis_py = row.median_us / baseline.median_us
        if row.scenario != HEALTHY:
            healthy = by_key.get((row.library, row.nodes, HEALTHY))
            if healthy is not None and healthy.median_us and healthy.p99_us:
                row.vs_healthy = row.median_us / healthy.median_us
                if row.p99_us is not None:
                    row.p99_vs_healthy = row.p99_us / healthy.p99_us


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _milliseconds(microseconds: float) -> str:
    return f"{microseconds / 1000:,.0f} ms" if microseconds >= 10_000 else f"{microseconds:,.0f} µs"


def _outcome(row: Row) -> str:
    if row.attempts == 0:
        return "not run"
    parts = []
    if row.succeeded == row.attempts:
        parts.append(f"ok {row.succeeded}/{row.attempts}")
    else:
        others = ", ".join(
            f"{name} x{count}" for name, count in sorted(row.outcomes.items()) if name != OK
        )
        took = ""
        if row.failed_median_us is not None:
            took = f" (a failed call took {_milliseconds(row.failed_median_us)}, median)"
        prefix = "**fails**: " if row.fails else f"ok {row.succeeded}/{row.attempts}; "
        parts.append(f"{prefix}{others}{took}")
    if row.note:
        parts.append(row.note)
    elif row.stale_keys:
        parts.append(f"{row.stale_keys} stale key(s) left on the nodes after release")
    return "; ".join(parts)


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| library | nodes | scenario | median µs | p99 µs | max µs | x redis-py Lock median "
        "| x own healthy N=5 median | client CPU µs/op | outcome |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        median = "fails" if row.fails else _number(row.median_us)
        p99 = "fails" if row.fails else _number(row.p99_us)
        worst = "fails" if row.fails else _number(row.max_us)
        lines.append(
            f"| {row.library} | {row.nodes} | {row.scenario} | {median} | {p99} | {worst} "
            f"| {_ratio(row.vs_redis_py)} | {_ratio(row.vs_healthy)} | {_number(row.cpu_us)} "
            f"| {_outcome(row)} |"
        )
    return "\n".join(lines)


@dataclass
class Target:
    name: str
    value: float | None
    limit: float
    detail: str

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "SKIP (not measured)"
        return "PASS" if self.value <= self.limit else "MISS"


def targets(rows: list[Row]) -> list[Target]:
    by_key = {(row.library, row.nodes, row.scenario): row for row in rows}

    def row(nodes: int, scenario: str = HEALTHY) -> Row | None:
        return by_key.get(("celery_redlock", nodes, scenario))

    n5, n5_hung, n1 = row(5), row(5, HUNG_SCENARIO), row(1)
    hung_detail = ""
    if n5_hung is not None and n5_hung.p99_vs_healthy is not None:
        hung_detail = f"; p99 {n5_hung.p99_vs_healthy:.2f}x healthy p99"
    return [
        Target(
            "celery_redlock N=5 median ≤ 1.5x redis-py Lock median",
            n5.vs_redis_py if n5 else None,
            1.5,
            "",
        ),
        Target(
            f"celery_redlock N=5 with {HUNG} hung median ≤ 2x healthy N=5 median",
            n5_hung.vs_healthy if n5_hung else None,
            2.0,
            hung_detail,
        ),
        Target(
            "celery_redlock N=1 median ≤ 1.1x redis-py Lock median",
            n1.vs_redis_py if n1 else None,
            1.1,
            "",
        ),
    ]


def celery_redlock_source() -> str:
    """Where the measured celery_redlock comes from, with its git state when in a checkout."""
    import celery_redlock

    directory = os.path.dirname(os.path.dirname(os.path.abspath(celery_redlock.__file__)))
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        described = ""
    return f"{directory} ({described})" if described else directory


def environment() -> dict[str, Any]:
    versions = {}
    for library, distribution in DISTRIBUTIONS.items():
        try:
            versions[library] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[library] = "not installed"
    return {
        "celery_redlock": celery_redlock_source(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "redis_server": server_version(find_redis_server()),
        "versions": versions,
    }


# -- main -------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--iterations", type=int, default=50, help="timed iterations per case per round"
    )
    parser.add_argument("--rounds", type=int, default=40, help="rounds over all cases")
    parser.add_argument("--warmup", type=int, default=100, help="untimed iterations per case")
    parser.add_argument(
        "--budget", type=float, default=20.0, help="seconds of timed work per case, at most"
    )
    parser.add_argument(
        "--hung-iterations",
        type=int,
        default=60,
        help="timed iterations, in all, per peer library with hung nodes (they are slow)",
    )
    parser.add_argument(
        "--hung-budget",
        type=float,
        default=20.0,
        help="seconds of timed work per peer library with hung nodes, at most",
    )
    parser.add_argument(
        "--hung-warmup", type=int, default=3, help="untimed iterations per hung case"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(LIBRARIES),
        help="measure only this library (repeatable; redis-py Lock is always kept)",
    )
    parser.add_argument("--no-hung", action="store_true", help="skip the scenario with hung nodes")
    parser.add_argument(
        "--variant",
        action="append",
        type=variant_argument,
        metavar="LABEL=DIR",
        help="also measure the celery_redlock package copy in DIR (a modified version, say) as "
        "'celery_redlock[LABEL]', in the same rounds (repeatable)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show the libraries' log messages on stderr"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout)"
    )
    arguments = parser.parse_args(argv)
    for name in ("iterations", "rounds", "hung_iterations"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return arguments


def run(arguments: argparse.Namespace) -> dict[str, Any]:
    libraries = dict(LIBRARIES)
    healthy_cases = list(HEALTHY_CASES)
    hung_libraries = list(HUNG_LIBRARIES)
    for label, directory in arguments.variant or []:
        library = f"celery_redlock[{label}]"
        libraries[library] = load_variant(label, directory)
        healthy_cases[3:3] = [(library, nodes) for nodes in (1, 3, 5)]
        hung_libraries.insert(1, library)
    wanted = set(arguments.only or libraries) | {BASELINE[0]}
    if "celery_redlock" in wanted:
        wanted |= {library for library in libraries if library.startswith("celery_redlock")}
    if arguments.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    else:
        # Peers log every failed node (pottery and redlock-py with tracebacks, redlock-py on the
        # root logger); the outcome column says it all. A handler on the root logger also
        # stops logging.exception() from configuring a stderr handler on its own.
        logging.getLogger().addHandler(logging.NullHandler())
        for name in ("pottery", "redlock", "redis_lock", "celery_redlock"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    env = environment()
    for label, directory in arguments.variant or []:
        env["versions"][f"celery_redlock[{label}]"] = directory
    print(
        f"Python {env['python']} on {env['platform']}, {env['cpus']} CPUs; {env['redis_server']}",
        file=sys.stderr,
    )
    healthy_samples = arguments.iterations * arguments.rounds
    with RedisNodes(NODES, extra_args=PRODUCTION_SERVER) as servers:
        urls = servers.urls
        ports = [server.port for server in servers]
        print(f"  started {NODES} redis-server nodes on ports {ports}", file=sys.stderr)

        clients = [server.client() for server in servers]

        def new_case(library: str, nodes: int, scenario: str, hung: bool = False) -> Case:
            name = lock_name(library, nodes)
            slow = hung and not library.startswith("celery_redlock")
            return Case(
                library,
                nodes,
                scenario,
                name,
                libraries[library](urls[:nodes], ports[:nodes], name),
                arguments.hung_iterations if slow else healthy_samples,
                arguments.hung_budget if slow else arguments.budget,
            )

        def count_stale_keys(case: Case, nodes: int) -> None:
            settle_threads()
            time.sleep(0.05)  # let commands still in flight land
            case.stale_keys = sum(
                1
                for client in clients[:nodes]
                for key in client.scan_iter(match=f"*{case.name}*", count=1000)
                if not key.startswith(NOT_LOCK_KEY_PREFIXES) and not key.endswith(b":fence")
            )

        healthy = [
            new_case(library, nodes, HEALTHY)
            for library, nodes in healthy_cases
            if library in wanted
        ]
        measure(healthy, arguments.rounds, arguments.warmup, "healthy")
        for case in healthy:
            count_stale_keys(case, case.nodes)

        hung: list[Case] = []
        if not arguments.no_hung:
            for library in hung_libraries:
                if library not in wanted:
                    continue
                # A fresh instance and lock name per case: a long-lived process whose nodes
                # hang under it, warmed up (connections open) while every node is healthy.
                case = new_case(library, NODES, HUNG_SCENARIO, hung=True)
                case.run(arguments.warmup, timed=False, budget=arguments.budget / 4)
                count_stale_keys(case, NODES - HUNG)
                if case.stale_keys:
                    case.note = (
                        f"{case.stale_keys} stale key(s) of this lock, left by its warm-up's "
                        "released locks, sat on the nodes that stay up"
                    )
                hung.append(case)
                if library == "pottery Redlock":
                    # The same library with a lock first used once the nodes hang, so that
                    # what its earlier releases left behind cannot decide the outcome.
                    fresh = new_case(library, NODES, HUNG_SCENARIO_FRESH, hung=True)
                    hung.append(fresh)
            frozen = list(servers)[NODES - HUNG :]
            for server in frozen:
                server.pause()
            print(f"  paused (SIGSTOP) ports {[s.port for s in frozen]}", file=sys.stderr)
            try:
                measure(hung, arguments.rounds, arguments.hung_warmup, "hung")
            finally:
                for server in frozen:
                    with contextlib.suppress(RuntimeError):
                        server.resume()
        for client in clients:
            client.close()
    settle_threads()

    rows = [summarize(case) for case in healthy + hung]
    add_ratios(rows)
    return {
        "environment": env,
        "settings": {
            "iterations_per_round": arguments.iterations,
            "rounds": arguments.rounds,
            "warmup": arguments.warmup,
            "budget_seconds": arguments.budget,
            "hung_iterations": arguments.hung_iterations,
            "hung_budget_seconds": arguments.hung_budget,
            "node_timeout_seconds": NODE_TIMEOUT,
            "lock_ttl_seconds": LOCK_TTL,
        },
        "rows": rows,
        "targets": targets(rows),
    }


def report(results: dict[str, Any]) -> str:
    settings = results["settings"]
    lines = [
        "## Uncontended acquire + release latency",
        "",
        f"{settings['rounds']} rounds x {settings['iterations_per_round']} iterations per case "
        f"(hung peers: at most {settings['hung_iterations']} iterations or "
        f"{settings['hung_budget_seconds']:g} s); per-node timeout "
        f"{settings['node_timeout_seconds'] * 1000:g} ms, no redis-py retries, lock ttl "
        f"{settings['lock_ttl_seconds']:g} s. Medians and p99 over successful runs only; "
        "client CPU is this process's CPU time (all threads, user + kernel) per attempt.",
        "",
        markdown_table(results["rows"]),
        "",
        "Targets:",
        "",
    ]
    for target in results["targets"]:
        value = "n/a" if target.value is None else f"{target.value:.2f}x"
        lines.append(f"- {target.verdict}: {target.name} (measured {value}{target.detail})")
    env = results["environment"]
    versions = ", ".join(f"{name} {version}" for name, version in env["versions"].items())
    lines += [
        "",
        f"Python {env['python']}, {env['cpus']} CPUs, {env['redis_server']}; {versions}; "
        f"celery_redlock from {env['celery_redlock']}.",
    ]
    return "\n".join(lines)


def to_json(results: dict[str, Any]) -> str:
    def encode(value: Any) -> Any:
        if isinstance(value, Row):
            return {**value.__dict__, "fails": value.fails}
        if isinstance(value, Target):
            return {**value.__dict__, "verdict": value.verdict}
        raise TypeError(type(value).__name__)

    return json.dumps(results, default=encode, indent=2, ensure_ascii=False)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    try:
        with interrupt_on_sigterm():
            results = run(arguments)
    except KeyboardInterrupt:
        print("interrupted; the Redis servers were stopped", file=sys.stderr)
        return 130
    print(report(results))
    if arguments.json:
        text = to_json(results)
        if arguments.json == "-":
            print(text)
        else:
            with open(arguments.json, "w", encoding="utf-8") as output:
                output.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
