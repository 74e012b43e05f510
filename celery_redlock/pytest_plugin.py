"""pytest fixtures for testing your own singleton tasks on real lock nodes and real workers.

Loaded only where a project asks for it (``-p celery_redlock.pytest_plugin`` in ``addopts``, or
``pytest_plugins = ["celery_redlock.pytest_plugin"]`` in the root ``conftest.py``). Loading it
starts nothing: servers (`celery_redlock.testing`) start when a test first needs them. Its
settings (``redlock_celery_app``, ``redlock_node_count``) and fixtures (all named ``redlock_*``,
clashing with none of Celery's or pytest-celery's) are described in docs/testing.md.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery import Celery

    from celery_redlock.integration.runtime import AppRuntime
    from celery_redlock.testing import CeleryWorker, RedisNodes, RedisServer

__all__ = ["WorkerFactory"]

APP_OPTION = "redlock_celery_app"
NODE_COUNT_OPTION = "redlock_node_count"
DEFAULT_NODE_COUNT = 3
DEFAULT_APP_NAME = "redlock_tests"
# Celery prefers these variables to the settings (celery.app.utils.Settings).
CELERY_URL_VARIABLES = ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
EMBEDDED_WORKER_DEFAULTS: dict[str, Any] = {
    "pool": "threads",
    "concurrency": 4,
    "perform_ping_check": False,  # start_worker already waits until the worker consumes
    "loglevel": "WARNING",
    "shutdown_timeout": 10.0,
}


@dataclass(eq=False, repr=False)
class WorkerFactory:
    """What ``redlock_worker_factory`` gives a test: each call starts one worker subprocess
    (`celery_redlock.testing.CeleryWorker`) with the harness settings; :meth:`kill_all` kills
    every worker it started, pool children included."""

    config: pytest.Config
    app: Celery
    settings: Mapping[str, Any]
    log_directory: Path
    _started: list[CeleryWorker] = field(default_factory=list, init=False)

    def __call__(
        self,
        name: str = "worker",
        *,
        app: str | None = None,
        pool: str = "prefork",
        concurrency: int = 2,
        queues: Sequence[str] = (),
        arguments: Sequence[str] = (),
        environment: Mapping[str, str] | None = None,
        wait: bool = True,
        timeout: float = 60.0,
    ) -> CeleryWorker:
        """Start ``celery -A <app> worker -n <name>@<host>`` (``app``: by default the
        ``redlock_celery_app`` setting, else `pytest.UsageError`) with the harness settings;
        return it once it answers ``ping`` (or raise as `CeleryWorker.wait_ready` does), or at
        once with ``wait=False``."""
        from celery_redlock.testing import CeleryWorker

        target = app or str(self.config.getini(APP_OPTION)).strip()
        if not target:
            raise pytest.UsageError(
                f"redlock_worker_factory needs the app the worker loads: set {APP_OPTION} "
                "(for example `redlock_celery_app = proj.celery:app` in pytest.ini) or pass app="
            )
        worker = CeleryWorker(
            target,
            name,
            pool=pool,
            concurrency=concurrency,
            queues=queues,
            arguments=arguments,
            settings=self.settings,
            environment=environment,
            python_path=_configured_python_path(self.config),
            working_directory=self.config.rootpath,
            log_path=self.log_directory / f"{name}.log",
        )
        self._started.append(worker.start())
        if wait:
            worker.wait_ready(self.app, timeout)
        return worker

    def kill_all(self) -> None:
        """Kill every worker started (last started first), pool children included."""
        for worker in reversed(self._started):
            worker.kill()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        APP_OPTION,
        "celery_redlock fixtures: your Celery app as `celery -A` takes it (proj.celery:app); "
        "unset: a blank app holding your @singleton_task and @shared_task tasks",
        default="",
    )
    parser.addini(
        NODE_COUNT_OPTION,
        f"celery_redlock fixtures: how many lock nodes redlock_nodes runs "
        f"(default {DEFAULT_NODE_COUNT})",
        default=str(DEFAULT_NODE_COUNT),
    )


@pytest.fixture(scope="session")
def _redlock_session_nodes(pytestconfig: pytest.Config) -> Iterator[RedisNodes]:
    from celery_redlock.testing import RedisNodes

    with RedisNodes(_node_count(pytestconfig)) as nodes:
        yield nodes
        gc.collect()  # results left behind unsubscribe now, while their servers still answer


@pytest.fixture(scope="session")
def _redlock_session_broker() -> Iterator[RedisServer]:
    from celery_redlock.testing import RedisServer

    with RedisServer() as broker:
        yield broker
        gc.collect()  # as for the nodes


@pytest.fixture
def redlock_nodes(_redlock_session_nodes: RedisNodes) -> RedisNodes:
    """Independent ``redis-server`` lock nodes (``redlock_node_count``, default 3), all running
    and empty when the test starts; the same servers, on the same ports, for the whole session."""
    _prepare_servers(_redlock_session_nodes)
    return _redlock_session_nodes


@pytest.fixture
def redlock_broker(_redlock_session_broker: RedisServer) -> RedisServer:
    """A ``redis-server`` for the broker and the result back-end, running and empty when the
    test starts; the same server for the whole session."""
    _prepare_servers([_redlock_session_broker])
    return _redlock_session_broker


def _prepare_servers(servers: Iterable[RedisServer]) -> None:
    for server in servers:
        if server.is_paused:
            server.resume()
        elif not server.is_running:
            server.start()
        with server.client(socket_timeout=10) as client:
            client.flushall()


def _node_count(config: pytest.Config) -> int:
    value = str(config.getini(NODE_COUNT_OPTION)).strip()
    if not value.isdecimal() or int(value) < 1:
        raise pytest.UsageError(
            f"{NODE_COUNT_OPTION} must be a whole number of at least 1 (3 or 5 are usual), "
            f"got {value!r}"
        )
    return int(value)


@pytest.fixture
def redlock_celery_config(redlock_broker: RedisServer, redlock_nodes: RedisNodes) -> dict[str, Any]:
    """The settings ``redlock_celery_app`` and the worker subprocesses get. Override to add."""
    return {
        "broker_url": redlock_broker.url,
        "result_backend": redlock_broker.url,
        "redlock_urls": redlock_nodes.urls,
        "redlock_node_timeout": 0.5,
        "task_always_eager": False,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"polling_interval": 0.1},
    }


@pytest.fixture(scope="session")
def _redlock_default_app() -> Celery:
    from celery import Celery

    return Celery(DEFAULT_APP_NAME, set_as_current=False)


@pytest.fixture(scope="session")
def _redlock_kept_runtimes() -> Iterator[weakref.WeakKeyDictionary[Any, AppRuntime]]:
    kept: weakref.WeakKeyDictionary[Any, AppRuntime] = weakref.WeakKeyDictionary()
    yield kept  # per app (usually one for the session): its celery_redlock state of the last test
    for runtime in kept.values():
        runtime.redlock.close()


@pytest.fixture
def redlock_celery_app(
    request: pytest.FixtureRequest,
    redlock_celery_config: dict[str, Any],
    _redlock_kept_runtimes: weakref.WeakKeyDictionary[Any, AppRuntime],
) -> Iterator[Celery]:
    """The app under test (the ``redlock_celery_app`` setting, else a blank app), configured
    with ``redlock_celery_config`` and current for the test; restored afterwards."""
    from celery.app.utils import find_app
    from celery.contrib.testing.app import setup_default_app

    path = str(request.config.getini(APP_OPTION)).strip()
    if not path:
        app = request.getfixturevalue("_redlock_default_app")
    else:
        try:
            app = find_app(path)
        except Exception as error:
            raise pytest.UsageError(
                f"{APP_OPTION} = {path!r} cannot be loaded the way `celery -A` loads it: {error!r}"
            ) from error
    # An embedded worker must leave pytest's logging (caplog, live logs) alone.
    settings = {"worker_hijack_root_logger": False, **redlock_celery_config}
    with pytest.MonkeyPatch.context() as monkeypatch, setup_default_app(app):
        for variable in CELERY_URL_VARIABLES:
            monkeypatch.delenv(variable, raising=False)
        for key, value in settings.items():
            monkeypatch.setitem(app.conf, key, value)  # the app's own value is put back after
        app.conf.update(settings)  # again, for Celery's observers of its settings (task_routes)
        with _kept_runtime(app, _redlock_kept_runtimes):
            app.set_current()
            yield app


@contextlib.contextmanager
def _kept_runtime(app: Celery, kept: weakref.WeakKeyDictionary[Any, AppRuntime]) -> Iterator[None]:
    """Give the app the celery_redlock state kept from the last test when its settings are the
    same (else none: made on first use); afterwards keep the state, and put the app's own back."""
    from celery_redlock.integration.runtime import AppRuntime
    from celery_redlock.settings import RedlockSettings

    runtime = kept.pop(app, None)
    if runtime is not None and runtime.settings != RedlockSettings.from_conf(app.conf):
        runtime.redlock.close()
        runtime = None
    own = AppRuntime.install(app, runtime)
    try:
        yield
    finally:
        runtime = AppRuntime.install(app, own)
        if runtime is not None:
            kept[app] = runtime


