"""Real ``celery worker`` and ``celery beat`` subprocesses for tests/test_beat.py,
tests/test_fleet.py, tests/test_celery_prefork.py and the other tests of real processes, the apps
they load, and the records their task bodies write.

The processes are `celery_redlock.testing`'s (`CeleryProcess`, `CeleryWorker`, `CeleryBeat`,
`celery_processes`): each starts in a session (and so a process group) of its own, so teardown
can SIGKILL the whole group, the worker or beat and every prefork child it forked; output goes
to a log file shown in failure messages. The classes here only run them from ``tests/`` so that
the apps of `celery_apps` load. Tasks record what they do with `Recorder` into Redis lists on a
harness node (never the shared Redis on 6379); timestamps are ``time.time()``, which every
process on this machine shares.

The apps (`celery_apps.beat_app`, `fleet_app`, `prefork_app`) are made by `subprocess_app`, which
reads the environment `app_environment` gives the processes.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from celery_redlock import testing
from celery_redlock.testing import RedisNodes, RedisServer, celery_processes

__all__ = [
    "BeatProcess",
    "CeleryProcess",
    "Recorder",
    "WorkerProcess",
    "app_environment",
    "celery_processes",
    "control_app",
    "subprocess_app",
]

TESTS_DIRECTORY = Path(__file__).resolve().parent.parent

BROKER_VARIABLE = "CRL_BROKER_URL"
LOCK_URLS_VARIABLE = "CRL_LOCK_URLS"
VISIBILITY_TIMEOUT_VARIABLE = "CRL_VISIBILITY_TIMEOUT"
UNREACHABLE_BROKER = "redis://127.0.0.1:1/0"  # the test process imports the apps for constants


def app_environment(broker: RedisServer, locks: RedisNodes, **extra: str) -> dict[str, str]:
    """The environment of a subprocess whose app (`subprocess_app`) uses ``broker`` as broker,
    result back-end and record store, and ``locks`` as lock nodes; ``extra`` adds variables."""
    return {BROKER_VARIABLE: broker.url, LOCK_URLS_VARIABLE: ",".join(locks.urls), **extra}


def subprocess_app(main: str, **conf: Any) -> Celery:
    """The app a ``celery -A`` subprocess loads, configured from its environment.

    - ``CRL_BROKER_URL``: broker and result back-end (unset: an unreachable placeholder);
    - ``CRL_LOCK_URLS``: comma-separated lock nodes, ``redlock_urls`` (unset: the broker);
    - ``CRL_VISIBILITY_TIMEOUT``: when set, the Redis transport's ``visibility_timeout`` in
      seconds, with the unacked-message sweep (``restore_visible``) run every second so that an
      ``acks_late`` message past it is redelivered promptly.

    ``conf`` adds or overrides settings.
    """
    broker_url = os.environ.get(BROKER_VARIABLE, UNREACHABLE_BROKER)
    lock_urls = os.environ.get(LOCK_URLS_VARIABLE, broker_url)
    app = Celery(main)
    app.conf.update(
        broker_url=broker_url,
        result_backend=broker_url,
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        redlock_urls=[url for url in lock_urls.split(",") if url],
    )
    if visibility_timeout := os.environ.get(VISIBILITY_TIMEOUT_VARIABLE):
        app.conf.broker_transport_options = {
            "visibility_timeout": float(visibility_timeout),
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # A worker SIGKILLed while it restores holds kombu's restore mutex until it expires
            # (300 s by default): every later redelivery on this broker would wait for it.
            "unacked_mutex_expire": 5,
        }
    app.conf.update(conf)
    return app


def control_app(broker: RedisServer, **conf: Any) -> Celery:
    """The test's own client app: sends tasks to, and pings, the workers on ``broker``."""
    app = Celery("test_control", set_as_current=False)
    app.conf.update(broker_url=broker.url, broker_connection_retry_on_startup=True, **conf)
    return app


class Recorder:
    """JSON records in Redis lists, written by tasks in any process and read by the test."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: redis.Redis | None = None
        self._pid = 0
        self._guard = threading.Lock()

    @property
    def client(self) -> redis.Redis:
        """A client of the current process (a new one after a fork)."""
        with self._guard:
            if self._client is None or self._pid != os.getpid():
                self._client = redis.Redis.from_url(
                    self.url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5
                )
                self._pid = os.getpid()
                # A redis-py client is a reference cycle: left to the garbage collector, its
                # socket may be finalized before the connection closes it (a ResourceWarning,
                # an error in this suite). Closed when the recorder goes instead.
                weakref.finalize(self, self._client.close)
            return self._client

    def add(self, stream: str, /, **entry: Any) -> None:
        """Append one record to ``stream`` (values JSON cannot hold are stored as text)."""
        self.client.rpush(f"record:{stream}", json.dumps(entry, default=str))

    def read(self, stream: str) -> list[dict[str, Any]]:
        """Every record of ``stream``, oldest first."""
        return [json.loads(item) for item in self.client.lrange(f"record:{stream}", 0, -1)]

    def count(self, stream: str) -> int:
        """How many records ``stream`` has."""
        return int(self.client.llen(f"record:{stream}"))


class CeleryProcess(testing.CeleryProcess):
    """``celery -A <app_module> <arguments>`` (`celery_redlock.testing.CeleryProcess`) with
    ``tests/`` as working directory and first on ``PYTHONPATH``, so the apps of `celery_apps`
    load; ``environment`` is added to the test process's."""

    def __init__(
        self, app_module: str, arguments: Sequence[str], environment: dict[str, str]
    ) -> None:
        super().__init__(
            app_module,
            arguments,
            environment=environment,
            python_path=[TESTS_DIRECTORY],
            working_directory=TESTS_DIRECTORY,
        )


class WorkerProcess(testing.CeleryWorker):
    """A real prefork ``celery worker`` named ``name@<host>`` (`celery_redlock.testing.
    CeleryWorker`, ``-O fair``), run from ``tests/`` like `CeleryProcess`."""

    def __init__(
        self,
        app_module: str,
        name: str,
        environment: dict[str, str],
        concurrency: int = 2,
        extra_arguments: Sequence[str] = (),
    ) -> None:
        super().__init__(
            app_module,
            name,
            concurrency=concurrency,
            arguments=["-O", "fair", *extra_arguments],
            environment=environment,
            python_path=[TESTS_DIRECTORY],
            working_directory=TESTS_DIRECTORY,
        )


class BeatProcess(testing.CeleryBeat):
    """A real ``celery beat`` keeping its schedule in ``schedule_file`` (`celery_redlock.testing.
    CeleryBeat`), run from ``tests/`` like `CeleryProcess`.

    The longest sleep between two schedule checks is the app's beat_max_loop_interval
    (``--max-interval`` only takes whole seconds).
    """

    def __init__(self, app_module: str, schedule_file: Path, environment: dict[str, str]) -> None:
        super().__init__(
            app_module,
            schedule_file,
            environment=environment,
            python_path=[TESTS_DIRECTORY],
            working_directory=TESTS_DIRECTORY,
        )
