"""Lock throughput of one standalone node against a Redis Cluster, and the latency of one lock on
every topology celery_redlock supports.

Run from the repository root::

    python benchmarks/bench_topology.py                        # defaults: about a minute
    python benchmarks/bench_topology.py --rounds 3 --seconds 2 --latency-rounds 4
    python benchmarks/bench_topology.py --processes 8 --threads 2 --json results.json

Every server is a fresh process on a free port of 127.0.0.1, started through
``celery_redlock.testing`` and, for Cluster, Sentinel, TLS and Valkey, the repository's test helpers
(``tests/topologies/``) (never a Redis you already run), and stopped at the end, also on
Ctrl-C, SIGTERM and errors. In one run:

* **throughput** (issue 16's closing figure): ``--processes`` client processes (4; each a
  subprocess of this script) each build one ``Redlock`` per topology and share it between
  ``--threads`` threads (4); every thread takes and releases locks on names nobody else uses, as
  fast as it can, for ``--seconds``. Topologies: one standalone ``redis-server`` (``redis://``)
  and one 3-master Redis Cluster counted as one lock node (``redis+cluster://``, no replicas).
  The processes start each timed run at the same instant (a wall-clock time they are given) and
  the run lasts until the last call of the last thread returned. ``--rounds`` rounds (5), the
  two topologies interleaved, their order swapped every round; medians over rounds, and the
  ratio cluster / standalone, from the medians and round by round. Beside each run: the CPU the
  servers used (``INFO cpu`` before and after) and the CPU the client processes used, in cores.
* **latency** of one uncontended acquire + release, from this process, one call at a time, on:
  1 standalone node; 3 standalone nodes (the Redlock quorum); the 3-master cluster; a 3-master
  cluster with one replica per master, with ``redlock_wait_replicas`` 0 and 1; a Sentinel group
  (1 master, 1 replica, 3 sentinels) with ``redlock_wait_replicas`` 0 and 1; a TLS-only server
  (``rediss://`` verifying the server against the test authority, with a client certificate);
  a Valkey server. ``--latency-rounds`` rounds (10) of ``--pairs`` pairs (200) per case, in an
  order rotated every round; median and p99 over every successful pair.

Every lock manager is built with ``from_settings(RedlockSettings(urls=...,
node_timeout=..., wait_replicas=...))``; ``--node-timeout`` (0.5 s) is the per-node timeout,
longer than the library's default (50 ms) so that a reply that is late only because the client
did not get a CPU on a busy 2-CPU machine does not count as a failed node. Only successful pairs
count (acquired, and the release confirmed); anything else is reported as a failure, never as
throughput.

The report is Markdown (``--json PATH``: every sample too). It always exits 0, also when
interrupted: it is a report, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import selectors
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmark_support import (
    cpu_model,
    interrupt_on_sigterm,
    percentile,
    quiet_logging,
    server_version,
)

# Redis Cluster, Sentinel, TLS and Valkey set-ups are the tests' helpers (tests/topologies/), not
# shipped.
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))

LOCK_TTL = 10.0  # seconds
STANDALONE = "1 standalone node"
CLUSTER = "cluster, 3 masters"
OK = "ok"
START_DELAY = 0.25  # seconds between sending a run to the client processes and its start
CHILD_TIMEOUT = 60.0  # seconds a client process may take to answer, beyond its timed run
WARMUP_PAIRS = 30  # untimed pairs per latency case before its first round


def pair(manager: Any, name: str) -> str:
    """One acquire + release of ``name`` on ``manager`` (a ``Redlock``); its outcome (``"ok"``,
    ``"not acquired"``, ``"release not confirmed"``, ``"raised X"``)."""
    try:
        lock = manager.acquire(name, ttl=LOCK_TTL)
        if lock is None:
            return "not acquired"
        return OK if manager.release(lock) else "release not confirmed"
    except Exception as error:
        return f"raised {type(error).__name__}"


def make_manager(urls: Sequence[str], node_timeout: float, wait_replicas: int = 0) -> Any:
    """A lock manager on ``urls`` from settings, as a Celery app's worker would build it."""
    from celery_redlock import RedlockSettings
    from celery_redlock.lock.redlock import from_settings

    settings = RedlockSettings(
        urls=tuple(urls), node_timeout=node_timeout, wait_replicas=wait_replicas
    )
    return from_settings(settings)


