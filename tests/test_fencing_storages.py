"""Fenced writes where the data lives (`celery_redlock.fencing`), on real servers: Redis (a
harness ``redis-server`` that is no lock node), SQLite, PostgreSQL (127.0.0.1:5432, trust auth,
user postgres, a database made for this module) through SQLAlchemy, and Django on PostgreSQL.

- a write carrying a token not larger than the stored one is refused with `StaleFence` and
  changes nothing; the transaction around a refused SQL or Django write rolls back;
- Kleppmann's pause, with real ``celery worker`` processes: holder A is SIGSTOPped past its
  lock's validity, worker B takes the lock and writes, A is resumed and writes: A's write is
  refused, B's value and token stand;
- 1,000 fenced writes with shuffled tokens from 2 processes of 4 threads each: the stored token
  never goes backwards, the accepted writes are in token order, every other one raised
  `StaleFence`.

The stores are `fencing_stores`' (the same code runs in the writer and worker processes). Tests
on PostgreSQL and Django skip, saying so, where no PostgreSQL answers on 127.0.0.1:5432.
"""

from __future__ import annotations

import json
import random
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery_apps.subprocesses import (
    BROKER_VARIABLE,
    LOCK_URLS_VARIABLE,
    TESTS_DIRECTORY,
    Recorder,
    celery_processes,
    control_app,
)
from fencing_stores import DJANGO_TABLE, POSTGRES_ADDRESS, STORAGES, SqlStore, open_store
from redlock_support import wait_until
from sqlalchemy import BigInteger, String, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import celery_redlock
from celery_redlock import ConfigurationError, Lock, RedlockError
from celery_redlock.fencing import StaleFence, fencing_token
from celery_redlock.fencing.redis import FENCED_WRITE, fenced_hset, fenced_set, stored_token
from celery_redlock.fencing.sql import fenced_update, fenced_upsert
from celery_redlock.testing import CeleryWorker, RedisNodes

POSTGRES_MISSING = (
    "PostgreSQL is not running on 127.0.0.1:5432 (trust auth, user postgres, database test): "
    "start it to run the fencing tests on PostgreSQL and Django (.ci/run checks for it)"
)
WRITES = 1000
PROCESSES = 2
THREADS_PER_PROCESS = 4


@pytest.fixture(scope="module")
def postgres_database() -> Iterator[str]:
    """A PostgreSQL database made for this module (dropped after): its name."""
    try:
        admin = psycopg.connect(
            "host=127.0.0.1 port=5432 user=postgres dbname=test", autocommit=True, connect_timeout=3
        )
    except psycopg.OperationalError:
        pytest.skip(POSTGRES_MISSING)
    name = f"crl_fencing_{secrets.token_hex(4)}"
    with admin:
        admin.execute(f"CREATE DATABASE {name}")
        try:
            yield name
        finally:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture(scope="module")
def django_database(postgres_database: str) -> str:
    """The module's PostgreSQL database, migrated for the Django ``accounts`` app."""
    run_script("migrate", postgres_database)
    return postgres_database


@pytest.fixture(scope="module")
def servers() -> Iterator[RedisNodes]:
    """Two harness servers: [0] the broker, result back-end and lock node; [1] the Redis of the
    application's data."""
    with RedisNodes(2) as nodes:
        yield nodes


