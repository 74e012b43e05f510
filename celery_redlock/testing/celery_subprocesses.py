"""Real Celery processes: ``celery -A <app> worker`` (`CeleryWorker`, prefork by default),
``celery -A <app> beat`` (`CeleryBeat`) and any other ``celery`` sub-command (`CeleryProcess`),
each a `ManagedProcess` in a process group of its own, so that killing or stopping it reaches the
worker's pool children too. `wait_for_workers` waits until workers answer ``app.control.ping``.

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

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .processes import ManagedProcess, ProcessOptions

if TYPE_CHECKING:
    from typing import Unpack

    from celery import Celery

__all__ = [
    "CeleryBeat",
    "CeleryProcess",
    "CeleryWorker",
    "WorkerNotReadyError",
    "celery_processes",
    "wait_for_workers",
]

_PING_TIMEOUT = 0.5  # seconds one readiness ping waits for replies
_ENVIRONMENT_OF_SETTINGS = {
    # Celery reads these variables before the settings (celery.app.utils.Settings), so a
    # process given these settings gets the variables too: a value in the caller's environment
    # must not win over them.
    "broker_url": "CELERY_BROKER_URL",
    "result_backend": "CELERY_RESULT_BACKEND",
}


class WorkerNotReadyError(RuntimeError):
    """Workers did not answer ``ping`` in time; the message ends with the end of their output."""


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
        **options: the `ProcessOptions` of :class:`ManagedProcess` (``environment``,
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
        **options: Unpack[ProcessOptions],
    ) -> None:
        if isinstance(arguments, str):
            raise TypeError("arguments must be a sequence of arguments, not one string")
        self._app = app
        self._arguments = tuple(arguments)
        command = [sys.executable, "-m", "celery", "-A", app, *self._arguments]
        variables = dict(options.get("environment") or {})
        if settings:
            command += ["--", *_command_line_settings(settings)]
            for setting, variable in _ENVIRONMENT_OF_SETTINGS.items():
                value = settings.get(setting)
                if isinstance(value, str):
                    variables[variable] = value
        options["environment"] = variables
        options["label"] = options.get("label") or (
            self._arguments[0] if self._arguments else "celery"
        )
        super().__init__(command, **options)

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
        **options: the `ProcessOptions` of :class:`ManagedProcess`; the label defaults to the
            node name.
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
        **options: Unpack[ProcessOptions],
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
        options["label"] = options.get("label") or self._hostname
        super().__init__(app, [*worker_arguments, *arguments], settings=settings, **options)

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
        **options: the `ProcessOptions` of :class:`ManagedProcess`; the label defaults to
            ``beat``.
    """

    def __init__(
        self,
        app: str,
        schedule_file: str | os.PathLike[str],
        *,
        loglevel: str = "INFO",
        arguments: Sequence[str] = (),
        settings: Mapping[str, Any] | None = None,
        **options: Unpack[ProcessOptions],
    ) -> None:
        if isinstance(arguments, str):
            raise TypeError("arguments must be a sequence of arguments, not one string")
        super().__init__(
            app,
            ["beat", "-s", os.fspath(schedule_file), "--loglevel", loglevel, *arguments],
            settings=settings,
            **options,
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


@contextlib.contextmanager
def celery_processes(*, remove_logs: bool = True) -> Iterator[list[ManagedProcess]]:
    """A list to put started processes in (any `ManagedProcess`, Celery's or not); when the
    block ends, every one is killed (SIGKILL to its whole group, last added first) and reaped,
    whatever happened in the block.

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
