"""Celery worker and beat subprocesses that always go away: one process group each.

Every process starts in a session (and process group) of its own, so that

- a Ctrl-C in the terminal reaches only the demo runner, which then stops the fleet in order
  (beat first, then the workers) instead of every process dying at its own pace;
- stopping a worker reaches its prefork children too: SIGTERM to the whole group (Celery's warm
  shutdown: running tasks finish), then SIGKILL to the group after a grace period, and a final
  SIGKILL sweep of the group for any child its parent left behind.

The processes are `celery_redlock.testing.ManagedProcess` and are stopped by
`celery_redlock.testing.stop_processes`, the helpers the tests and benchmarks use too.

`SignalGuard` turns SIGINT, SIGTERM and SIGHUP into ``KeyboardInterrupt`` in the runner, defers
them while a process is being spawned (so no child is ever started without being tracked), and
during clean-up makes a second Ctrl-C mean "kill now" instead of aborting the clean-up.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from celery_redlock.testing import ManagedProcess, stop_processes

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
    """One subprocess of the fleet (a worker or beat), a `celery_redlock.testing.ManagedProcess`
    logging to ``<log_dir>/<name>.log``."""

    name: str
    process: ManagedProcess

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def exited(self) -> bool:
        """Whether the main process has exited, without reaping it (its pid stays reserved, so
        the group can still be swept safely)."""
        return not self.process.is_running

    def log_tail(self, lines: int = 25) -> str:
        return self.process.log_tail(lines) or "(log is empty)"


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
        with self.guard.deferred():
            process = ManagedProcess(
                argv,
                environment=self.env,
                inherit_environment=False,
                working_directory=self.cwd,
                log_path=self.log_dir / f"{name}.log",
                label=name,
            ).start()
            member = Member(name, process)
            self.members.append(member)
        return member

    def running(self) -> list[Member]:
        return [member for member in self.members if not member.exited()]

    def stop(self, members: Sequence[Member] | None = None, grace: float = 15.0) -> None:
        """SIGTERM each group, SIGKILL what is left after ``grace`` seconds, reap everything.

        A second Ctrl-C (the guard's ``hurry``) cuts the grace period short. Never raises for
        processes that are already gone; safe to call repeatedly.
        """
        members = list(self.members if members is None else members)
        stop_processes(
            [member.process for member in members], grace, hurry=lambda: self.guard.hurry
        )

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop(grace=3.0)
