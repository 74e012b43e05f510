"""Waiting for processes to exit without reaping them (their pids stay reserved, so signalling
their process groups afterwards is safe)."""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Callable, Sequence

_HURRY_CHECK_INTERVAL = 0.05  # how often a wait asks `hurry`
_EXIT_POLL_INTERVAL = 0.01  # without pidfd (not Linux): how often exits are polled


def exit_status(process: subprocess.Popen[bytes]) -> int | None:
    """The exit status of ``process`` (negative: killed by that signal), read without reaping
    it; ``None`` while it runs."""
    if process.returncode is not None:
        return process.returncode
    if not hasattr(os, "waitid"):  # macOS: no waitid, so poll (which reaps)
        return process.poll()
    try:
        result = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped behind our back (os.wait): Popen knows no status
        return process.poll()
    if result is None:
        return None
    return result.si_status if result.si_code == os.CLD_EXITED else -result.si_status


def _exit_descriptor(process: subprocess.Popen[bytes]) -> int | None:
    """A Linux pidfd of the unreaped ``process`` (the caller closes it), or None."""
    pidfd_open: Callable[[int], int] | None = getattr(os, "pidfd_open", None)
    if pidfd_open is None or process.returncode is not None:
        return None
    try:
        return pidfd_open(process.pid)
    except OSError:  # kernel older than 5.3, or no such process
        return None


def wait_for_exits(
    processes: Sequence[subprocess.Popen[bytes]],
    timeout: float | None,
    hurry: Callable[[], bool] | None = None,
) -> bool:
    """Wait until every process has exited, without reaping any; return whether they
    have. Gives up after ``timeout`` seconds (``None``: never) or once ``hurry()`` is true.
    On Linux, pidfds wake the wait; elsewhere the processes are polled."""
    deadline = None if timeout is None else time.monotonic() + timeout
    descriptors: dict[int, int] = {}  # index in processes -> pidfd
    try:
        for index, process in enumerate(processes):
            descriptor = _exit_descriptor(process)
            if descriptor is not None:
                descriptors[index] = descriptor
        while True:
            pending = [
                index for index, process in enumerate(processes) if exit_status(process) is None
            ]
            if not pending:
                return True
            if hurry is not None and hurry():
                return False
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            watched = [descriptors[index] for index in pending if index in descriptors]
            if len(watched) < len(pending):
                step: float | None = _EXIT_POLL_INTERVAL
            elif hurry is not None:
                step = _HURRY_CHECK_INTERVAL
            else:
                step = remaining
            if step is not None and remaining is not None:
                step = min(step, remaining)
            if watched:
                # poll, not select: select refuses descriptors numbered past FD_SETSIZE (1024).
                poller = select.poll()
                for descriptor in watched:
                    poller.register(descriptor, select.POLLIN)
                poller.poll(None if step is None else step * 1000)
            else:
                time.sleep(step or 0)
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)