def run_script(*arguments: str) -> Any:
    """`fencing_stores` run as a script with ``arguments``: its printed JSON."""
    finished = subprocess.run(
        [sys.executable, "fencing_stores.py", *arguments],
        cwd=TESTS_DIRECTORY,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(finished.stdout) if finished.stdout.strip() else None


@pytest.fixture
def address_of(
    request: pytest.FixtureRequest, servers: RedisNodes, tmp_path: Path
) -> Callable[[str], str]:
    """The address of a storage's store (a fresh SQLite file per test)."""

    def address(storage: str) -> str:
        if storage == "redis":
            return servers[1].url
        if storage == "sqlite":
            return f"sqlite:///{tmp_path / 'fenced.sqlite3'}"
        if storage == "postgresql":
            return POSTGRES_ADDRESS.format(database=request.getfixturevalue("postgres_database"))
        return str(request.getfixturevalue("django_database"))

    return address


def reader(storage: str, address: str) -> SqlStore | Any:
    """A store that reads ``storage``'s data in this process (Django's table without Django)."""
    if storage == "django":
        return SqlStore(POSTGRES_ADDRESS.format(database=address), DJANGO_TABLE)
    return open_store(storage, address)


def test_stale_fence_is_a_redlock_error_that_names_the_fix() -> None:
    error = StaleFence("accounts pk 7", 41, 42)
    assert celery_redlock.StaleFence is StaleFence and "StaleFence" in celery_redlock.__all__
    assert isinstance(error, RedlockError)
    assert error.args == ("accounts pk 7", 41, 42)
    again = StaleFence(*error.args)  # how Celery rebuilds it from a result
    assert str(again) == str(error)
    assert "fencing token 41" in str(error) and "accepted token 42" in str(error)
    assert "new lock" in str(error)


def test_the_token_comes_from_the_lock_or_an_int() -> None:
    lock = Lock(resource="r", key="k", token="t", validity=1.0, ttl=1.0, fencing_token=17)
    assert fencing_token(lock) == 17 and fencing_token(9) == 9
    for wrong in (None, 0, -3, True, "5"):
        with pytest.raises(ConfigurationError):
            fencing_token(wrong)  # type: ignore[arg-type]


@pytest.mark.parametrize("storage", ["redis", "sqlite", "postgresql"])
def test_a_write_is_refused_unless_its_token_is_larger(
    storage: str, address_of: Callable[[str], str]
) -> None:
    store = open_store(storage, address_of(storage))
    try:
        store.reset("acct")
        store.write("acct", 5, "five")
        for token in (5, 4, 1):
            with pytest.raises(StaleFence) as refused:
                store.write("acct", token, f"stale {token}")
            assert (refused.value.token, refused.value.stored) == (token, 5)
        assert store.read("acct")[:2] == ("five", 5)
        store.write("acct", 6, "six")
        assert store.read("acct")[:2] == ("six", 6)
    finally:
        store.close()


@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
def test_sql_refusal_rolls_back_the_transaction(
    storage: str, address_of: Callable[[str], str]
) -> None:
    store = SqlStore(address_of(storage))
    store.create()
    table = store.table
    store.reset("acct")
    store.reset("side")
    store.write("acct", 10, "ten")
    with pytest.raises(StaleFence), store.engine.begin() as connection:
        fenced_upsert(connection, table, {"name": "side", "value": "written"}, 3)
        fenced_update(connection, table, table.c.name == "acct", {"value": "stale"}, 9)
    assert store.read("side")[:2] == ("", 0)  # the earlier write of the transaction is undone
    with store.engine.begin() as connection:
        # A missing row is no refusal: nothing to update, as with a plain UPDATE.
        assert fenced_update(connection, table, table.c.name == "none", {"value": "x"}, 99) == 0
        update = {"value": table.c.value + "+eleven"}
        assert fenced_update(connection, table, table.c.name == "acct", update, 11) == 1
    assert store.read("acct")[:2] == ("ten+eleven", 11)
    with pytest.raises(ConfigurationError, match="key columns"), store.engine.begin() as connection:
        fenced_upsert(connection, table, {"value": "no key"}, 12)
    store.close()


class Base(DeclarativeBase):
    pass


class Report(Base):
    __tablename__ = "fenced_reports"
    day: Mapped[str] = mapped_column(String(10), primary_key=True)
    body: Mapped[str] = mapped_column(String(100))
    fence: Mapped[int] = mapped_column(BigInteger, default=0)


@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
def test_orm_session_writes_a_mapped_model(storage: str, address_of: Callable[[str], str]) -> None:
    engine = create_engine(address_of(storage))
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        fenced_upsert(session, Report, {"day": "2026-11-26", "body": "first"}, 20)
    with pytest.raises(StaleFence) as refused, Session(engine) as session, session.begin():
        fenced_upsert(session, Report, {"day": "2026-11-26", "body": "late"}, 19)
    assert refused.value.stored == 20
    assert refused.value.resource == "fenced_reports where fenced_reports.day = '2026-11-26'"
    with Session(engine) as session:
        report = session.scalars(select(Report)).one()
        assert (report.body, report.fence) == ("first", 20)
    engine.dispose()


def test_redis_fenced_writes_run_by_sha_and_leave_a_refused_write_unwritten(
    servers: RedisNodes,
) -> None:
    with servers[1].client() as client:
        client.delete("report", "report:fence", "totals", "totals:fence")
        client.script_flush()  # the first call finds no script: it is sent once, then by SHA
        fenced_set(client, "report", "first", 3)
        assert client.script_exists(FENCED_WRITE.sha) == [True]
        with pytest.raises(StaleFence) as refused:
            fenced_set(client, "report", "late", 2)
        assert (refused.value.resource, refused.value.stored) == ("report", 3)
        assert client.get("report") == b"first" and stored_token(client, "report") == 3
        fenced_hset(client, "totals", {"count": 1, "sum": 5}, 4, fence_key="totals-fence")
        with pytest.raises(StaleFence):
            fenced_hset(client, "totals", {"count": 0}, 4, fence_key="totals-fence")
        assert client.hgetall("totals") == {b"count": b"1", b"sum": b"5"}
        assert stored_token(client, "totals", fence_key="totals-fence") == 4


def test_django_fenced_writes_in_transactions(django_database: str) -> None:
    found = run_script("django-checks", django_database)
    assert found["created"] is True and found["updated_again"] is False
    assert found["missing_row_updates"] == 0
    token, stored, message = found["stale_in_atomic"]
    assert (token, stored) == (4, 6) and "accounts.Account pk a" in message
    assert found["side_row_rolled_back"] is True
    assert found["fence_rolled_back_with_block"] == [["six", 6]]
    assert found["stale_upsert"] == [6, 6]
    assert found["other_constraint"] == "IntegrityError"  # not mistaken for a race
    # The second writer waited for the first's commit, then compared with its token.
    assert found["concurrent"] == ["11 written", "11 commits", "10 refused"]
    assert found["final"] == [["eleven", 11]]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("storage", STORAGES)
def test_concurrent_writers_never_move_the_token_back(
    storage: str, address_of: Callable[[str], str]
) -> None:
    address = address_of(storage)
    store = reader(storage, address)
    store.reset("shared")
    tokens = list(range(1, WRITES + 1))
    random.shuffle(tokens)
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(store.read("shared")[1])
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    shares = [",".join(map(str, tokens[index::PROCESSES])) for index in range(PROCESSES)]
    try:
        writers = [
            subprocess.Popen(
                [
                    *(sys.executable, "fencing_stores.py", "writers", storage, address),
                    *("shared", str(THREADS_PER_PROCESS), share),
                ],
                cwd=TESTS_DIRECTORY,
                stdout=subprocess.PIPE,
                text=True,
            )
            for share in shares
        ]
        printed = [writer.communicate(timeout=150)[0] for writer in writers]
        assert [writer.returncode for writer in writers] == [0] * PROCESSES
    finally:
        done.set()
        watcher.join()
    outcomes = [outcome for output in printed for outcome in json.loads(output)]
    _, final_token, history = store.read("shared")
    store.close()
    assert sorted(token for token, _ in outcomes) == list(range(1, WRITES + 1))
    assert {outcome for _, outcome in outcomes} == {"accepted", "stale"}, outcomes
    accepted = sorted(token for token, outcome in outcomes if outcome == "accepted")
    assert final_token == WRITES and accepted[-1] == WRITES
    # Each accepted write is in the history once, in commit order (Redis: a set of fields), and
    # each was larger than every one before it; a refused write left nothing.
    assert history == accepted
    assert seen == sorted(seen) and len(set(seen)) > 1
    print(f"\n{storage}: {len(accepted)} accepted, {WRITES - len(accepted)} refused")


@pytest.fixture(scope="module")
def workers(servers: RedisNodes) -> Iterator[tuple[CeleryWorker, CeleryWorker, Celery]]:
    """Workers ``a`` and ``b`` (solo pool: the worker process runs the task, so SIGSTOP stops
    the body and its lock's keeper together), each consuming the queue of its name."""
    environment = {BROKER_VARIABLE: servers[0].url, LOCK_URLS_VARIABLE: servers[0].url}
    client = control_app(servers[0], result_backend=servers[0].url)
    with celery_processes() as processes:
        started = []
        for name in ("a", "b"):
            worker = CeleryWorker(
                "celery_apps.fencing_app",
                name,
                pool="solo",
                concurrency=1,
                queues=[name],
                environment=environment,
                python_path=[TESTS_DIRECTORY],
                working_directory=TESTS_DIRECTORY,
            )
            processes.append(worker.start())
            started.append(worker)
        for worker in started:
            worker.wait_ready(client)
        yield started[0], started[1], client
    client.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("storage", STORAGES)
def test_a_paused_holders_late_write_is_refused(
    storage: str,
    address_of: Callable[[str], str],
    workers: tuple[CeleryWorker, CeleryWorker, Celery],
    servers: RedisNodes,
    tmp_path: Path,
) -> None:
    holder, _, client = workers
    address = address_of(storage)
    store = reader(storage, address)
    resource = f"kleppmann-{storage}"
    store.reset(resource)
    recorder = Recorder(servers[0].url)
    recorder.client.delete("record:holding")
    go = tmp_path / "go"
    arguments = (storage, address, resource)
    first = client.send_task("fencing.write", (*arguments, "A", str(go)), queue="a")
    wait_until(lambda: recorder.count("holding") == 1, timeout=30)
    token_a = recorder.read("holding")[0]["token"]
    holder.pause()  # A holds the lock and is about to write
    try:
        second = client.send_task("fencing.write", (*arguments, "B"), queue="b")
        # B waits for A's lock, which runs out with A stopped: B takes it and writes.
        # A stopped can release nothing: B's lock is proof that A's validity ran out.
        token_b = second.get(timeout=30)
        assert token_b > token_a
        assert store.read(resource)[:2] == ("B", token_b)
        go.touch()
    finally:
        holder.resume()
    with pytest.raises(StaleFence) as refused:
        first.get(timeout=30)
    assert (refused.value.token, refused.value.stored) == (token_a, token_b)
    assert store.read(resource)[:2] == ("B", token_b)
    store.close()