def server_cpu_seconds(servers: Sequence[Any]) -> float:
    """CPU seconds (user + system, all threads) the ``servers`` used since they started."""
    total = 0.0
    for server in servers:
        with server.client(socket_timeout=10) as client:
            info = client.info("cpu")
        total += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return total


# -- the client processes (``--child``) ------------------------------------------------------


def thread_main(
    results: list[tuple[Counter[str], float]],
    index: int,
    manager: Any,
    prefix: str,
    start: float,
    seconds: float,
) -> None:
    """One thread of a client process: its `timed_calls`, into ``results[index]``."""
    results[index] = timed_calls(manager, prefix, start, start + seconds)


def timed_calls(
    manager: Any, prefix: str, start: float, deadline: float
) -> tuple[Counter[str], float]:
    """From the wall-clock time ``start`` until ``deadline`` (at least once), pairs on names
    ``prefix<n>``; their outcomes, and the wall-clock time the last one returned."""
    delay = start - time.time()
    if delay > 0:
        time.sleep(delay)
    outcomes: Counter[str] = Counter()
    calls = 0
    while True:
        outcomes[pair(manager, f"{prefix}{calls}")] += 1
        calls += 1
        now = time.time()
        if now >= deadline:
            return outcomes, now


def child_main(options: argparse.Namespace) -> int:
    """In a client process: one lock manager per ``--topology NAME=URL``, shared by ``--threads``
    threads. Reads one JSON command per line on standard input (``{"topology", "start",
    "seconds"}``, or ``{"quit": true}``); for each, every thread calls from the wall-clock time
    ``start`` until ``start + seconds`` (at least once), on names of its own; then one JSON line
    on standard output."""
    managers = {name: make_manager([url], options.node_timeout) for name, url in options.topology}
    threads = options.threads
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for run_index, line in enumerate(sys.stdin):
        command = json.loads(line)
        if command.get("quit"):
            break
        manager = managers[command["topology"]]
        start, seconds = float(command["start"]), float(command["seconds"])
        results: list[tuple[Counter[str], float]] = [(Counter(), 0.0)] * threads
        arguments = [
            (results, index, manager, f"bench:{os.getpid()}:{run_index}:{index}:", start, seconds)
            for index in range(threads)
        ]
        gc.collect()
        cpu_started = time.process_time()
        workers = [threading.Thread(target=thread_main, args=given) for given in arguments]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        report = {
            "outcomes": dict(sum((outcomes for outcomes, _ in results), Counter())),
            "end": max(end for _, end in results),
            "cpu_seconds": time.process_time() - cpu_started,
        }
        print(json.dumps(report), flush=True)
    for manager in managers.values():
        manager.close()
    return 0


# -- throughput -------------------------------------------------------------------------------


@dataclass
class ThroughputSample:
    """One timed run of one topology by every client process."""

    outcomes: Counter[str]
    seconds: float
    client_cpu_seconds: float
    server_cpu_seconds: float
    load_average: float  # the machine's 1-minute load average at the run's start

    @property
    def successes(self) -> int:
        """Pairs acquired and released."""
        return self.outcomes.get(OK, 0)

    @property
    def failures(self) -> Counter[str]:
        """Every other outcome, with its count."""
        return Counter({name: count for name, count in self.outcomes.items() if name != OK})

    @property
    def rate(self) -> float:
        """Successful pairs per second, over every process."""
        return self.successes / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ThroughputCase:
    """One topology measured for throughput: its URL, the servers whose CPU is counted, and
    its samples (one per round)."""

    name: str
    url: str
    servers: Sequence[Any]
    samples: list[ThroughputSample] = field(default_factory=list)

    def median_rate(self) -> float:
        """The median pairs per second over rounds."""
        return float(statistics.median(sample.rate for sample in self.samples))


