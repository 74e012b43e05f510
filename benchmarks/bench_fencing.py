"""What a fenced write costs over the same write unfenced (`celery_redlock.fencing`), per storage.

Run from the repository root::

    python benchmarks/bench_fencing.py                  # 2,000 writes per case
    python benchmarks/bench_fencing.py --writes 500

Storages: Redis (a fresh ``redis-server`` from ``celery_redlock.testing``, never the shared one
on 6379), SQLite (a temporary file), PostgreSQL on 127.0.0.1:5432 (user postgres; a database
made for the run and dropped after) through SQLAlchemy, and Django on that PostgreSQL (the
``accounts`` app of tests/django_project). PostgreSQL and Django are left out, saying so, where
no PostgreSQL answers.

Every case writes one row or key over and over, each write its own transaction (SQL) or call;
fenced writes carry growing tokens, so every one is accepted. Fenced and unfenced cases of one
storage alternate in batches, so machine noise falls on both. Reported per case: median and p99
latency in microseconds, and the requests each write sends the server: Redis commands
(counted by the client), SQL statements (SQLAlchemy's ``before_cursor_execute``, Django's
``execute_wrapper``; BEGIN and COMMIT are the same for both and not counted). It is a report, not
a test: it always exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import redis
from benchmark_support import PRODUCTION_SERVER, cpu_model, percentile
from sqlalchemy import Column, Engine, MetaData, String, Table, Text, create_engine, event, update
from sqlalchemy.dialects import postgresql, sqlite

from celery_redlock.fencing.redis import fenced_hset, fenced_set
from celery_redlock.fencing.sql import fence_column, fenced_update, fenced_upsert
from celery_redlock.testing import RedisNodes

TESTS = Path(__file__).resolve().parent.parent / "tests"
POSTGRES = "host=127.0.0.1 port=5432 user=postgres dbname=test"
BATCH = 100

Write = Callable[[int], None]
"""One write; its argument grows with every call (the fencing token of a fenced write)."""


class Counter:
    """Requests sent to a server, counted by whatever the storage offers."""

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read


def measure(cases: dict[str, Write], counter: Counter, writes: int) -> dict[str, tuple]:
    """Latencies and requests per write of every case, batches interleaved."""
    tokens = itertools.count(1)
    for write in cases.values():
        for _ in range(50):
            write(next(tokens))
    latencies: dict[str, list[float]] = {name: [] for name in cases}
    requests: dict[str, int] = dict.fromkeys(cases, 0)
    for _ in range(max(1, writes // BATCH)):
        for name, write in cases.items():
            before = counter.read()
            for _ in range(BATCH):
                token = next(tokens)
                started = time.perf_counter()
                write(token)
                latencies[name].append(time.perf_counter() - started)
            requests[name] += counter.read() - before
    return {
        name: (
            percentile(values, 0.5) * 1e6,
            percentile(values, 0.99) * 1e6,
            requests[name] / len(values),
        )
        for name, values in latencies.items()
    }


class CountingRedis(redis.Redis):
    """A client that counts the commands it sends: one round trip each."""

    sent = 0

    def execute_command(self, *arguments: Any, **options: Any) -> Any:
        self.sent += 1
        return super().execute_command(*arguments, **options)


def redis_cases(stack: ExitStack) -> tuple[dict[str, Write], Counter]:
    server = stack.enter_context(RedisNodes(1, extra_args=PRODUCTION_SERVER))[0]
    client = stack.enter_context(CountingRedis.from_url(server.url))
    return {
        "SET": lambda token: client.set("report", f"v{token}"),
        "fenced_set": lambda token: fenced_set(client, "report", f"v{token}", token),
        "HSET": lambda token: client.hset("totals", mapping={"count": token}),
        "fenced_hset": lambda token: fenced_hset(client, "totals", {"count": token}, token),
    }, Counter(lambda: client.sent)


def sql_cases(engine: Engine) -> tuple[dict[str, Write], Counter]:
    table = Table(
        "bench_fenced",
        MetaData(),
        Column("name", String(20), primary_key=True),
        Column("value", Text),
        fence_column(),
    )
    table.metadata.drop_all(engine)
    table.metadata.create_all(engine)
    statements = [0]

    @event.listens_for(engine, "before_cursor_execute")
    def count(*arguments: Any) -> None:
        statements[0] += 1

    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert

    def upsert(token: int) -> None:
        statement = insert(table).values(name="row", value=f"v{token}")
        statement = statement.on_conflict_do_update(
            index_elements=["name"], set_={"value": statement.excluded.value}
        )
        with engine.begin() as connection:
            connection.execute(statement)

    def fenced_upsert_once(token: int) -> None:
        with engine.begin() as connection:
            fenced_upsert(connection, table, {"name": "row", "value": f"v{token}"}, token)

    def plain_update(token: int) -> None:
        statement = update(table).where(table.c.name == "row").values(value=f"v{token}")
        with engine.begin() as connection:
            connection.execute(statement)

    def fenced_update_once(token: int) -> None:
        with engine.begin() as connection:
            where = table.c.name == "row"
            fenced_update(connection, table, where, {"value": f"v{token}"}, token)

    return {
        "upsert": upsert,
        "fenced_upsert": fenced_upsert_once,
        "UPDATE": plain_update,
        "fenced_update": fenced_update_once,
    }, Counter(lambda: statements[0])


def django_cases(database: str, stack: ExitStack) -> tuple[dict[str, Write], Counter]:
    sys.path.insert(0, str(TESTS))
    from fencing_stores import set_up_django

    set_up_django(database)
    from django.core.management import call_command
    from django.db import connection
    from django_project.accounts.models import Account

    call_command("migrate", verbosity=0)
    Account.objects.create(name="row")
    statements = [0]

    def count(execute: Callable[..., Any], *arguments: Any) -> Any:
        statements[0] += 1
        return execute(*arguments)

    stack.enter_context(connection.execute_wrapper(count))
    rows = Account.objects.filter(name="row")
    return {
        "update()": lambda token: rows.update(value=f"v{token}"),
        "fenced_update()": lambda token: rows.fenced_update(token, value=f"v{token}"),
    }, Counter(lambda: statements[0])


@contextmanager
def postgres_database() -> Iterator[str | None]:
    """A database made for the run (its name), or None where no PostgreSQL answers."""
    try:
        import psycopg

        admin = psycopg.connect(POSTGRES, autocommit=True, connect_timeout=3)
    except Exception as error:
        print(f"PostgreSQL and Django left out: no PostgreSQL on 127.0.0.1:5432 ({error})")
        yield None
        return
    name = f"crl_bench_fencing_{secrets.token_hex(4)}"
    with admin:
        admin.execute(f"CREATE DATABASE {name}")
        try:
            yield name
        finally:
            from django.db import connections

            connections.close_all()
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=2000, help="writes per case")
    arguments = parser.parse_args()
    print(f"# Fenced and unfenced writes, {arguments.writes} each ({cpu_model()})\n")
    print("| storage | write | median µs | p99 µs | requests per write |")
    print("|---|---|---:|---:|---:|")
    with ExitStack() as stack, tempfile.TemporaryDirectory() as directory:
        storages: dict[str, Callable[[], tuple[dict[str, Write], Counter]]] = {
            "Redis": lambda: redis_cases(stack),
            "SQLite": lambda: sql_cases(create_engine(f"sqlite:///{directory}/bench.sqlite3")),
        }
        database = stack.enter_context(postgres_database())
        if database is not None:
            address = f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"
            storages["PostgreSQL"] = lambda: sql_cases(create_engine(address))
            storages["Django (PostgreSQL)"] = lambda: django_cases(database, stack)
        for storage, make in storages.items():
            cases, counter = make()
            for name, (median, p99, requests) in measure(cases, counter, arguments.writes).items():
                print(f"| {storage} | {name} | {median:.0f} | {p99:.0f} | {requests:g} |")


if __name__ == "__main__":
    main()
