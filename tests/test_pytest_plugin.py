"""The pytest plugin (celery_redlock.pytest_plugin), used the way a user uses it.

`pytester` runs, in a pytest subprocess of its own, the example of docs/testing.md (its project
module, pytest.ini and tests, copied out of the page, so the documented example is known to work)
plus checks of the fixtures themselves: the lock nodes and the broker are real ``redis-server``
processes, reused for the session and brought back running and empty before each test; a real
prefork ``celery worker`` subprocess runs a singleton task in a pool child, once, while its
duplicate is skipped; and without the ``redlock_celery_app`` setting a blank app and an embedded
worker run ``@singleton_task`` tasks. Importing the plugin starts nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ("pytester",)

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "testing.md"
PLUGIN = "celery_redlock.pytest_plugin"
GUIDE_FILES = {"reports.py", "pytest.ini", "test_reports.py"}
INNER_TIMEOUT = 120.0

# The tasks of the fixture checks live in a module the worker subprocess loads (``-A``); it
# registers them on the guide's app, the app the fixtures configure in the test process.
CHECKS_TASKS = '''
"""Tasks of test_fixture_checks.py, on the app of reports.py."""

import os

import redis

from celery_redlock import singleton_task
from reports import app


@singleton_task(app=app, bind=True, lock_args=("name",), name="checks.held")
def held(self, name):
    """Counts its run, says it started, and holds its lock until the test says go."""
    client = redis.Redis.from_url(self.app.conf.broker_url, socket_timeout=30)
    try:
        client.incr(f"runs:{name}")
        client.rpush(f"started:{name}", os.getpid())
        client.blpop([f"go:{name}"], timeout=20)
    finally:
        client.close()
    return {"pid": os.getpid(), "hostname": self.request.hostname}
'''

FIXTURE_CHECKS = '''
"""Checks of the celery_redlock fixtures themselves."""

from pathlib import Path

import pytest

from celery_redlock import DuplicateSkipped
from checks_tasks import held

FIRST_TEST = {}


def is_redis_server(pid):
    return Path(f"/proc/{pid}/comm").read_text().strip() == "redis-server"


def test_the_servers_are_real_redis_servers(redlock_nodes, redlock_broker):
    assert len(redlock_nodes) == 3  # redlock_node_count's default
    for server in [*redlock_nodes, redlock_broker]:
        with server.client(socket_timeout=5) as client:
            assert client.info("server")["process_id"] == server.pid
            client.set("left-behind", "by the first test")
        assert is_redis_server(server.pid)
    FIRST_TEST["ports"] = [server.port for server in [*redlock_nodes, redlock_broker]]
    redlock_nodes[0].pause()  # the next test must find it answering again
    redlock_nodes[1].kill()  # and this one running again, on its port


def test_the_servers_are_reused_running_and_empty_for_each_test(redlock_nodes, redlock_broker):
    assert [server.port for server in [*redlock_nodes, redlock_broker]] == FIRST_TEST["ports"]
    for server in [*redlock_nodes, redlock_broker]:
        with server.client(socket_timeout=5) as client:
            assert client.dbsize() == 0


def test_a_prefork_worker_runs_a_call_once_and_skips_its_duplicate(
    redlock_worker_factory, redlock_broker, redlock_nodes
):
    worker = redlock_worker_factory("checker", app="checks_tasks:app", concurrency=2)
    children = worker.child_pids()
    assert len(children) == 2 and worker.pid not in children
    first = held.delay("k")
    with redlock_broker.client(socket_timeout=30, decode_responses=True) as client:
        started = client.blpop(["started:k"], timeout=20)
        assert started is not None, worker.log_tail()
        assert int(started[1]) in children  # in a pool child of the subprocess
        key = held.lock_key_for("k")
        for node in redlock_nodes:  # every node holds the lock (none left paused or down)
            with node.client(socket_timeout=5) as node_client:
                assert node_client.exists(key) == 1
        with pytest.raises(DuplicateSkipped):
            held.delay("k").get(timeout=15)
        client.rpush("go:k", "go")
        assert first.get(timeout=15)["hostname"] == worker.hostname
        assert client.get("runs:k") == "1"  # the duplicate never ran
'''

BLANK_APP_CHECKS = '''
"""Without the redlock_celery_app setting: a blank app holds the @singleton_task tasks."""

import threading

import pytest

from celery_redlock import DuplicateSkipped, singleton_task

started, finish = threading.Event(), threading.Event()


@singleton_task(lock_args=())
def nightly_cleanup():
    started.set()
    assert finish.wait(10)
    return "cleaned"


def test_the_blank_app_and_the_embedded_worker_run_a_shared_singleton_task(
    redlock_worker, redlock_celery_app, redlock_nodes
):
    assert redlock_celery_app.conf.redlock_urls == redlock_nodes.urls
    first = nightly_cleanup.delay()
    assert started.wait(10)
    with pytest.raises(DuplicateSkipped):
        nightly_cleanup.delay().get(timeout=10)
    finish.set()
    assert first.get(timeout=10) == "cleaned"


def test_a_worker_subprocess_needs_an_app_it_can_load(redlock_worker_factory):
    with pytest.raises(pytest.UsageError, match="redlock_celery_app"):
        redlock_worker_factory()
'''


def guide_files() -> dict[str, str]:
    """The files of docs/testing.md's example: fenced blocks whose first line is
    ``# file: NAME``."""
    blocks = re.findall(r"```(?:python|ini)\n# file: (\S+)\n(.*?)```", GUIDE.read_text(), re.S)
    files = dict(blocks)
    assert set(files) == GUIDE_FILES, f"docs/testing.md's example files: {sorted(files)}"
    return files


@pytest.mark.timeout(INNER_TIMEOUT + 30)
def test_the_documented_example_and_the_fixture_checks_pass(pytester: pytest.Pytester) -> None:
    for name, text in guide_files().items():
        (pytester.path / name).write_text(text)
    pytester.makepyfile(
        checks_tasks=textwrap.dedent(CHECKS_TASKS), test_fixture_checks=FIXTURE_CHECKS
    )
    # docs/testing.md's pytest.ini loads the plugin (-p in addopts).
    result = pytester.runpytest_subprocess("-v", timeout=INNER_TIMEOUT)
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        [
            "*test_reports.py::test_a_second_call_for_the_same_account_is_skipped PASSED*",
            "*test_reports.py::test_a_worker_process_skips_a_call_while_the_lock_is_held PASSED*",
        ]
    )


@pytest.mark.timeout(INNER_TIMEOUT + 30)
def test_without_an_app_setting_a_blank_app_runs_shared_singleton_tasks(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_blank_app=BLANK_APP_CHECKS)
    result = pytester.runpytest_subprocess("-p", PLUGIN, timeout=INNER_TIMEOUT)
    result.assert_outcomes(passed=2)


def test_the_plugin_loads_only_where_it_is_asked_for(pytester: pytest.Pytester) -> None:
    """Installing celery-redlock adds nothing to other projects' pytest sessions."""
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_unasked="def test_worker(redlock_worker):\n    pass\n")
    result = pytester.runpytest_subprocess(timeout=INNER_TIMEOUT)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'redlock_worker' not found*"])


def test_importing_the_plugin_starts_nothing() -> None:
    """Loading the plugin must not start or load the harness."""
    probe = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        import {PLUGIN}

        def parent_of(entry):
            try:
                return int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                return None

        children = [
            entry.name for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and parent_of(entry) == os.getpid()
        ]
        print("celery_redlock.testing" in sys.modules, children)
        """
    )
    output = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert output.split() == ["False", "[]"], output
