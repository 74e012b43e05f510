"""Which celery_redlock modules one task run executes, in order, on the worker thread.

Run from the repository root::

    python benchmarks/trace_run.py              # 3 lock nodes, a solo worker, the 5th run traced
    python benchmarks/trace_run.py --nodes 1

Starts its own ``redis-server`` processes on free ports (a broker and the lock nodes), an
embedded solo worker, and a ``@singleton_task`` no-op. A profile hook is set in ``task_prerun``
and removed in ``task_postrun`` of one run (after warm-up runs), so it sees exactly what the
run executes in the worker thread: every call into a module of the package is noted. Printed:
the path (consecutive calls within one module collapse into one step), the distinct modules, and
the calls that re-enter a module already on the call stack below another module ("visited twice
on the way down", such as a callback from a lower layer into a higher one).
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from celery import Celery, signals
from celery.contrib.testing.worker import start_worker

import celery_redlock
from celery_redlock import singleton_task
from celery_redlock.testing import RedisNodes, RedisServer

PACKAGE_DIRECTORY = str(Path(celery_redlock.__file__).parent) + "/"


def module_of(frame: FrameType) -> str | None:
    """The package module (``nodes/round``) the frame's code belongs to, or None."""
    filename = frame.f_code.co_filename
    if not filename.startswith(PACKAGE_DIRECTORY):
        return None
    return filename[len(PACKAGE_DIRECTORY) : -len(".py")]


def trace(nodes: int, warmup: int) -> tuple[list[str], list[str]]:
    """The modules one traced run called into, in order (repeats kept), and each re-entry of a
    module already on the stack below another (as ``"lower <- higher"`` stack texts)."""
    calls: list[str] = []
    reentries: list[str] = []
    stack: list[str | None] = []
    worker_thread: list[threading.Thread] = []

    def profile(frame: FrameType, event: str, argument: Any) -> None:
        if event == "call":
            module = module_of(frame)
            if module is not None:
                calls.append(module)
                below = [entry for entry in stack if entry is not None]
                if below and below[-1] != module and module in below:
                    reentries.append(" -> ".join([*dict.fromkeys(below), module]))
            stack.append(module)
        elif event == "return" and stack:
            stack.pop()

    runs = {"count": 0}

    def prerun(**_: Any) -> None:
        runs["count"] += 1
        if runs["count"] == warmup + 1:
            worker_thread.append(threading.current_thread())
            sys.setprofile(profile)

    def postrun(**_: Any) -> None:
        if worker_thread and threading.current_thread() is worker_thread[0]:
            sys.setprofile(None)

    with RedisServer() as broker, RedisNodes(nodes) as lock_nodes:
        app = Celery("trace_run", broker=broker.url, set_as_current=False)
        app.conf.update(
            redlock_urls=lock_nodes.urls,
            result_backend=broker.url,
            broker_transport_options={"polling_interval": 0.1},
            worker_hijack_root_logger=False,
        )

        @singleton_task(app=app, shared=False, name="trace.noop")
        def noop(item: int) -> int:
            return item

        # Connected after the package's own handlers: the hook is set after they ran and
        # removed before theirs (Celery calls receivers in the order they connected).
        signals.task_prerun.connect(prerun, weak=False)
        signals.task_postrun.connect(postrun, weak=False)
        try:
            with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
                results = [
                    noop.apply_async((item,), ignore_result=False) for item in range(warmup + 1)
                ]
                for result in results:
                    result.get(timeout=10)
        finally:
            signals.task_prerun.disconnect(prerun)
            signals.task_postrun.disconnect(postrun)
    return calls, reentries


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, trace one run and print its path."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="lock nodes (3)")
    parser.add_argument("--warmup", type=int, default=4, help="untraced runs first (4)")
    arguments = parser.parse_args(argv)
    calls, reentries = trace(arguments.nodes, arguments.warmup)
    path: list[str] = []
    for module in calls:
        if not path or path[-1] != module:
            path.append(module)
    distinct = sorted(set(path))
    print(f"path ({len(path)} steps): {' -> '.join(path)}")
    print(f"modules ({len(distinct)}): {', '.join(distinct)}")
    print(f"re-entered on the way down ({len(reentries)}):")
    for reentry in dict.fromkeys(reentries):
        print(f"  {reentry}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
