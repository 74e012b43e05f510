"""`ManagedProcess`, the harness's one process manager (its Redis servers and Celery processes
are kinds of it), and `stop_processes`."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

_ProcessT = TypeVar("_ProcessT", bound="ManagedProcess")

_REAP_TIMEOUT = 10.0  # seconds to wait for a SIGKILLed process to be reaped
_EXIT_POLL_INTERVAL = 0.01  # how often stop_processes looks for exits (and asks `hurry`)


class ProcessExitedError(RuntimeError):
    """A process expected to run has exited; the message ends with the end of its output."""


class ManagedProcess:
    """One command run as a child process, its output appended to a log file; killed at
    interpreter exit if still running.

    Nothing starts in the constructor: :meth:`start`, or a ``with`` block, which kills it on
    exit. An exited process can be started again. By default it runs in a process group of its
    own, which signals reach (a worker's pool children) and a Ctrl-C does not; with
    ``own_process_group=False`` it shares the caller's and signals reach the main process only.
    The main process stays unreaped (its pid reserved, so signalling its group is safe) until
    :meth:`kill`, :meth:`stop` or :meth:`wait`. What needs a run raises `RuntimeError` before
    :meth:`start`.

    The other options, each of which may be left out: ``environment`` (variables added to the
    caller's environment, or the whole environment with ``inherit_environment=False``),
    ``python_path`` (put first on ``PYTHONPATH``), ``working_directory``, ``log_path`` (by
    default a new temporary file) and ``label`` (a short name for messages; by default the
    program's name).
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        own_process_group: bool = True,
        environment: Mapping[str, str] | None = None,
        inherit_environment: bool = True,
        python_path: Sequence[str | os.PathLike[str]] = (),
        working_directory: str | os.PathLike[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        label: str | None = None,
    ) -> None:
        self._command = _checked_command(command)
        self._environment = dict(environment or {})
        self._inherit_environment = inherit_environment
        self._python_path = tuple(os.fspath(entry) for entry in python_path)
        self._working_directory = working_directory  # Popen takes a path-like cwd
        self._label = label or Path(self._command[0]).name
        self._own_process_group = own_process_group
        if log_path is None:
            stem = "celery-redlock-" + "".join(c if c.isalnum() else "-" for c in self._label)
            handle, log_path = tempfile.mkstemp(prefix=f"{stem}-", suffix=".log")
            os.close(handle)
        self._log_path = Path(log_path)
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._cleaned_up = True  # whether the last run was reaped and cleaned up

    @property
    def label(self) -> str:
        return self._label

    @property
    def log_path(self) -> Path:
        """The file holding the process's standard output and error."""
        return self._log_path

    @property
    def pid(self) -> int:
        """The main process's id (and its group's, with a group of its own)."""
        return self._started().pid

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal), read without reaping; ``None``
        while it runs or before it starts."""
        return None if self._process is None else _exit_status(self._process)

    @property
    def is_running(self) -> bool:
        """Whether the main process was started and has not exited (paused counts)."""
        return self._process is not None and self.returncode is None

    @property
    def is_paused(self) -> bool:
        """Whether the process runs but is frozen by :meth:`pause`."""
        return self._paused and self.is_running

    def start(self: _ProcessT) -> _ProcessT:
        """Launch the process, without waiting for anything; return ``self``. `RuntimeError`
        if it runs already."""
        if self.is_running:
            raise RuntimeError(f"{self._label} is already running (pid {self.pid})")
        if self._process is not None:
            self._reap(self._process)  # the last run has exited: reaped and cleaned up now
        environment = dict(os.environ) if self._inherit_environment else {}
        environment.update(self._environment)
        if self._python_path:
            entries = [*self._python_path, environment.get("PYTHONPATH", "")]
            environment["PYTHONPATH"] = os.pathsep.join(entry for entry in entries if entry)
        with self._log_path.open("ab") as log:
            self._process = subprocess.Popen(
                list(self._command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
                cwd=self._working_directory,
                start_new_session=self._own_process_group,
            )
        self._paused = False
        self._cleaned_up = False
        atexit.register(self._kill_at_exit)
        return self

    def check_alive(self) -> None:
        """Raise `ProcessExitedError` (with the end of the output) if the main process exited."""
        process = self._started()
        returncode = self.returncode
        if returncode is not None:
            raise ProcessExitedError(
                f"{self._label} (pid {process.pid}) exited with status {returncode}; end of "
                f"its output ({self._log_path}):\n{self.log_tail() or '(log is empty)'}"
            )

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the process group (with a group of its own; else to the main
        process); nothing once the main process has exited."""
        process = self._started()
        if self.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self._own_process_group:
                os.killpg(process.pid, signum)
            else:
                process.send_signal(signum)

    def pause(self) -> None:
        """Freeze the process and its group (SIGSTOP), like a hung machine; `RuntimeError` if it
        does not run."""
        self._check_running()
        self.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Unfreeze a process frozen by :meth:`pause` (SIGCONT); `RuntimeError` if it does not
        run."""
        self._check_running()
        self.send_signal(signal.SIGCONT)
        self._paused = False

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the main process exits, reap it and return its exit status;
        `subprocess.TimeoutExpired` if it still runs after ``timeout`` seconds."""
        status = self._started().wait(timeout)
        self._reaped()
        return status

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL (to the group) for what is left after ``timeout`` seconds; reap
        the process and return its exit status (``None`` if never started)."""
        stop_processes([self], timeout)
        return None if self._process is None else self._process.returncode

    def kill(self) -> None:
        """SIGKILL the process (its whole group, with a group of its own) and reap it; safe to
        repeat, and nothing if never started."""
        process = self._process
        if process is None:
            return
        if self._own_process_group:
            # The group's id is the main process's pid, which is not reused while the process
            # is unreaped or its group still has members.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        elif process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        self._reap(process)

    def after_exit(self) -> None:
        """Called once after each run is reaped; kinds of process clean up what a run left."""

    def log_text(self) -> str:
        try:
            return self._log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def remove_log(self) -> None:
        with contextlib.suppress(OSError):
            self._log_path.unlink()

    def __enter__(self: _ProcessT) -> _ProcessT:
        if not self.is_running:
            self.start()
        return self

    def __exit__(self, *exception: object) -> None:
        self.close()

    def close(self) -> None:
        self.kill()

    def __repr__(self) -> str:
        if self._process is None:
            return f"<{type(self).__name__} {self._label} not started>"
        returncode = self.returncode
        state = "paused" if self._paused else "running"
        if returncode is not None:
            state = f"exited {returncode}"
        return f"<{type(self).__name__} {self._label} pid {self._process.pid} {state}>"

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise RuntimeError(f"{self._label} was never started")
        return self._process

    def _check_running(self) -> None:
        if not self.is_running:
            raise RuntimeError(f"{self._label} is not running")

    def _reap(self, process: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(_REAP_TIMEOUT)
        if process.returncode is not None:
            self._reaped()

    def _reaped(self) -> None:
        self._paused = False
        if self._cleaned_up:
            return
        self._cleaned_up = True
        atexit.unregister(self._kill_at_exit)
        self.after_exit()

    def _kill_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.kill()


def _checked_command(command: Sequence[str]) -> tuple[str, ...]:
    if isinstance(command, str):
        raise TypeError("command must be a sequence of arguments, not one string")
    if not command:
        raise ValueError("command is empty")
    return tuple(str(argument) for argument in command)


def _exit_status(process: subprocess.Popen[bytes]) -> int | None:
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


def stop_processes(
    processes: Iterable[ManagedProcess],
    timeout: float = 10.0,
    *,
    hurry: Callable[[], bool] | None = None,
) -> None:
    """Stop several processes at once: SIGTERM to each (paused ones resumed), wait at most
    ``timeout`` seconds in all (less once ``hurry()`` is true), then SIGKILL every group and
    reap every process. Never-started or gone processes are fine; repeating is harmless."""
    chosen = [process for process in processes if process._process is not None]
    for process in chosen:
        if process.is_running:
            process.send_signal(signal.SIGTERM)
            # A stopped process acts on SIGTERM only once continued; SIGCONT to a running one
            # is ignored, so it goes whether or not pause() froze it (a test may SIGSTOP it).
            process.send_signal(signal.SIGCONT)
            process._paused = False
    # Waiting reaps nothing (`is_running`), so the pids stay reserved for the SIGKILLs below.
    deadline = time.monotonic() + timeout
    while any(process.is_running for process in chosen) and time.monotonic() < deadline:
        if hurry is not None and hurry():
            break
        time.sleep(_EXIT_POLL_INTERVAL)
    for process in chosen:
        process.kill()
