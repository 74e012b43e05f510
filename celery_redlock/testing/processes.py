"""The one process manager of the harness: `ManagedProcess` runs any command, and the Redis
servers and Celery processes of this package are kinds of it.

A managed process is started, paused (SIGSTOP) and resumed (SIGCONT), stopped gracefully
(SIGTERM, then SIGKILL after a timeout), killed (SIGKILL), waited for and reaped; its output goes
to a log file whose end every error quotes; and whatever still runs when the interpreter exits is
killed by an :mod:`atexit` hook.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, TypeVar

from .exits import wait_for_exits
from .resources import ClosingResource

if TYPE_CHECKING:
    from typing import Unpack

__all__ = [
    "LOG_TAIL_LINES",
    "ManagedProcess",
    "ProcessExitedError",
    "ProcessOptions",
    "stop_processes",
]

LOG_TAIL_LINES = 60
"""How many lines of a log `ManagedProcess.log_tail` returns by default."""

_ProcessT = TypeVar("_ProcessT", bound="ManagedProcess")

_REAP_TIMEOUT = 10.0  # seconds to wait for a SIGKILLed process to be reaped


class ProcessExitedError(RuntimeError):
    """A process expected to run has exited; the message ends with the end of its output."""


class ProcessOptions(TypedDict, total=False):
    """The options every `ManagedProcess` takes as keywords, declared once: the kinds of process
    that pass them on (`CeleryProcess`, `CeleryWorker`, `CeleryBeat`) take them as
    ``**options``. Each may be left out."""

    environment: Mapping[str, str] | None
    """Variables for the process, added to the caller's environment (or, with
    ``inherit_environment=False``, the whole environment); by default none."""
    inherit_environment: bool
    """Whether the process starts from the caller's environment; by default it does."""
    python_path: Sequence[str | os.PathLike[str]]
    """Directories put first on the process's ``PYTHONPATH``; by default none."""
    working_directory: str | os.PathLike[str] | None
    """The process's working directory; by default the caller's."""
    log_path: str | os.PathLike[str] | None
    """The file the process's standard output and error are appended to; by default a new
    temporary file (`ManagedProcess.remove_log` deletes it)."""
    label: str | None
    """A short name for messages; by default the program's name (or what the kind of process
    says)."""


