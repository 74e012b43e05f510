"""Where a singleton task's CPU goes on the worker thread: each stage of a run, against plain.

Run from the repository root::

    python benchmarks/split_run.py              # 2,000 tasks per variant, 1 lock node, 2 rounds
    python benchmarks/split_run.py --nodes 5 --tasks 4000
    python benchmarks/split_run.py --nodes 5 --pin   # servers on CPU 0, the worker on CPU 1

Starts its own ``redis-server`` processes on free ports (a broker and the lock nodes) and, per
round and variant, queues ``--tasks`` no-op calls (distinct arguments) first, then starts an
embedded solo worker in this process and lets it run them all. The window runs from the first
call's ``task_prerun`` to the last call's ``task_postrun``. Printed per variant: wall and
worker-thread CPU per task (``time.thread_time``); for ``@singleton_task``, the thread CPU of
each stage of `celery_redlock.integration.run.Run` (measured by wrapping the methods: a wrapper
adds about a microsecond), of the node layer's acquire round and release, and of the lock client
alone in a loop on the same nodes (acquire + release, the release waited for or not). What the
worker thread spends outside ``SingletonTask.__call__`` beyond plain is Celery's and the host's
(caches, the scheduler), not the package's.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmark_support import PRODUCTION_SERVER
from celery import Celery, signals
from celery.contrib.testing.worker import start_worker

from celery_redlock import Redlock, singleton_task
from celery_redlock.integration.run import Run
from celery_redlock.integration.task import SingletonTask
from celery_redlock.lock.nodes.group import NodeGroup
from celery_redlock.testing import RedisNodes, RedisServer

STAGES: list[tuple[type, str, str]] = [
    (SingletonTask, "__call__", "SingletonTask.__call__ (the whole run)"),
    (Run, "__init__", "  Run() (key, token, owner text, record)"),
    (Run, "take_lock", "  Run.take_lock (attempt + decision)"),
    (NodeGroup, "run", "    NodeGroup.run (acquire round + release send)"),
    (Run, "hold_while_running", "  Run.hold_while_running (keeper, report)"),
    (Run, "finish", "  Run.finish (release, report)"),
]


def wrap_stages(spent: dict[str, float]) -> Callable[[], None]:
    """Wrap each stage to add its thread CPU to ``spent``; returns the undo."""
    originals = []
    for owner, name, label in STAGES:
        original = owner.__dict__[name]

        def wrapper(
            *args: Any, __original: Any = original, __label: str = label, **kwargs: Any
        ) -> Any:
            started = time.thread_time()
            try:
                return __original(*args, **kwargs)
            finally:
                spent[__label] = spent.get(__label, 0.0) + time.thread_time() - started

        originals.append((owner, name, original))
        setattr(owner, name, wrapper)

    def undo() -> None:
        for owner, name, original in originals:
            setattr(owner, name, original)

    return undo


def run_variant(
    broker: str, urls: list[str], variant: str, tasks: int, label: str
) -> dict[str, float]:
    """Queue ``tasks`` calls, run them in an embedded solo worker; the window's figures."""
    app = Celery(f"split_{label}", broker=broker, set_as_current=False)
    app.conf.update(
        redlock_urls=urls,
        broker_transport_options={"polling_interval": 0.1},
        worker_hijack_root_logger=False,
        task_default_queue=f"split-{label}",
    )
    if variant == "plain":

        @app.task(name=f"split.{label}", shared=False)
        def noop(item: str) -> str:
            return item

    else:

        @singleton_task(app=app, shared=False, name=f"split.{label}")
        def noop(item: str) -> str:
            return item

    window: dict[str, float] = {}
    ended = {"count": 0}
    done = threading.Event()

    def prerun(**_: Any) -> None:
        if "wall" not in window:
            window["wall"], window["cpu"] = time.perf_counter(), time.thread_time()

    def postrun(**_: Any) -> None:
        ended["count"] += 1
        if ended["count"] == tasks:
            window["wall"] = time.perf_counter() - window["wall"]
            window["cpu"] = time.thread_time() - window["cpu"]
            done.set()

    signals.task_prerun.connect(prerun, weak=False)
    signals.task_postrun.connect(postrun, weak=False)
    try:
        for item in range(tasks):
            noop.apply_async((f"{label}-{item}",), ignore_result=True)
        with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
            if not done.wait(300):
                raise RuntimeError(f"{variant}: only {ended['count']} of {tasks} calls ran")
    finally:
        signals.task_prerun.disconnect(prerun)
        signals.task_postrun.disconnect(postrun)
    return window


def lock_client(urls: list[str], pairs: int, confirm: bool) -> float:
    """Thread CPU per acquire + release of the lock client alone, in a loop."""
    redlock = Redlock(urls)
    try:
        started = time.thread_time()
        for item in range(pairs):
            lock = redlock.acquire(f"split-pair-{confirm}-{item}-{time.monotonic()}", ttl=10.0)
            assert lock is not None
            redlock.release(lock, confirm=confirm)
        return (time.thread_time() - started) / pairs
    finally:
        redlock.close()


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the rounds, print the split."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1, help="lock nodes (1)")
    parser.add_argument("--tasks", type=int, default=2000, help="calls per variant and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (2)")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the broker and the lock nodes on CPU 0, the worker (this process) on CPU 1",
    )
    arguments = parser.parse_args(argv)
    tasks = arguments.tasks
    if arguments.pin:
        os.sched_setaffinity(0, {0})  # the servers started now inherit it
    with (
        RedisServer(extra_args=PRODUCTION_SERVER) as broker,
        RedisNodes(arguments.nodes, extra_args=PRODUCTION_SERVER) as nodes,
    ):
        if arguments.pin:
            os.sched_setaffinity(0, {1})
        for number in range(arguments.rounds):
            plain = run_variant(broker.url, nodes.urls, "plain", tasks, f"plain{number}")
            spent: dict[str, float] = {}
            undo = wrap_stages(spent)
            try:
                singleton = run_variant(broker.url, nodes.urls, "singleton", tasks, f"one{number}")
            finally:
                undo()
            confirmed = lock_client(nodes.urls, tasks, confirm=True)
            unconfirmed = lock_client(nodes.urls, tasks, confirm=False)
            print(f"round {number + 1}, {arguments.nodes} node(s), {tasks} tasks, µs per task")
            for name, window in (("plain", plain), ("singleton_task", singleton)):
                wall, cpu = window["wall"] / tasks * 1e6, window["cpu"] / tasks * 1e6
                print(f"  {name:16} wall {wall:6.0f}   worker thread CPU {cpu:6.0f}")
            added = (singleton["cpu"] - plain["cpu"]) / tasks * 1e6
            print(f"  worker thread CPU added over plain: {added:.0f}")
            for _, _, label in STAGES:
                print(f"    {label:50} {spent.get(label, 0.0) / tasks * 1e6:6.1f}")
            pairs = f"{confirmed * 1e6:.0f} (release waited for), {unconfirmed * 1e6:.0f} (not)"
            print(f"  lock client alone, thread CPU per acquire + release: {pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
