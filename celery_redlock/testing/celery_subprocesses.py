"""Real ``celery`` processes, each a `ManagedProcess` in a process group of its own (so killing a
worker reaches its pool children): `CeleryWorker`, `CeleryBeat`, any sub-command
(`CeleryProcess`); `wait_for_workers` waits until workers answer ``app.control.ping``."""

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

from .processes import ManagedProcess

if TYPE_CHECKING:
    from celery import Celery


_PING_TIMEOUT = 0.5  # seconds one readiness ping waits for replies
_ENVIRONMENT_OF_SETTINGS = {
    # Celery prefers these variables to the settings (celery.app.utils.Settings): a process
    # given the settings gets them too, lest the caller's environment win.
    "broker_url": "CELERY_BROKER_URL",
    "result_backend": "CELERY_RESULT_BACKEND",
}


class WorkerNotReadyError(RuntimeError):
    """Workers did not answer ``ping`` in time; the message ends with the end of their output."""


def _command_line_settings(settings: Mapping[str, Any]) -> list[str]:
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
    """``python -m celery -A <app> <arguments>`` as a `ManagedProcess` (``**options``: its
    keyword options; the label defaults to the sub-command), run by the caller's interpreter.

    ``settings`` (for ``worker`` and ``beat``) are applied over the app's own: lower-case names
    such as ``"redlock_urls"``, JSON values, passed on the command line after ``--``;
    ``broker_url`` and ``result_backend`` also become ``CELERY_BROKER_URL`` and
    ``CELERY_RESULT_BACKEND``. A setting that cannot be passed this way raises `ValueError` or
    `TypeError`, saying why.
    """

    def __init__(
        self,
        app: str,
        arguments: Sequence[str],
        *,
        settings: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        arguments = _sequence(arguments, "arguments")
        command = [sys.executable, "-m", "celery", "-A", app, *arguments]
        variables = dict(options.get("environment") or {})
        if settings:
            command += ["--", *_command_line_settings(settings)]
            for setting, variable in _ENVIRONMENT_OF_SETTINGS.items():
                value = settings.get(setting)
                if isinstance(value, str):
                    variables[variable] = value
        options["environment"] = variables
        options["label"] = options.get("label") or next(iter(arguments), "celery")
        super().__init__(command, **options)


class CeleryWorker(CeleryProcess):
    """A real ``celery -A <app> worker`` (prefork by default) named ``name@<this host>`` (a
    ``name`` with ``@`` is used as it is), without heartbeat, mingle and gossip. ``pool``,
    ``concurrency``, ``loglevel`` and ``queues`` (by default the app's) are its ``-P``, ``-c``,
    ``--loglevel`` and ``-Q``; ``arguments`` are more options; ``settings`` and ``**options`` as
    for `CeleryProcess` (the label defaults to the node name)."""

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
        **options: Any,
    ) -> None:
        self._hostname = name if "@" in name else f"{name}@{socket.gethostname()}"
        worker_arguments = [
            *("worker", "-P", pool, "-c", str(concurrency), "-n", self._hostname),
            *("--loglevel", loglevel, "--without-heartbeat", "--without-mingle"),
            "--without-gossip",
        ]
        if queues:
            worker_arguments += ["-Q", ",".join(_sequence(queues, "queues"))]
        options["label"] = options.get("label") or self._hostname
        arguments = _sequence(arguments, "arguments")
        super().__init__(app, [*worker_arguments, *arguments], settings=settings, **options)

    @property
    def hostname(self) -> str:
        """The node name, ``name@host`` (``self.request.hostname`` in tasks)."""
        return self._hostname

    def wait_ready(self, app: Celery, timeout: float = 60.0) -> None:
        """Return once the worker answers ``app.control.ping`` (any ``app`` on its broker), as
        `wait_for_workers` does."""
        wait_for_workers(app, [self], timeout)

    def child_pids(self) -> set[int]:
        """The ids of the worker's direct children (its pool), from ``/proc`` (if any)."""
        children: set[int] = set()
        parent = self.pid
        with contextlib.suppress(OSError):
            for entry in list(Path("/proc").iterdir()):
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
    """A real ``celery -A <app> beat`` keeping its state in ``schedule_file`` (``-s``; give each
    beat its own); ``arguments`` are more options (``-S`` for a scheduler), ``settings`` and
    ``**options`` as for `CeleryProcess` (the label defaults to ``beat``)."""

    def __init__(
        self,
        app: str,
        schedule_file: str | os.PathLike[str],
        *,
        loglevel: str = "INFO",
        arguments: Sequence[str] = (),
        settings: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        beat_arguments = ["beat", "-s", os.fspath(schedule_file), "--loglevel", loglevel]
        arguments = _sequence(arguments, "arguments")
        super().__init__(app, [*beat_arguments, *arguments], settings=settings, **options)


def wait_for_workers(app: Celery, workers: Iterable[CeleryWorker], timeout: float = 60.0) -> None:
    """Return once every one of ``workers`` answers ``app.control.ping`` (any ``app`` on their
    broker), pinging the silent ones without pause. Raises `ProcessExitedError` if a worker
    exits meanwhile, `WorkerNotReadyError` (with the end of their logs) if some did not answer
    within ``timeout`` seconds."""
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
    """A list to put started processes in; when the block ends every one is killed (its whole
    group, last added first) and reaped, and with ``remove_logs`` its log deleted unless the
    block raised (a failure's logs stay for reading)."""
    processes: list[ManagedProcess] = []
    try:
        yield processes
    finally:
        for process in reversed(processes):
            process.kill()
    if remove_logs:  # not reached when the block raised
        for process in processes:
            process.remove_log()


def _sequence(value: Sequence[str], name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError(f"{name} must be a sequence, not one string")
    return tuple(value)