class ManagedProcess(ClosingResource):
    """One command run as a child process, its output appended to a log file.

    The constructor starts nothing: call :meth:`start`, or use the instance as a context manager,
    which starts it on entry and kills it on exit. A process that has exited can be started again
    (the same command, or another one set with :meth:`reconfigure`).

    By default the process runs in a session, and so a process group, of its own: :meth:`kill`,
    :meth:`stop`, :meth:`pause` and :meth:`resume` also reach every process it started (a
    worker's pool children), and a terminal's Ctrl-C reaches only the caller. With
    ``own_process_group=False`` it stays in the caller's group (a Ctrl-C reaches it too) and
    signals go to the main process only.

    The main process is not reaped until it is killed or waited for (:meth:`kill`, :meth:`stop`,
    :meth:`wait`): until then its pid stays reserved, so signalling its group can only ever reach
    the processes it started. :attr:`returncode`, :attr:`is_running` and :meth:`wait_for_exit`
    look at it without reaping it. A started process not yet reaped is killed when the
    interpreter exits.

    Args:
        command: the program and its arguments.
        own_process_group: whether the process gets a session and process group of its own.
        **options: the `ProcessOptions`: ``environment``, ``inherit_environment``,
            ``python_path``, ``working_directory``, ``log_path``, ``label``.

    Raises:
        TypeError: a keyword that is not one of the `ProcessOptions`.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        own_process_group: bool = True,
        **options: Unpack[ProcessOptions],
    ) -> None:
        unknown = options.keys() - ProcessOptions.__optional_keys__
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got unexpected keyword arguments: "
                f"{', '.join(sorted(unknown))}"
            )
        self._command = _checked_command(command)
        self._environment = dict(options.get("environment") or {})
        self._inherit_environment = options.get("inherit_environment", True)
        self._python_path = tuple(os.fspath(entry) for entry in options.get("python_path", ()))
        working_directory = options.get("working_directory")
        self._working_directory = (
            None if working_directory is None else os.fspath(working_directory)
        )
        self._label = options.get("label") or Path(self._command[0]).name
        self._own_process_group = own_process_group
        log_path = options.get("log_path")
        if log_path is None:
            file_label = "".join(c if c.isalnum() else "-" for c in self._label)
            handle, name = tempfile.mkstemp(prefix=f"celery-redlock-{file_label}-", suffix=".log")
            os.close(handle)
            self._log_path = Path(name)
        else:
            self._log_path = Path(log_path)
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._cleaned_up = True  # whether the last run was reaped and cleaned up

    # -- identity -------------------------------------------------------------------------

    @property
    def command(self) -> tuple[str, ...]:
        """The program and its arguments, as the next (or current) run starts them."""
        return self._command

    @property
    def label(self) -> str:
        """The short name used in messages."""
        return self._label

    @property
    def log_path(self) -> Path:
        """The file holding the process's output (standard output and error)."""
        return self._log_path

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The :class:`subprocess.Popen` of the current or last run, ``None`` before
        :meth:`start`."""
        return self._process

    @property
    def pid(self) -> int:
        """The main process's id (of the current or last run); with a process group of its own,
        also the group's id.

        Raises:
            RuntimeError: the process was never started.
        """
        return self._started().pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the main process has exited (negative: killed by that signal);
        ``None`` while it runs or before it starts. Reading it does not reap the process."""
        process = self._process
        if process is None:
            return None
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

    @property
    def is_running(self) -> bool:
        """Whether the process was started and its main process has not exited (a paused
        process counts)."""
        return self._process is not None and self.returncode is None

    @property
    def is_paused(self) -> bool:
        """Whether the process runs but is frozen by :meth:`pause`."""
        return self._paused and self.is_running

    @property
    def is_active(self) -> bool:
        """Whether the process runs and is not paused: it can answer."""
        return self.is_running and not self._paused

    def reconfigure(
        self,
        *,
        command: Sequence[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        working_directory: str | os.PathLike[str] | None = None,
        label: str | None = None,
    ) -> None:
        """Change what the next :meth:`start` runs: the command, the log file, the working
        directory or the label (what is not given stays).

        Raises:
            RuntimeError: the process is running.
        """
        if self.is_running:
            raise RuntimeError(f"{self._label} is running: stop it before reconfiguring it")
        if command is not None:
            self._command = _checked_command(command)
        if log_path is not None:
            self._log_path = Path(log_path)
        if working_directory is not None:
            self._working_directory = os.fspath(working_directory)
        if label is not None:
            self._label = label

    # -- life cycle -----------------------------------------------------------------------

    def start(self: _ProcessT) -> _ProcessT:
        """Launch the process (without waiting for anything) and return ``self``. A process
        whose last run has exited is reaped and started again.

        Raises:
            RuntimeError: the process is running.
        """
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
        """Return if the process runs; raise with the end of its output if it has exited.

        Raises:
            ProcessExitedError: the main process has exited.
            RuntimeError: the process was never started.
        """
        process = self._started()
        returncode = self.returncode
        if returncode is not None:
            raise ProcessExitedError(
                f"{self._label} (pid {process.pid}) exited with status {returncode}; end of "
                f"its output ({self._log_path}):\n{self.log_tail() or '(log is empty)'}"
            )

    def send_signal(self, signum: int, *, group: bool = True) -> None:
        """Send ``signum`` to the whole process group (when the process has one of its own), or
        with ``group=False`` to the main process only. Does nothing once the main process has
        exited.

        Raises:
            RuntimeError: the process was never started.
        """
        process = self._started()
        if self.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group and self._own_process_group:
                os.killpg(process.pid, signum)
            else:
                process.send_signal(signum)

    def pause(self) -> None:
        """Freeze the process and its group (SIGSTOP), like a hung machine: its connections stay
        open but it answers nothing.

        Raises:
            RuntimeError: the process is not running.
        """
        self._running()
        self.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Unfreeze a process frozen by :meth:`pause` (SIGCONT).

        Raises:
            RuntimeError: the process is not running.
        """
        self._running()
        self.send_signal(signal.SIGCONT)
        self._paused = False

    def terminate(self, *, group: bool = True) -> None:
        """Ask the process to stop (SIGTERM: a Celery worker's warm shutdown, a Redis server's
        shutdown), to the whole group or with ``group=False`` the main process only; a paused
        process is resumed so that it can act on it. Does not wait."""
        self.send_signal(signal.SIGTERM, group=group)
        # A stopped process acts on SIGTERM only once continued; SIGCONT to a running one is
        # ignored, so it is sent whether or not pause() froze it (a test may SIGSTOP directly).
        self.send_signal(signal.SIGCONT, group=group)
        self._paused = False

    def wait_for_exit(self, timeout: float | None = None) -> bool:
        """Wait until the main process exits, at most ``timeout`` seconds (``None``: for ever);
        return whether it has. Does not reap it. False if it was never started."""
        if self._process is None:
            return False
        return wait_for_exits([self], timeout)

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the main process exits, reap it and return its exit status.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
            RuntimeError: the process was never started.
        """
        process = self._started()
        status = process.wait(timeout)
        self._reaped()
        return status

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop gracefully: SIGTERM (to the group), then SIGKILL for whatever is left after
        ``timeout`` seconds (and for any child its parent left behind); reap the process and
        return its exit status (``None`` if it was never started). Works on a paused process."""
        stop_processes([self], timeout)
        return None if self._process is None else self._process.returncode

    def kill(self) -> None:
        """SIGKILL the process (with a process group of its own: the whole group, every child
        it started) and reap the main process. Does nothing if it was never started; safe to
        repeat."""
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
        """Called once each run's main process has been reaped (by :meth:`kill`, :meth:`stop`,
        :meth:`wait` or at interpreter exit). Does nothing here; kinds of process override it to
        clean up what one run left (a working directory, for one)."""

    # -- output ---------------------------------------------------------------------------

    def log_text(self) -> str:
        """The whole output so far (empty when there is none)."""
        try:
            return self._log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the output (empty when there is none)."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def remove_log(self) -> None:
        """Delete the log file (nothing happens if it is already gone)."""
        with contextlib.suppress(OSError):
            self._log_path.unlink()

    def __enter__(self: _ProcessT) -> _ProcessT:
        """Start the process unless it runs already, and return it."""
        if not self.is_running:
            self.start()
        return self

    def close(self) -> None:
        """Kill the process (its whole group when it has one of its own), as leaving a ``with``
        block does; see :meth:`kill`."""
        self.kill()

    def __repr__(self) -> str:
        if self._process is None:
            state = "not started"
        else:
            returncode = self.returncode
            if returncode is not None:
                state = f"exited {returncode}"
            else:
                state = "paused" if self._paused else "running"
            state = f"pid {self._process.pid} {state}"
        return f"<{type(self).__name__} {self._label} {state}>"

    # -- internals ------------------------------------------------------------------------

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise RuntimeError(f"{self._label} was never started")
        return self._process

    def _running(self) -> subprocess.Popen[bytes]:
        process = self._started()
        if self.returncode is not None:
            raise RuntimeError(f"{self._label} is not running")
        return process

    def _reap(self, process: subprocess.Popen[bytes]) -> None:
        """Reap an exited (or killed) ``process``; clean up once it is reaped."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(_REAP_TIMEOUT)
        if process.returncode is not None:
            self._reaped()

    def _reaped(self) -> None:
        """The end of a run, once per run: no at-exit kill any more, and `after_exit`."""
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


def stop_processes(
    processes: Iterable[ManagedProcess],
    timeout: float = 10.0,
    *,
    group: bool = True,
    hurry: Callable[[], bool] | None = None,
) -> None:
    """Stop several processes at once: SIGTERM to each (to its whole group, or with
    ``group=False`` to its main process only; paused ones are resumed), wait until all have
    exited, at most ``timeout`` seconds in all, then SIGKILL every one (every group: whatever is
    left, including children a parent left behind) and reap every process.

    ``hurry`` is asked while waiting; once it returns true the wait ends at once (for example a
    second Ctrl-C meaning "kill now"). Processes never started, or already gone, are fine:
    this never raises for them, and calling it again is harmless.
    """
    chosen = [process for process in processes if process.process is not None]
    for process in chosen:
        if process.is_running:
            process.terminate(group=group)
    wait_for_exits(chosen, timeout, hurry)
    for process in chosen:
        process.kill()
