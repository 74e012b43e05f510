"""Celery worker and beat subprocesses that always go away: one process group each.

Every process starts in a session (and process group) of its own, so that

- a Ctrl-C in the terminal reaches only the demo runner, which then stops the fleet in order
  (beat first, then the workers) instead of every process dying at its own pace;
- stopping a worker reaches its prefork children too: SIGTERM to the whole group (Celery's warm
  shutdown: running tasks finish), then SIGKILL to the group after a grace period, and a final
  SIGKILL sweep of the group for any child its parent left behind.

`SignalGuard` turns SIGINT, SIGTERM and SIGHUP into ``KeyboardInterrupt`` in the runner, defers
them while a process is being spawned (so no child is ever started without being tracked), and
during clean-up makes a second Ctrl-C mean "kill now" instead of aborting the clean-up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SignalGuard:
    """SIGINT/SIGTERM/SIGHUP -> KeyboardInterrupt, deferred inside `deferred()` blocks."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.stopping = False
        self.hurry = False
        self._depth = 0
        self._pending = False
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            with contextlib.suppress(TypeError, ValueError):
                signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            self.hurry = True  # a second Ctrl-C during clean-up: kill instead of waiting
            return
        self.received = signum
        if self._depth:
            self._pending = True
            return
        raise KeyboardInterrupt

    def begin_cleanup(self) -> None:
        """From now on signals only speed the clean-up up; they never interrupt it."""
        self.stopping = True

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold a stop signal until the block ends (it is raised right after)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending and not self.stopping:
                self._pending = False
                raise KeyboardInterrupt


@dataclass(eq=False)
class Member:
    """One subprocess of the fleet (a worker or beat) and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    exit_code: int | None = field(default=None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> bool:
        """Whether the main process has exited, without reaping it (its pid stays reserved, so
        the group can still be swept safely)."""
        if self.exit_code is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:]) or "(log is empty)"


class Fleet:
    """The subprocesses the demo started; `stop` ends them and everything they started."""

    def __init__(self, guard: SignalGuard, *, env: dict[str, str], cwd: Path, log_dir: Path):
        self.guard = guard
        self.env = env
        self.cwd = cwd
        self.log_dir = log_dir
        self.members: list[Member] = []

    def spawn(self, name: str, argv: Sequence[str]) -> Member:
        """Start ``argv`` in a new session, output to ``<log_dir>/<name>.log``."""
        log_path = self.log_dir / f"{name}.log"
        with self.guard.deferred():
            log_file = log_path.open("ab")
            try:
                popen = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                )
            except BaseException:
                log_file.close()
                raise
            member = Member(name, popen, log_path, log_file)
            self.members.append(member)
        return member

    def running(self) -> list[Member]:
        return [member for member in self.members if not member.exited()]

    def stop(self, members: Sequence[Member] | None = None, grace: float = 15.0) -> None:
        """SIGTERM each group, SIGKILL what is left after ``grace`` seconds, reap everything.

        Never raises for processes that are already gone; safe to call repeatedly.
        """
        members = list(self.members if members is None else members)
        for member in members:
            if not member.exited():
                _signal_group(member.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(not member.exited() for member in members):
            if self.guard.hurry or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for member in members:
            # The main process may be gone while a prefork child lingers: sweep the group.
            # Its pid is not reaped yet, so the group id cannot belong to anybody else.
            _signal_group(member.pid, signal.SIGKILL)
            if member.exit_code is None:
                member.exit_code = member.popen.wait()
            member.log_file.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop(grace=3.0)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
