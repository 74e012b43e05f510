"""Root fixtures: real Redis servers from celery_redlock.testing, and Celery's embedded worker."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# pytest-celery 1.x (installed for its plugin entry point, which already registers Celery's
# own fixtures from celery.contrib.pytest: celery_app, celery_config, ...) replaces
# `celery_worker` with a Docker-based fixture that fails without Docker. Re-exporting
# Celery's own keeps the embedded worker thread (no Docker here). Celery's default test
# configuration uses `memory://` as broker and `cache+memory://` as result back-end, so
# nothing here touches Docker unless a test asks for pytest-celery's container fixtures.
from celery.contrib.pytest import celery_worker  # noqa: F401
from redlock_support import collect_results_while_the_broker_is_up

from celery_redlock.testing import RedisNodes

MakeRedisNodes = Callable[..., RedisNodes]


@pytest.fixture
def redis_nodes() -> Iterator[MakeRedisNodes]:
    """Factory of started `RedisNodes`: `make(count, **options)`.

    `options` go to `RedisNodes` (`extra_args`, `password`, ...). Every node made by the
    factory is stopped at teardown, whether the test passed, failed or paused a node.
    """
    made: list[RedisNodes] = []

    def make(count: int = 3, **options: Any) -> RedisNodes:
        nodes = RedisNodes(count, **options)
        made.append(nodes)
        return nodes.start()

    try:
        yield make
    finally:
        errors: list[BaseException] = []
        try:
            collect_results_while_the_broker_is_up()
        except BaseException as error:  # the servers are stopped whatever happens
            errors.append(error)
        for nodes in made:
            try:
                nodes.stop_all()
            except BaseException as error:
                errors.append(error)
        if errors:
            raise errors[0]


@pytest.fixture
def one_node(redis_nodes: MakeRedisNodes) -> RedisNodes:
    """One started Redis server (as `RedisNodes`), stopped at teardown."""
    return redis_nodes(1)


@pytest.fixture
def three_nodes(redis_nodes: MakeRedisNodes) -> RedisNodes:
    """Three independent started Redis masters, stopped at teardown."""
    return redis_nodes(3)


@pytest.fixture
def five_nodes(redis_nodes: MakeRedisNodes) -> RedisNodes:
    """Five independent started Redis masters, stopped at teardown."""
    return redis_nodes(5)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what the imports made out of the garbage collector's sight (`gc.freeze`): every
    teardown collects garbage (`collect_results_while_the_broker_is_up`), and would otherwise
    walk the hundreds of thousands of objects of Celery, Django and the test modules each time."""
    gc.collect()
    gc.freeze()
