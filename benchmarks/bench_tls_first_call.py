"""What the first lock calls of a process cost over TLS (issue 39): the slowest of 16 threads'
first calls on a new ``Redlock`` over three TLS nodes, against one TLS connection's set-up and
against the same first calls on one of the nodes.

Run from the repository root::

    python benchmarks/bench_tls_first_call.py                     # about half a minute
    python benchmarks/bench_tls_first_call.py --rounds 21 --threads 16
    python benchmarks/bench_tls_first_call.py --variant before=/tmp/before/celery_redlock

Three TLS-only ``redis-server`` processes that require a client certificate (the tests' helpers,
``tests/topologies/``), on free ports of 127.0.0.1, stopped at the end, also on Ctrl-C and
SIGTERM. Every round measures, in an order rotated every round:

* **one connection**: ``Endpoint.open_socket`` on a new endpoint of the working tree's package,
  which builds its context for it, as redis-py does for every connection (the system's
  authorities, the client certificate), connects and shakes hands;
* for the working tree's package and every ``--variant`` (another copy of ``celery_redlock``,
  imported under another name): ``--threads`` threads released at once each take and release
  a lock of their own on a new ``Redlock`` over 1 node and over 3 nodes; the slowest
  acquisition is the sample.

Medians over ``--rounds`` rounds, the ratios to one connection, and the target (3 nodes within
1.5x one connection) as PASS or MISS. It always exits 0: a report, not a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmark_support import interrupt_on_sigterm, variant_argument

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))

NODE_TIMEOUT = 0.5  # seconds: a late reply on a busy machine is not a failed node
TARGET = 1.5


def load_redlock(label: str, directory: str) -> Any:
    """The ``Redlock`` class of the celery_redlock copy in ``directory``."""
    init = os.path.join(directory, "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(f"--variant {label}={directory}: no __init__.py there")
    name = "celery_redlock_variant_" + "".join(c if c.isalnum() else "_" for c in label)
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[directory]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.Redlock


def one_connection(url: str) -> float:
    """Seconds one TLS connection's set-up takes (a context built for it)."""
    from celery_redlock.lock.nodes import Endpoint

    endpoint = Endpoint.from_url(url, NODE_TIMEOUT)
    started = time.perf_counter()
    sock = endpoint.open_socket()
    seconds = time.perf_counter() - started
    sock.close()
    return seconds


def slowest_first_call(redlock_class: Any, urls: list[str], threads: int) -> tuple[float, int]:
    """(seconds of the slowest of ``threads`` threads' first acquisitions, how many failed)."""
    redlock = redlock_class(urls, node_timeout=NODE_TIMEOUT)
    prefix = f"bench:tls:{secrets.token_hex(4)}"
    start = threading.Barrier(threads)
    seconds: list[float] = []
    failed: list[int] = []

    def call(number: int) -> None:
        start.wait()
        started = time.perf_counter()
        try:
            lock = redlock.acquire(f"{prefix}:{number}", 10)
        except Exception:
            lock = None
        seconds.append(time.perf_counter() - started)
        if lock is None or not redlock.release(lock):
            failed.append(number)

    callers = [threading.Thread(target=call, args=(number,)) for number in range(threads)]
    try:
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(60)
    finally:
        redlock.close()
    return max(seconds), len(failed)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11, help="rounds (11)")
    parser.add_argument("--threads", type=int, default=16, help="threads per first call (16)")
    parser.add_argument(
        "--variant",
        type=variant_argument,
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="another copy of the celery_redlock package to measure in the same rounds",
    )
    return parser.parse_args(argv)


def run(arguments: argparse.Namespace) -> None:
    from topologies import TLSCertificates, TopologyServer

    import celery_redlock

    packages = {"working tree": celery_redlock.Redlock}
    for label, directory in arguments.variant:
        packages[label] = load_redlock(label, directory)
    with TLSCertificates.create() as certificates:
        servers = []
        try:
            for _ in range(3):
                servers.append(TopologyServer(tls=certificates, tls_auth_clients=True).start())
            query = certificates.url_options()
            urls = [f"rediss://127.0.0.1:{server.port}/0?{query}" for server in servers]
            cases: dict[str, Callable[[], tuple[float, int]]] = {
                "one connection": lambda: (one_connection(urls[0]), 0)
            }
            for label, redlock_class in packages.items():
                for nodes in (1, 3):
                    cases[f"{label}: first calls, {nodes} node{'s' * (nodes > 1)}"] = (
                        lambda redlock_class=redlock_class, nodes=nodes: slowest_first_call(
                            redlock_class, urls[:nodes], arguments.threads
                        )
                    )
            samples: dict[str, list[float]] = {name: [] for name in cases}
            failures = dict.fromkeys(cases, 0)
            names = list(cases)
            for number in range(arguments.rounds):
                shift = number % len(names)
                for name in names[shift:] + names[:shift]:
                    seconds, failed = cases[name]()
                    samples[name].append(seconds)
                    failures[name] += failed
        finally:
            for server in servers:
                server.stop()
    print(f"celery_redlock: {os.path.dirname(celery_redlock.__file__)}")
    print(f"{arguments.rounds} rounds, {arguments.threads} threads, node_timeout {NODE_TIMEOUT}s")
    print()
    print("| case | median ms | min ms | max ms | x one connection | failed calls |")
    print("|---|---|---|---|---|---|")
    baseline = statistics.median(samples["one connection"])
    for name in names:
        median = statistics.median(samples[name])
        print(
            f"| {name} | {median * 1000:.1f} | {min(samples[name]) * 1000:.1f} | "
            f"{max(samples[name]) * 1000:.1f} | {median / baseline:.2f} | {failures[name]} |"
        )
    print()
    for label in packages:
        ratio = statistics.median(samples[f"{label}: first calls, 3 nodes"]) / baseline
        verdict = "PASS" if ratio <= TARGET else "MISS"
        print(f"{label}: 3 nodes' first calls {ratio:.2f}x one connection ({verdict}, <= {TARGET})")


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    with interrupt_on_sigterm():
        try:
            run(arguments)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