@pytest.fixture
def redlock_worker_parameters() -> dict[str, Any]:
    """``start_worker`` arguments of ``redlock_worker`` over its defaults. Override to change."""
    return {}


@pytest.fixture
def redlock_worker(
    redlock_celery_app: Celery, redlock_worker_parameters: dict[str, Any]
) -> Iterator[Any]:
    """Celery's embedded worker on ``redlock_celery_app``, consuming for the test's duration."""
    from celery.contrib.testing.worker import start_worker

    parameters = {**EMBEDDED_WORKER_DEFAULTS, **redlock_worker_parameters}
    with start_worker(redlock_celery_app, **parameters) as worker:
        yield worker


@pytest.fixture
def redlock_worker_factory(
    request: pytest.FixtureRequest,
    redlock_celery_app: Celery,
    redlock_celery_config: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerFactory]:
    """Starts real ``celery worker`` subprocesses; kills them all when the test ends."""
    logs = tmp_path_factory.mktemp("redlock-workers")
    factory = WorkerFactory(request.config, redlock_celery_app, redlock_celery_config, logs)
    try:
        yield factory
    finally:
        factory.kill_all()


def _configured_python_path(config: pytest.Config) -> list[Path]:
    """pytest's ``pythonpath`` setting, so workers import what the tests import."""
    with contextlib.suppress(ValueError):  # a pytest without the setting (before 7.0)
        return [Path(entry) for entry in config.getini("pythonpath") or ()]
    return []
