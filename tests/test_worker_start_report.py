"""What a real ``celery worker`` says about its lock nodes when it starts (issue 25, problems 2
and 3): one INFO line listing the nodes (passwords redacted), how many answer and whether a
quorum does; an ERROR line without a quorum, saying what to check; a WARNING naming both URLs
of one server listed twice; an ERROR naming the node and the setting when a node refuses the
worker's credentials. Every assertion reads the worker's own log, once it logged "ready."."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from celery_apps.subprocesses import BROKER_VARIABLE, CeleryProcess, celery_processes
from conftest import MakeRedisNodes
from redlock_support import wait_until

from celery_redlock.testing import RedisServer, free_port

SECRET = "start-report-s3cret"
READY = re.compile(r"\bready\.")
REPORT = re.compile(r"INFO/MainProcess\] lock nodes: (.*)")


def started_worker_log(broker: RedisServer, name: str, settings: Mapping[str, object]) -> str:
    """Start a solo ``celery worker`` of `celery_apps.config_app` with ``settings`` over the
    app's, wait for its "ready." and return its log up to there."""
    environment = {BROKER_VARIABLE: broker.url, "CRL_SETTINGS": json.dumps(settings)}
    worker = CeleryProcess(
        "celery_apps.config_app",
        [
            *("worker", "-P", "solo", "-n", f"{name}@%h", "--loglevel", "INFO"),
            *("--without-mingle", "--without-gossip", "--without-heartbeat"),
        ],
        environment,
    )
    with celery_processes() as processes:
        processes.append(worker.start())
        ready = wait_until(lambda: READY.search(worker.log_text()), timeout=60, alive=[worker])
        log = worker.log_text()
    assert ready, f"the worker never logged ready:\n{log}"
    return log[: READY.search(log).end()]  # type: ignore[union-attr]  # found above


def report_line(log: str) -> str:
    """The one start-up report line (it must be the only one)."""
    lines = REPORT.findall(log)
    assert len(lines) == 1, log
    return str(lines[0])


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "ERROR/MainProcess" in line]


def test_one_line_lists_the_nodes_with_passwords_redacted_and_the_quorum(
    redis_nodes: MakeRedisNodes,
) -> None:
    broker = redis_nodes(1)[0]
    nodes = redis_nodes(3, password=SECRET)
    urls = [f"redis://:{SECRET}@127.0.0.1:{server.port}/0" for server in nodes]
    log = started_worker_log(broker, "listed", {"redlock_urls": urls})
    shown = [f"redis://:***@127.0.0.1:{server.port}/0 up" for server in nodes]
    assert report_line(log) == (
        "3 of 3 answer, 2 make a quorum: a quorum answers; " + ", ".join(shown)
    )
    assert SECRET not in log
    assert "singleton tasks work while a majority" not in log  # the old per-node warnings
    assert error_lines(log) == []


def test_no_quorum_at_start_is_an_error_saying_what_to_check(
    redis_nodes: MakeRedisNodes,
) -> None:
    broker = redis_nodes(1)[0]
    up = redis_nodes(1)[0]
    silent = [free_port(), free_port()]
    urls = [up.url, *(f"redis://127.0.0.1:{port}/0" for port in silent)]
    log = started_worker_log(broker, "alone", {"redlock_urls": urls})
    line = report_line(log)
    assert line.startswith("1 of 3 answer, 2 make a quorum: NO quorum answers; ")
    for port in silent:
        assert f"redis://127.0.0.1:{port}/0 DOWN (" in line
    (error,) = error_lines(log)
    assert "no quorum of lock nodes answers at worker start (1 of 3, 2 needed)" in error
    assert "Check that redlock_urls names the right hosts and ports" in error
    assert log.index("lock nodes: ") < log.index(error)