class ClientProcesses:
    """``count`` client subprocesses of this script, each with one lock manager per case."""

    def __init__(
        self, count: int, threads: int, cases: Sequence[ThroughputCase], node_timeout: float
    ) -> None:
        arguments = [sys.executable, os.path.abspath(__file__), "--child"]
        arguments += ["--threads", str(threads), "--node-timeout", str(node_timeout)]
        for case in cases:
            arguments += ["--topology", f"{case.name}={case.url}"]
        self._children: list[subprocess.Popen[str]] = []
        try:
            for _ in range(count):
                self._children.append(
                    subprocess.Popen(
                        arguments, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                    )
                )
            for child in self._children:
                self._answer(child, CHILD_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def run(self, case: ThroughputCase, seconds: float) -> ThroughputSample:
        """Every process runs ``case`` for ``seconds``, starting at the same instant."""
        load_average = os.getloadavg()[0]
        server_cpu_before = server_cpu_seconds(case.servers)
        measured_from = time.time()
        start = measured_from + START_DELAY
        command = json.dumps({"topology": case.name, "start": start, "seconds": seconds})
        for child in self._children:
            assert child.stdin is not None
            child.stdin.write(command + "\n")
            child.stdin.flush()
        reports = [self._answer(child, seconds + START_DELAY + CHILD_TIMEOUT) for child in self]
        measured_to = time.time()
        server_cpu = server_cpu_seconds(case.servers) - server_cpu_before
        outcomes: Counter[str] = Counter()
        for report in reports:
            outcomes.update(report["outcomes"])
        # The servers' CPU is read around the whole exchange (START_DELAY of idling included);
        # it is scaled to the timed run, which is where nearly all of it went.
        elapsed = max(report["end"] for report in reports) - start
        server_share = elapsed / (measured_to - measured_from)
        return ThroughputSample(
            outcomes,
            elapsed,
            sum(report["cpu_seconds"] for report in reports),
            server_cpu * min(1.0, server_share),
            load_average,
        )

    def __iter__(self) -> Iterator[subprocess.Popen[str]]:
        return iter(self._children)

    @staticmethod
    def _answer(child: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
        assert child.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(child.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise RuntimeError(f"client process {child.pid} did not answer in {timeout:g} s")
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"client process {child.pid} exited ({child.poll()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        """Tell every process to quit; kill those that do not within a few seconds."""
        for child in self._children:
            with contextlib.suppress(OSError, ValueError):
                assert child.stdin is not None
                child.stdin.write(json.dumps({"quit": True}) + "\n")
                child.stdin.close()
        deadline = time.monotonic() + 10.0
        for child in self._children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()
        self._children = []


def measure_throughput(
    cases: list[ThroughputCase], options: argparse.Namespace, log: Callable[[str], None]
) -> None:
    """Warm-up runs (not counted), then ``--rounds`` rounds of every case, order swapped every
    round."""
    clients = ClientProcesses(options.processes, options.threads, cases, options.node_timeout)
    try:
        log(f"{options.processes} client processes of {options.threads} threads ready")
        for case in cases:
            warm = clients.run(case, options.warmup_seconds)
            log(f"warmed up {case.name}: {warm.rate:,.0f} pairs/s")
        for round_index in range(options.rounds):
            order = cases if round_index % 2 == 0 else list(reversed(cases))
            for case in order:
                sample = clients.run(case, options.seconds)
                case.samples.append(sample)
                failed = sum(sample.failures.values())
                log(
                    f"round {round_index + 1}/{options.rounds} {case.name}: "
                    f"{sample.rate:,.0f} pairs/s" + (f", {failed} failed" if failed else "")
                )
    finally:
        clients.close()


# -- latency ----------------------------------------------------------------------------------


@dataclass
class LatencyCase:
    """One topology measured for latency: a lock manager on its URLs, the durations of its
    successful pairs (seconds), and its other outcomes."""

    name: str
    url_form: str
    urls: Sequence[str]
    wait_replicas: int = 0
    manager: Any = None
    durations: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    calls: int = 0

    def run(self, pairs: int) -> None:
        """``pairs`` acquire + release pairs, each timed on its own."""
        prefix = f"bench:latency:{os.getpid()}:{id(self)}:"
        for _ in range(pairs):
            name = f"{prefix}{self.calls}"
            self.calls += 1
            started = time.perf_counter()
            outcome = pair(self.manager, name)
            elapsed = time.perf_counter() - started
            if outcome == OK:
                self.durations.append(elapsed)
            else:
                self.failures[outcome] += 1


def measure_latency(
    cases: list[LatencyCase], options: argparse.Namespace, log: Callable[[str], None]
) -> None:
    """Warm every case up, then ``--latency-rounds`` rounds of ``--pairs`` pairs per case, in an
    order rotated (and reversed every other round) every round."""
    for case in cases:
        case.manager = make_manager(case.urls, options.node_timeout, case.wait_replicas)
        case.run(WARMUP_PAIRS)
        case.durations.clear()
        case.failures.clear()
    log(f"latency: {len(cases)} cases warmed up")
    try:
        for round_index in range(options.latency_rounds):
            shift = round_index % len(cases)
            order = cases[shift:] + cases[:shift]
            if round_index % 2:
                order.reverse()
            gc.collect()
            for case in order:
                case.run(options.pairs)
        log(f"latency: {options.latency_rounds} rounds done")
    finally:
        for case in cases:
            if case.manager is not None:
                case.manager.close()


# -- the servers ------------------------------------------------------------------------------


@dataclass
class Deployment:
    """Every server the run started, what could not start, and a way to stop it all."""

    stack: contextlib.ExitStack
    notes: list[str] = field(default_factory=list)
    servers: dict[str, Any] = field(default_factory=dict)

    def start(self, name: str, make: Callable[[], Any], log: Callable[[str], None]) -> Any:
        """Start ``make()`` (a server or a group, used as a context manager) and keep it under
        ``name``; None, with a note, if it cannot start."""
        started = time.monotonic()
        try:
            self.servers[name] = self.stack.enter_context(make())
        except (RuntimeError, OSError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            self.notes.append(f"{name}: not measured, it did not start ({first_line})")
            log(f"{name} did not start: {first_line}")
            return None
        log(f"started {name} in {time.monotonic() - started:.1f} s")
        return self.servers[name]


def throughput_servers(deployment: Deployment, log: Callable[[str], None]) -> None:
    """The standalone nodes and the 3-master cluster."""
    from topologies import RedisCluster

    from celery_redlock.testing import RedisNodes

    deployment.start("standalone", lambda: RedisNodes(3), log)
    deployment.start("cluster", lambda: RedisCluster(masters=3), log)


def latency_servers(deployment: Deployment, log: Callable[[str], None]) -> None:
    """The cluster with replicas, the sentinel group, the TLS server and the Valkey server."""
    from topologies import (
        RedisCluster,
        SentinelGroup,
        TLSCertificates,
        TopologyServer,
        ValkeyServer,
    )

    deployment.start(
        "cluster with replicas", lambda: RedisCluster(masters=3, replicas_per_master=1), log
    )
    deployment.start("sentinel", lambda: SentinelGroup(replicas=1), log)
    certificates = deployment.start("certificates", TLSCertificates.create, log)
    if certificates is not None:
        deployment.start("tls", lambda: TopologyServer(tls=certificates), log)
    deployment.start("valkey", ValkeyServer, log)


def latency_cases(deployment: Deployment) -> list[LatencyCase]:
    """The latency cases whose servers started."""
    servers = deployment.servers
    cases: list[LatencyCase] = []
    if "standalone" in servers:
        nodes = servers["standalone"]
        cases.append(LatencyCase(STANDALONE, "`redis://h:p/0`", nodes.urls[:1]))
        cases.append(LatencyCase("3 standalone nodes (quorum of 2)", "3 x `redis://`", nodes.urls))
    if "cluster" in servers:
        cases.append(
            LatencyCase(CLUSTER, "`redis+cluster://h:p,h:p,h:p`", [servers["cluster"].url])
        )
    if "cluster with replicas" in servers:
        url = servers["cluster with replicas"].url
        for wait in (0, 1):
            cases.append(
                LatencyCase(
                    f"cluster, 3 masters + 1 replica each, wait_replicas={wait}",
                    "`redis+cluster://`",
                    [url],
                    wait,
                )
            )
    if "sentinel" in servers:
        url = servers["sentinel"].url
        for wait in (0, 1):
            cases.append(
                LatencyCase(
                    f"sentinel, 1 master + 1 replica, wait_replicas={wait}",
                    "`redis+sentinel://h:p,h:p,h:p/service`",
                    [url],
                    wait,
                )
            )
    if "tls" in servers:
        cases.append(
            LatencyCase(
                "TLS, CA verification + client certificate",
                "`rediss://h:p/0?ssl_ca_certs=…&ssl_certfile=…&ssl_keyfile=…`",
                [servers["tls"].url],
            )
        )
    if "valkey" in servers:
        cases.append(LatencyCase("Valkey, 1 node", "`redis://h:p/0`", [servers["valkey"].url]))
    return cases


# -- reporting --------------------------------------------------------------------------------


def environment() -> dict[str, str]:
    """The machine and versions, for the report."""
    from topologies import find_valkey_server

    from celery_redlock.testing import find_redis_server

    try:
        valkey = server_version(find_valkey_server())
    except RuntimeError:
        valkey = "no valkey-server"
    return {
        "cpu": cpu_model(),
        "cpus": str(os.cpu_count()),
        "python": platform.python_version(),
        "redis_server": server_version(find_redis_server()),
        "valkey_server": valkey,
        "redis-py": importlib.metadata.version("redis"),
        "load_before": " / ".join(f"{value:.2f}" for value in os.getloadavg()),
    }


def failures_text(failures: Counter[str]) -> str:
    """``"raised X x3, not acquired x1"``, or ``"none"``."""
    return ", ".join(f"{name} x{count}" for name, count in sorted(failures.items())) or "none"


def median_of(values: Iterator[float] | list[float]) -> float | None:
    """The median, or None when there is nothing to take it of."""
    collected = list(values)
    return float(statistics.median(collected)) if collected else None


def per_successful_pair(
    case: ThroughputCase, seconds: Callable[[ThroughputSample], float]
) -> float | None:
    """The median over rounds of ``seconds(sample)`` per successful pair, in seconds."""
    return median_of(
        seconds(sample) / sample.successes for sample in case.samples if sample.successes
    )


def figure(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    """``value * scale`` with thousands separators, or ``"—"``."""
    return "—" if value is None else f"{value * scale:,.{digits}f}"


def throughput_table(cases: Sequence[ThroughputCase], options: argparse.Namespace) -> list[str]:
    """The throughput table, the cluster / standalone ratio, the load during the runs."""
    measured = [case for case in cases if case.samples]
    if not measured:
        return ["Throughput: not measured."]
    lines = [
        f"**Throughput**: {options.processes} client processes x {options.threads} threads, one "
        f"`Redlock` per process shared by its threads, distinct lock names; {options.rounds} "
        f"interleaved rounds of {options.seconds:g} s; medians (min - max over rounds). Cores: "
        "CPU seconds per second of the run (servers from `INFO cpu`, clients from their "
        "processes).",
        "",
        "| lock node | pairs/s | min - max | server cores | client cores | server CPU µs/pair "
        "| client CPU µs/pair | failures |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for case in measured:
        rates = [sample.rate for sample in case.samples]
        server_cores = median_of(s.server_cpu_seconds / s.seconds for s in case.samples)
        client_cores = median_of(s.client_cpu_seconds / s.seconds for s in case.samples)
        server_per_pair = per_successful_pair(case, lambda sample: sample.server_cpu_seconds)
        client_per_pair = per_successful_pair(case, lambda sample: sample.client_cpu_seconds)
        failures: Counter[str] = Counter()
        for sample in case.samples:
            failures.update(sample.failures)
        lines.append(
            f"| {case.name} | {case.median_rate():,.0f} | {min(rates):,.0f} - {max(rates):,.0f} "
            f"| {figure(server_cores, digits=2)} | {figure(client_cores, digits=2)} "
            f"| {figure(server_per_pair, 1e6)} | {figure(client_per_pair, 1e6)} "
            f"| {failures_text(failures)} |"
        )
    by_name = {case.name: case for case in measured}
    standalone, cluster = by_name.get(STANDALONE), by_name.get(CLUSTER)
    if standalone is not None and cluster is not None and standalone.median_rate() > 0:
        by_round = [
            ours.rate / theirs.rate
            for ours, theirs in zip(cluster.samples, standalone.samples, strict=False)
            if theirs.rate
        ]
        ratio = cluster.median_rate() / standalone.median_rate()
        lines += [
            "",
            f"Cluster / standalone: **{ratio:.2f}x** (from the medians; round by round "
            f"{min(by_round):.2f}x - {max(by_round):.2f}x).",
        ]
        ceilings = []
        for case in (standalone, cluster):
            server_per_pair = per_successful_pair(case, lambda sample: sample.server_cpu_seconds)
            if server_per_pair:
                ceilings.append(f"{case.name} ~{len(case.servers) / server_per_pair:,.0f} pairs/s")
        if len(ceilings) == 2:
            lines += [
                "",
                "On paper (not measured): a Redis server runs commands on one core, so at the "
                "server CPU per pair above, the servers would be saturated at: "
                + "; ".join(ceilings)
                + ". Server CPU per pair depends on how many requests arrive together, so read "
                "this as an order of magnitude.",
            ]
    loads = [sample.load_average for case in measured for sample in case.samples]
    lines += [
        "",
        f"1-minute load average at the start of the timed runs: {min(loads):.2f} - "
        f"{max(loads):.2f} (median {statistics.median(loads):.2f}; the benchmark's own "
        "client threads and servers count in it).",
    ]
    return lines


def latency_table(cases: Sequence[LatencyCase], options: argparse.Namespace) -> list[str]:
    """The latency table."""
    if not cases:
        return ["Latency: not measured."]
    lines = [
        f"**Latency** of one uncontended acquire + release from one thread: "
        f"{options.latency_rounds} rounds x {options.pairs} pairs per topology, order rotated "
        "every round; over every successful pair.",
        "",
        "| topology | URL | median µs | p99 µs | pairs | failures |",
        "|---|---|---:|---:|---:|---|",
    ]
    for case in cases:
        if case.durations:
            ordered = sorted(case.durations)
            median = f"{statistics.median(ordered) * 1e6:,.0f}"
            p99 = f"{percentile(ordered, 0.99) * 1e6:,.0f}"
        else:
            median = p99 = "fails"
        lines.append(
            f"| {case.name} | {case.url_form} | {median} | {p99} | {len(case.durations)} "
            f"| {failures_text(case.failures)} |"
        )
    return lines


def markdown(
    throughput: Sequence[ThroughputCase],
    latency: Sequence[LatencyCase],
    options: argparse.Namespace,
    env: dict[str, str],
    notes: Sequence[str],
) -> str:
    """The whole report."""
    lines = ["## Lock throughput and latency per topology", ""]
    lines += throughput_table(throughput, options)
    lines += [""]
    lines += latency_table(latency, options)
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    lines += [
        "",
        f"Machine: {env['cpu']}, {env['cpus']} CPUs shared by every server and client of the "
        f"run; load average (1 / 5 / 15 min) {env['load_before']} before, {env['load_after']} "
        f"after. Per-node timeout {options.node_timeout:g} s, lock ttl {LOCK_TTL:g} s. "
        f"{env['redis_server']}, {env['valkey_server']}, redis-py {env['redis-py']}, Python "
        f"{env['python']}. Took {env['took']}.",
    ]
    return "\n".join(lines)


def to_json(
    throughput: Sequence[ThroughputCase],
    latency: Sequence[LatencyCase],
    env: dict[str, str],
    notes: Sequence[str],
) -> str:
    """Every sample, as JSON."""
    document = {
        "environment": env,
        "notes": list(notes),
        "throughput": [
            {
                "topology": case.name,
                "url": case.url,
                "samples": [
                    {
                        "rate": sample.rate,
                        "seconds": sample.seconds,
                        "outcomes": dict(sample.outcomes),
                        "client_cpu_seconds": sample.client_cpu_seconds,
                        "server_cpu_seconds": sample.server_cpu_seconds,
                        "load_average": sample.load_average,
                    }
                    for sample in case.samples
                ],
            }
            for case in throughput
        ],
        "latency": [
            {
                "topology": case.name,
                "wait_replicas": case.wait_replicas,
                "durations_us": [round(value * 1e6, 1) for value in case.durations],
                "failures": dict(case.failures),
            }
            for case in latency
        ],
    }
    return json.dumps(document, indent=2, ensure_ascii=False)


# -- main -------------------------------------------------------------------------------------


def _topology(text: str) -> tuple[str, str]:
    name, separator, url = text.partition("=")
    if not separator or not name or not url:
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--processes", type=int, default=4, help="client processes")
    parser.add_argument("--threads", type=int, default=4, help="threads per client process")
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per throughput run")
    parser.add_argument(
        "--warmup-seconds", type=float, default=1.0, help="untimed throughput run per topology"
    )
    parser.add_argument("--latency-rounds", type=int, default=10, help="latency rounds")
    parser.add_argument("--pairs", type=int, default=200, help="pairs per latency case and round")
    parser.add_argument(
        "--node-timeout", type=float, default=0.5, help="per-node timeout of every lock manager"
    )
    parser.add_argument("--no-latency", action="store_true", help="measure throughput only")
    parser.add_argument("--verbose", action="store_true", help="show the library's log lines")
    parser.add_argument("--json", metavar="PATH", help="also write every sample as JSON to PATH")
    # Internal: a client process.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--topology", action="append", type=_topology, default=[], help=argparse.SUPPRESS
    )
    arguments = parser.parse_args(argv)
    positive = (arguments.processes, arguments.threads, arguments.rounds, arguments.seconds)
    if not arguments.child and (
        min(positive) <= 0
        or arguments.latency_rounds < 1
        or arguments.pairs < 1
        or arguments.node_timeout <= 0
    ):
        parser.error("counts, seconds and the node timeout must be positive")
    return arguments


def run(options: argparse.Namespace) -> str:
    """Start the servers, measure, stop the servers; the report."""
    began = time.monotonic()

    def log(message: str) -> None:
        print(f"  [{time.monotonic() - began:5.1f} s] {message}", file=sys.stderr, flush=True)

    env = environment()
    print(
        f"{env['cpu']}, {env['cpus']} CPUs; load {env['load_before']}; {env['redis_server']}",
        file=sys.stderr,
    )
    throughput: list[ThroughputCase] = []
    latency: list[LatencyCase] = []
    with contextlib.ExitStack() as stack:
        deployment = Deployment(stack)
        throughput_servers(deployment, log)
        servers = deployment.servers
        if "standalone" in servers:
            node = servers["standalone"][0]
            throughput.append(ThroughputCase(STANDALONE, node.url, [node]))
        if "cluster" in servers:
            cluster = servers["cluster"]
            throughput.append(ThroughputCase(CLUSTER, cluster.url, cluster.masters()))
        if throughput:
            measure_throughput(throughput, options, log)
        if not options.no_latency:
            latency_servers(deployment, log)
            latency = latency_cases(deployment)
            measure_latency(latency, options, log)
        log("stopping the servers")
    env["load_after"] = " / ".join(f"{value:.2f}" for value in os.getloadavg())
    env["took"] = f"{time.monotonic() - began:.0f} s"
    report = markdown(throughput, latency, options, env, deployment.notes)
    if options.json:
        Path(options.json).write_text(
            to_json(throughput, latency, env, deployment.notes) + "\n", encoding="utf-8"
        )
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, internally, one client process); always exit 0."""
    options = parse_arguments(argv)
    quiet_logging(options.verbose)
    if options.child:
        with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
            return child_main(options)
        return 0
    try:
        with interrupt_on_sigterm():
            report = run(options)
    except KeyboardInterrupt:
        print("interrupted; every server it started was stopped", file=sys.stderr)
        return 0
    except Exception:
        traceback.print_exc()
        print("the benchmark failed (see above); every server was stopped", file=sys.stderr)
        return 0
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
