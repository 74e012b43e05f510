"""One robustness run: start the lock nodes and the fenced stores, the client processes
(`workload`) and the nemeses (`nemeses`), wait for the end, read what the nodes kept, check the
merged history (`checker`), and print the figures; on a violation also the seed, the nemesis
schedule and the history around it, and the command that runs the same again.

    python -m tests.robustness --minutes 2 --seed 7 --nemesis pause,cut,exception

The clients' threads race each other, so a seed fixes the faults' moments and targets and every
client's choices, not the interleaving: a rerun of a failing seed finds the same kind of
violation with high probability, not the same records.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy

from celery_redlock.lock import keyspace
from celery_redlock.lock.owner import SEPARATOR
from celery_redlock.testing import RedisNodes, RedisServer
from tests.topologies.sentinel import SentinelGroup

from .celery_app import LOCK_TTL
from .celery_workload import CeleryWorkload
from .checker import Violation, check, leftovers
from .history import Record, read_history, token_hash
from .nemeses import NEMESES, Nemeses, Schedule, Targets
from .workload import STUCK_AFTER, Config, fence_table

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "redlock:"
HEALTHY_TAIL = 3.0
"""Seconds at the end of a run without faults, in which nodes get the clean-ups they missed."""

MIXES = {
    "all": ("pause", "kill", "cut", "busy", "client-pause", "exception"),
    "nodes": ("pause", "kill", "cut"),
    "clients": ("exception", "client-pause", "busy"),
    "sentinel": ("failover",),
}


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.robustness", description=__doc__)
    parser.add_argument("--minutes", type=float, default=2.0, help="length of the run")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument(
        "--nemesis",
        default="all",
        help=f"comma-separated nemeses ({', '.join(NEMESES)}) or a mix ({', '.join(MIXES)}); "
        "'none' for a run without faults",
    )
    parser.add_argument(
        "--mode",
        choices=("lock", "celery"),
        default="lock",
        help="the workload: lock clients (processes x threads), or Celery workers (one prefork, "
        "one threads pool) running singleton tasks of every duplicate policy fed by a producer",
    )
    parser.add_argument("--nodes", type=int, default=3, help="lock nodes (standalone topology)")
    parser.add_argument(
        "--topology",
        choices=("standalone", "sentinel"),
        default="standalone",
        help="the lock nodes: independent servers, or one Sentinel group (a master, "
        "--replicas replicas, 3 sentinels) as the only node",
    )
    parser.add_argument("--replicas", type=int, default=1, help="sentinel topology: replicas")
    parser.add_argument(
        "--wait-replicas", type=int, default=0, help="sentinel topology: redlock_wait_replicas"
    )
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--threads", type=int, default=4, help="threads per client process")
    parser.add_argument("--keys", type=int, default=3, help="resources contended for")
    parser.add_argument("--ttl", default="0.5,2.0", help="ttl range in seconds: LOW,HIGH")
    parser.add_argument("--node-timeout", type=float, default=0.05)
    parser.add_argument(
        "--long-holds",
        type=float,
        default=0.02,
        help="the share of holds kept for two to five ttls, extended every third of the ttl as "
        "the keeper extends a running task's lock",
    )
    parser.add_argument(
        "--interrupt-every",
        type=float,
        default=0.0,
        help="exception nemesis: library lines between faults on average (default 2000; with "
        "signals: that many microseconds)",
    )
    parser.add_argument(
        "--postgresql",
        default=os.environ.get(
            "ROBUSTNESS_POSTGRESQL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
        help="where fenced writes go besides Redis; 'none' to skip",
    )
    parser.add_argument(
        "--cut-every",
        type=float,
        default=0.0,
        help="cut nemesis: seconds between cuts on average (default: 10-60 ms)",
    )
    parser.add_argument(
        "--interrupt",
        default="signal,trace",
        help="exception nemesis: how faults are raised in the clients' main thread: 'signal' "
        "(a handler raising at random moments, as a soft time limit), 'trace' (at library "
        "lines, each line soon, wherever a signal handler's exception can land), or both (half "
        "the client processes each)",
    )
    parser.add_argument(
        "--fault-scope",
        default="",
        help="exception nemesis, trace: only in library files under this path (relative to "
        "the package, e.g. lock/nodes/), or in one function of one (lock/nodes/channel.py:"
        "_connect_locked); default: the whole package",
    )
    parser.add_argument(
        "--package",
        default="",
        help="the lock clients (or, with --mode celery, the workers) import this copy of "
        "celery_redlock (the directory holding its __init__.py), e.g. the code before a change; "
        "default: the working tree's",
    )
    parser.add_argument("--keep", action="store_true", help="keep the history directory")
    arguments = parser.parse_args(argv)
    if arguments.seed is None:
        arguments.seed = random.SystemRandom().randrange(1, 2**31)
    names: list[str] = []
    for word in arguments.nemesis.split(","):
        word = word.strip()
        if word in MIXES:
            names += MIXES[word]
        elif word in NEMESES:
            names.append(word)
        elif word != "none":
            parser.error(f"unknown nemesis {word!r}: choose from {', '.join((*NEMESES, *MIXES))}")
    arguments.nemeses = list(dict.fromkeys(names))
    low, _, high = arguments.ttl.partition(",")
    arguments.ttl_range = (float(low), float(high or low))
    return arguments


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse(sys.argv[1:] if argv is None else argv)
    command = reproduce_command(arguments)
    print(f"robustness: seed {arguments.seed}, nemeses {arguments.nemeses or ['none']}")
    print(f"  again: {command}", flush=True)
    directory = Path(tempfile.mkdtemp(prefix="robustness-"))
    table_name = f"robustness_{os.getpid()}"
    engine = None
    if arguments.postgresql != "none":
        engine = sqlalchemy.create_engine(arguments.postgresql)
        fence_table(table_name).create(engine)
    try:
        with contextlib.ExitStack() as stack:
            store = stack.enter_context(RedisServer())
            if arguments.topology == "sentinel":
                group = stack.enter_context(SentinelGroup(replicas=arguments.replicas))
                topology = Topology([group.url], [], group)
            else:
                nodes = stack.enter_context(RedisNodes(arguments.nodes))
                topology = Topology(nodes.urls, list(nodes.servers), None)
            violations, figures = run(arguments, topology, store, directory, table_name)
    finally:
        if engine is not None:
            fence_table(table_name).drop(engine, checkfirst=True)
            engine.dispose()
    for line in figures:
        print(line)
    if violations:
        print(f"\nVIOLATIONS: {len(violations)} (seed {arguments.seed})")
        history = read_history(directory)
        for violation in violations[:10]:
            print(f"\n- {violation}")
            for record in around(history, violation):
                print(f"    {json.dumps(record, separators=(',', ':'))}")
        print(f"\nreproduce: {command}")
        print(f"history kept in {directory}")
        return 1
    print("\n0 violations")
    if not arguments.keep:
        shutil.rmtree(directory)
    else:
        print(f"history kept in {directory}")
    return 0


@dataclasses.dataclass
class Topology:
    """The lock nodes of a run: the URLs clients use, the servers the node nemeses act on, the
    Sentinel group of the sentinel topology."""

    urls: list[str]
    servers: list[RedisServer]
    sentinel: SentinelGroup | None

    def data_servers(self) -> list[RedisServer]:
        """Where lock keys live now."""
        return [self.sentinel.master()] if self.sentinel is not None else self.servers


def run(
    arguments: argparse.Namespace,
    topology: Topology,
    store: RedisServer,
    directory: Path,
    table_name: str,
) -> tuple[list[Violation], list[str]]:
    seconds = arguments.minutes * 60
    started = time.monotonic()
    until = started + seconds + HEALTHY_TAIL
    keys = [f"resource-{number}" for number in range(arguments.keys)]
    workload: LockClients | CeleryWorkload
    if arguments.mode == "celery":
        workload = CeleryWorkload(
            ROOT,
            directory,
            store,
            topology.urls,
            keys,
            arguments.seed,
            arguments.node_timeout,
            starting_directory(directory, arguments.package),
        )
    else:
        workload = LockClients(arguments, topology, store, directory, table_name, keys, until)
    workload.start()
    schedule = Schedule(time.monotonic())
    targets = Targets(
        topology.servers,
        workload.clients,
        arguments.ttl_range[1],
        topology.sentinel,
        arguments.cut_every,
    )
    nemeses = Nemeses(arguments.nemeses, arguments.seed, targets, schedule)
    nemeses.start()
    try:
        time.sleep(max(until - HEALTHY_TAIL - time.monotonic(), 0))
    finally:
        nemeses.stop()
    time.sleep(max(until - time.monotonic(), 0))
    violations = workload.finish()
    checked_at = time.monotonic()
    on_nodes = read_nodes(topology.data_servers(), keys)
    history = read_history(directory)
    violations += check(history)
    longest = arguments.ttl_range[1] if arguments.mode == "lock" else LOCK_TTL
    violations += leftovers(on_nodes, history, longest, checked_at)
    violations += library_errors(history)
    return violations, figures(arguments, history, schedule, violations)


def starting_directory(directory: Path, package: str) -> Path:
    """Where the clients (lock clients or Celery workers) start: the working tree, or with
    ``package`` a directory in the run's ``directory`` whose only entry is that copy of the
    library: first on their path (``-m`` puts the working directory there), ahead of the working
    tree and its editable install; ``tests`` still comes from the working tree."""
    if not package:
        return ROOT
    working_directory = directory / "package"
    working_directory.mkdir(exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (working_directory / "celery_redlock").symlink_to(Path(package).resolve())
    return working_directory


class ClientProcess:
    """One `workload` process."""

    def __init__(self, index: int, config_path: Path, directory: Path, package: str) -> None:
        self.index = index
        self.log = directory / f"p{index}.log"
        inherited = os.environ.get("PYTHONPATH", "")
        path = [str(ROOT), inherited]
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.robustness.workload", str(config_path), str(index)],
            cwd=starting_directory(directory, package),
            env=environment,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )

    def __str__(self) -> str:
        return f"client {self.index} (pid {self.process.pid})"

    @property
    def is_running(self) -> bool:
        return self.process.poll() is None

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def finish(self, until: float) -> Violation | None:
        """Wait for the end; a client that hung or failed is a violation."""
        try:
            status = self.process.wait(timeout=max(until - time.monotonic(), 0) + STUCK_AFTER + 10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            status = self.process.wait()
        if status == 0:
            return None
        log = self.log.read_text(errors="replace")
        if "most recent call first" in log:
            return Violation(
                "client-stuck", "-", f"{self}: its threads still waited:\n{log[-6000:]}"
            )
        return Violation("client-failed", "-", f"{self} ended with status {status}:\n{log[-6000:]}")


class LockClients:
    """The lock workload: `workload` processes."""

    def __init__(
        self,
        arguments: argparse.Namespace,
        topology: Topology,
        store: RedisServer,
        directory: Path,
        table_name: str,
        keys: list[str],
        until: float,
    ) -> None:
        exception = "exception" in arguments.nemeses
        config = Config(
            urls=topology.urls,
            keys=keys,
            threads=arguments.threads,
            until=until,
            seed=arguments.seed,
            history=str(directory),
            ttl_range=arguments.ttl_range,
            node_timeout=arguments.node_timeout,
            wait_replicas=arguments.wait_replicas,
            fence_redis=store.url,
            fence_table=table_name if arguments.postgresql != "none" else "",
            postgresql=arguments.postgresql,
            interrupt=arguments.interrupt.split(",") if exception else [],
            fault_scope=arguments.fault_scope,
            interrupt_every=arguments.interrupt_every or 2000.0,
            long_holds=arguments.long_holds,
        )
        self.config_path = directory / "config.json"
        self.config_path.write_text(json.dumps(dataclasses.asdict(config)))
        self.directory = directory
        self.count = arguments.processes
        self.package = arguments.package
        self.until = until
        self.clients: list[ClientProcess] = []

    def start(self) -> None:
        self.clients = [
            ClientProcess(index, self.config_path, self.directory, self.package)
            for index in range(self.count)
        ]

    def finish(self) -> list[Violation]:
        ended = [client.finish(self.until) for client in self.clients]
        return [violation for violation in ended if violation is not None]


def read_nodes(
    nodes: Sequence[RedisServer], resources: Sequence[str]
) -> list[tuple[str, str, str, int]]:
    """``(node, key, token hash, pttl)`` of every lock key (0.2 layout included) left on the
    nodes."""
    found = []
    for node in nodes:
        with node.client(socket_timeout=5) as client:
            for resource in resources:
                key = keyspace.lock_key(PREFIX, resource)
                for name in (key, keyspace.legacy_key(PREFIX, key)):
                    if name is None:
                        continue
                    value = client.get(name)
                    if value is None:
                        continue
                    token = value.decode(errors="replace").partition(SEPARATOR)[0]
                    found.append((node.address, name, token_hash(token), client.pttl(name)))
    return found


def library_errors(history: Sequence[Record]) -> list[Violation]:
    """Library calls that raised an exception nobody injected: a bug whatever the fault."""
    return [
        Violation("library-error", record["key"], f"{record['op']}: {record['error']}", [record])
        for record in history
        if record["op"] != "write" and "error" in record
    ]


def figures(
    arguments: argparse.Namespace,
    history: Sequence[Record],
    schedule: Schedule,
    violations: Sequence[Violation],
) -> list[str]:
    """The run in numbers, one line each."""
    outcomes = Counter(record["outcome"] for record in history if record["op"] == "acquire")
    writes = Counter(
        {True: "accepted", False: "refused", None: "failed"}[record["accepted"]]
        for record in history
        if record["op"] == "write"
    )
    faults = dict(schedule.counts())
    # Counted where they hit (the clients' summaries are lost with a stuck client).
    injected = sum(1 for record in history if record.get("interrupted"))
    if injected:
        faults["exception"] = injected
    tasks = Counter(record["event"] for record in history if record["op"] == "task")
    kinds = Counter(violation.kind for violation in violations)
    lines = [
        f"\nfigures ({arguments.minutes} min, seed {arguments.seed}, {describe(arguments)}, "
        f"{arguments.keys} keys):",
        f"  operations: {len(history)}",
    ]
    if arguments.mode == "celery":
        lines.append(f"  tasks: {dict(tasks)}")
    else:
        lines.append(f"  acquisitions: {dict(outcomes)}")
        lines.append(f"  holds: {outcomes.get('acquired', 0)}")
        lines.append(f"  fenced writes: {dict(writes)}")
    lines.append(f"  faults injected: {faults}")
    lines.append(f"  violations: {dict(kinds) or 0}")
    return lines


def around(history: Sequence[Record], violation: Violation, seconds: float = 0.5) -> list[Record]:
    """The records of the violation's key within ``seconds`` of its own records (at most 40)."""
    if not violation.records:
        return []
    low = min(record["start"] for record in violation.records) - seconds
    high = max(record["end"] for record in violation.records) + seconds
    nearby = [
        record
        for record in history
        if record["key"] == violation.key and record["end"] >= low and record["start"] <= high
    ]
    return nearby[:40]