def test_one_server_listed_twice_is_a_warning_naming_both_urls(
    redis_nodes: MakeRedisNodes,
) -> None:
    broker = redis_nodes(1)[0]
    first, second = redis_nodes(2)
    twice = [f"redis://127.0.0.1:{first.port}/0", f"redis://localhost:{first.port}/0"]
    log = started_worker_log(broker, "twice", {"redlock_urls": [*twice, second.url]})
    assert report_line(log).startswith("3 of 3 answer, 2 make a quorum: a quorum answers; ")
    warnings = [line for line in log.splitlines() if "WARNING/MainProcess" in line]
    assert any(
        f"{twice[0]} and {twice[1]} are the same Redis server (same run_id)" in line
        for line in warnings
    ), log
    assert second.url not in "".join(line for line in warnings if "same Redis server" in line)


def test_a_wrong_password_is_a_configuration_error_naming_node_and_setting(
    redis_nodes: MakeRedisNodes,
) -> None:
    broker = redis_nodes(1)[0]
    nodes = redis_nodes(3, password=SECRET)
    right = [f"redis://127.0.0.1:{server.port}/0" for server in (nodes[0], nodes[1])]
    wrong_url = f"redis://:wrong-word@127.0.0.1:{nodes[2].port}/0"
    settings = {"redlock_urls": [*right, wrong_url], "redlock_password": SECRET}
    log = started_worker_log(broker, "wrongurl", settings)
    shown = f"redis://:***@127.0.0.1:{nodes[2].port}/0"
    assert report_line(log).startswith("2 of 3 answer, 2 make a quorum: a quorum answers; ")
    assert f"{shown} REFUSES this worker" in report_line(log)
    (error,) = error_lines(log)
    assert f"lock node {shown} refuses this worker (invalid username-password pair" in error
    assert "a configuration fault, not an outage" in error
    assert "correct the user and password in this node's URL in redlock_urls" in error
    assert "wrong-word" not in log and SECRET not in log


def test_a_wrong_redlock_password_names_the_setting_on_every_node(
    redis_nodes: MakeRedisNodes,
) -> None:
    broker = redis_nodes(1)[0]
    nodes = redis_nodes(3, password=SECRET)
    urls = [f"redis://127.0.0.1:{server.port}/0" for server in nodes]
    log = started_worker_log(
        broker, "wrongsetting", {"redlock_urls": urls, "redlock_password": "wrong-word"}
    )
    assert report_line(log).startswith("0 of 3 answer, 2 make a quorum: NO quorum answers; ")
    errors = error_lines(log)
    denials = [line for line in errors if "refuses this worker" in line]
    assert len(denials) == 3, log
    for url, line in zip(urls, denials, strict=True):
        assert f"lock node {url} refuses this worker" in line
        assert "set redlock_password (and redlock_username for an ACL user)" in line
    assert any("no quorum of lock nodes answers at worker start" in line for line in errors)


def test_an_acl_that_denies_the_lock_scripts_is_a_configuration_error(
    redis_nodes: MakeRedisNodes,
) -> None:
    broker = redis_nodes(1)[0]
    nodes = redis_nodes(3, password=SECRET)
    nodes[0].apply_acl("ACL SETUSER locks on >user-word ~redlock:* +ping +info")  # no +eval
    for server in (nodes[1], nodes[2]):
        server.apply_acl("ACL SETUSER locks on >user-word ~redlock:* +@all")
    urls = [f"redis://127.0.0.1:{server.port}/0" for server in nodes]
    settings = {"redlock_urls": urls, "redlock_username": "locks", "redlock_password": "user-word"}
    log = started_worker_log(broker, "acl", settings)
    assert report_line(log).startswith("2 of 3 answer, 2 make a quorum: a quorum answers; ")
    (error,) = error_lines(log)
    assert f"lock node {urls[0]} refuses this worker (the node's user may not run 'eval'" in error
    assert "grant it with ACL SETUSER locks +eval" in error
    assert "a configuration fault, not an outage" in error
