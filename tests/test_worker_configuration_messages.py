"""What a real ``celery worker`` says about a configuration it cannot use (issue 25, problems 1
and 4), each tried as the issue writes it: a misspelled ``redlock_*`` setting is a WARNING naming
the closest known one (a refusal to start with ``redlock_strict_settings``); a misspelled lock
option keyword stops the worker when its task is built; a bad setting stops the worker with one
CRITICAL line that names the setting and the fix, without Celery's traceback."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from celery_apps.subprocesses import BROKER_VARIABLE, CeleryProcess, celery_processes
from conftest import MakeRedisNodes
from redlock_support import wait_until

from celery_redlock.testing import ManagedProcess, RedisServer

READY = re.compile(r"\bready\.")
STOPS = "CRITICAL/MainProcess] celery_redlock configuration error, the worker stops: "


def worker(
    broker: RedisServer,
    name: str,
    settings: Mapping[str, object],
    options: Mapping[str, object] | None = None,
) -> CeleryProcess:
    """A solo ``celery worker`` of `celery_apps.config_app` with ``settings`` over the app's and
    ``options`` as its task's keywords (not started)."""
    environment = {
        BROKER_VARIABLE: broker.url,
        "CRL_SETTINGS": json.dumps(settings),
        "CRL_TASK_OPTIONS": json.dumps(options or {}),
    }
    arguments = ["worker", "-P", "solo", "-n", f"{name}@%h", "--loglevel", "INFO"]
    arguments += ["--without-mingle", "--without-gossip", "--without-heartbeat"]
    return CeleryProcess("celery_apps.config_app", arguments, environment)


def refusal(process: ManagedProcess) -> tuple[int, str]:
    """The exit status and output of a worker expected to stop on its own."""
    return process.wait(60), process.log_text()


def test_misspelled_settings_are_warnings_naming_the_closest_setting(
    redis_nodes: MakeRedisNodes,
) -> None:
    broker = redis_nodes(1)[0]
    settings = {
        "redlock_url": ["redis://127.0.0.1:1/0"],
        "redlock_tll": 5,
        "redlock_pasword": "s3cret",
    }
    with celery_processes() as processes:
        started = worker(broker, "misspelled", settings)
        processes.append(started.start())
        ready = wait_until(lambda: READY.search(started.log_text()), timeout=60, alive=[started])
        log = started.log_text()
    assert ready, log
    warnings = re.findall(r"WARNING/MainProcess\] celery_redlock knows no setting (.*)", log)
    assert warnings == [
        "redlock_pasword (did you mean redlock_password?); it is ignored",
        "redlock_tll (did you mean redlock_ttl?); it is ignored",
        "redlock_url (did you mean redlock_urls?); it is ignored",
    ], log
    assert log.index("knows no setting") < READY.search(log).start()  # type: ignore[union-attr]


def test_misspelled_settings_stop_the_worker_under_strict_settings(
    redis_nodes: MakeRedisNodes,
) -> None:
    broker = redis_nodes(1)[0]
    settings = {"redlock_url": ["redis://127.0.0.1:1/0"], "redlock_strict_settings": True}
    with celery_processes() as processes:
        processes.append(worker(broker, "strict", settings).start())
        returncode, log = refusal(processes[0])
    assert returncode != 0, log
    assert (
        STOPS
        + (
            "celery_redlock knows no setting redlock_url (did you mean redlock_urls?) "
            "(redlock_strict_settings is on: fix or remove the name)"
        )
        in log
    )
    assert "Traceback" not in log
    assert not READY.search(log)


BAD_SETTINGS = {
    "ttl": ({"redlock_ttl": 0}, "redlock_ttl must be a positive number of seconds, got 0"),
    "scheme": (
        {"redlock_urls": ["http://127.0.0.1:6379/0"]},
        "redlock_urls: lock node URL 'http://127.0.0.1:6379/0' is not a Redis URL",
    ),
    "url-option": (
        {"redlock_urls": ["redis://127.0.0.1:1/0?socket_timeout=abc"]},
        "redlock_urls: cannot use lock node URL 'redis://127.0.0.1:1/0?socket_timeout=abc': "
        "Invalid value for 'socket_timeout' in connection URL; the form is redis://",
    ),
}


def test_a_bad_setting_stops_the_worker_with_one_line_and_no_traceback(
    redis_nodes: MakeRedisNodes,
) -> None:
    broker = redis_nodes(1)[0]
    with celery_processes() as processes:
        for name, (settings, _) in BAD_SETTINGS.items():
            processes.append(worker(broker, name, settings).start())
        for process, (name, (_, message)) in zip(processes, BAD_SETTINGS.items(), strict=True):
            returncode, log = refusal(process)
            assert returncode != 0, f"{name}: the worker started\n{log}"
            stops = [line for line in log.splitlines() if STOPS in line]
            assert len(stops) == 1 and message in stops[0], f"{name}:\n{log}"
            assert "Traceback" not in log, f"{name}:\n{log}"
            assert "Unrecoverable error" not in log, f"{name}:\n{log}"


def test_misspelled_lock_option_keywords_stop_the_worker_when_the_task_is_built(
    redis_nodes: MakeRedisNodes,
) -> None:
    broker = redis_nodes(1)[0]
    misspelled = {
        "on_dupliacte": ({"on_dupliacte": "retry"}, "did you mean 'on_duplicate'?"),
        "lock_tll": ({"lock_tll": 5}, "did you mean 'lock_ttl'?"),
    }
    with celery_processes() as processes:
        for name, (options, _) in misspelled.items():
            processes.append(worker(broker, name, {}, options).start())
        for process, (name, (_, hint)) in zip(processes, misspelled.items(), strict=True):
            returncode, log = refusal(process)
            assert returncode != 0, f"{name}: the worker started\n{log}"
            assert f"got '{name}', which is no lock option ({hint})" in log, log