def reproduce_command(arguments: argparse.Namespace) -> str:
    words = ["nox", "-s", "robustness", "--", "--minutes", str(arguments.minutes)]
    words += ["--seed", str(arguments.seed), "--nemesis", ",".join(arguments.nemeses) or "none"]
    options = [
        "mode",
        "topology",
        "nodes",
        "replicas",
        "wait_replicas",
        "processes",
        "threads",
        "keys",
    ]
    options += ["long_holds", "node_timeout", "interrupt_every", "interrupt", "fault_scope"]
    options += ["package"]
    for option in [*options, "cut_every"]:
        default = parse([]).__dict__[option]
        value = getattr(arguments, option)
        if value != default:
            words += [f"--{option.replace('_', '-')}", str(value)]
    if arguments.ttl != "0.5,2.0":
        words += ["--ttl", arguments.ttl]
    return shlex.join(words)


def describe(arguments: argparse.Namespace) -> str:
    nodes = f"{arguments.nodes} nodes"
    if arguments.topology == "sentinel":
        nodes = (
            f"one Sentinel group ({arguments.replicas} replicas, "
            f"wait_replicas {arguments.wait_replicas})"
        )
    if arguments.mode == "celery":
        return f"{nodes}, a prefork and a threads worker"
    return f"{nodes}, {arguments.processes} processes x {arguments.threads} threads"
