"""The storages of the fencing tests, one class each with the same methods, for the test process,
the writer processes and the worker processes of tests/test_fencing_storages.py.

A store is opened from its storage name and address (`open_store`): ``redis`` (a Redis URL),
``sqlite`` and ``postgresql`` (SQLAlchemy URLs), ``django`` (a PostgreSQL database name: Django
is set up in the process on first use, with the ``django_project.accounts`` app). Every store
keeps, per resource, a value and a history (the tokens of the accepted `append` calls; in commit
order, but Redis's, which is a set).

Run as a script, it is a writer process: ``python fencing_stores.py writers STORAGE ADDRESS
RESOURCE THREADS TOKEN,TOKEN,...`` appends each token from THREADS threads and prints one JSON
list of ``[token, outcome]`` (``accepted``, ``stale`` or the error); ``django-checks DATABASE``
runs `django_checks` and prints its JSON; ``migrate DATABASE`` migrates the Django database.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import redis
from sqlalchemy import Column, MetaData, String, Table, Text, create_engine, delete, insert, select

from celery_redlock.fencing import Fence, StaleFence, fencing_token
from celery_redlock.fencing.redis import fenced_hset, fenced_set, stored_token
from celery_redlock.fencing.sql import fence_column, fenced_update, fenced_upsert

STORAGES = ("redis", "sqlite", "postgresql", "django")
TABLE = "fenced_accounts"
DJANGO_TABLE = "accounts_account"
"""The table of the Django model: `SqlStore` reads it in the test process, without Django."""
POSTGRES_ADDRESS = "postgresql+psycopg://postgres@127.0.0.1:5432/{database}"


class Store(Protocol):
    def reset(self, resource: str) -> None:
        """Forget ``resource``: its row or keys exist again with fence 0, empty."""

    def write(self, resource: str, fence: Fence, value: str) -> None:
        """One fenced write of ``value`` (an upsert)."""

    def plain_write(self, resource: str, value: str) -> None:
        """The same write, unfenced."""

    def append(self, resource: str, fence: Fence) -> None:
        """One fenced write adding the token to the history."""

    def read(self, resource: str) -> tuple[str, int, list[int]]:
        """The value, the stored token and the history."""

    def close(self) -> None: ...


class RedisStore:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, decode_responses=True)

    def reset(self, resource: str) -> None:
        self.client.delete(*self.keys(resource), *(key + ":fence" for key in self.keys(resource)))

    def write(self, resource: str, fence: Fence, value: str) -> None:
        fenced_set(self.client, f"value:{resource}", value, fence)

    def plain_write(self, resource: str, value: str) -> None:
        self.client.set(f"value:{resource}", value)

    def append(self, resource: str, fence: Fence) -> None:
        fenced_hset(self.client, f"history:{resource}", {str(fencing_token(fence)): "1"}, fence)

    def read(self, resource: str) -> tuple[str, int, list[int]]:
        value = self.client.get(f"value:{resource}") or ""
        history = sorted(int(token) for token in self.client.hkeys(f"history:{resource}"))
        token = max(
            stored_token(self.client, f"value:{resource}"),
            stored_token(self.client, f"history:{resource}"),
        )
        return value, token, history

    def keys(self, resource: str) -> list[str]:
        return [f"value:{resource}", f"history:{resource}"]

    def close(self) -> None:
        self.client.close()


class SqlStore:
    def __init__(self, url: str, table: str = TABLE) -> None:
        self.engine = create_engine(url, connect_args={"timeout": 60} if "sqlite" in url else {})
        self.table = Table(
            table,
            MetaData(),
            Column("name", String(100), primary_key=True),
            Column("value", Text, nullable=False, default=""),
            Column("history", Text, nullable=False, default=""),
            fence_column(),
        )

    def create(self) -> None:
        self.table.metadata.create_all(self.engine)

    def reset(self, resource: str) -> None:
        with self.engine.begin() as connection:
            connection.execute(delete(self.table).where(self.table.c.name == resource))
            connection.execute(insert(self.table).values(name=resource, fence=0))

    def write(self, resource: str, fence: Fence, value: str) -> None:
        with self.engine.begin() as connection:
            fenced_upsert(connection, self.table, {"name": resource, "value": value}, fence)

    def plain_write(self, resource: str, value: str) -> None:
        with self.engine.begin() as connection:
            statement = insert(self.table).values(name=resource, value=value)
            upsert = statement.on_conflict_do_update(  # type: ignore[attr-defined]
                index_elements=["name"], set_={"value": statement.excluded.value}
            )
            connection.execute(upsert)

    def append(self, resource: str, fence: Fence) -> None:
        history = self.table.c.history + f" {fencing_token(fence)}"
        with self.engine.begin() as connection:
            fenced_update(
                connection, self.table, self.table.c.name == resource, {"history": history}, fence
            )

    def read(self, resource: str) -> tuple[str, int, list[int]]:
        columns = self.table.c
        query = select(columns.value, columns.fence, columns.history)
        with self.engine.connect() as connection:
            row = connection.execute(query.where(columns.name == resource)).one()
        return row.value, row.fence, [int(token) for token in row.history.split()]

    def close(self) -> None:
        self.engine.dispose()


class DjangoStore:
    def __init__(self, database: str) -> None:
        set_up_django(database)
        from django_project.accounts.models import Account

        self.accounts = Account.objects

    def reset(self, resource: str) -> None:
        self.accounts.filter(name=resource).delete()
        self.accounts.create(name=resource)

    def write(self, resource: str, fence: Fence, value: str) -> None:
        self.accounts.fenced_update_or_create(fence, defaults={"value": value}, name=resource)

    def plain_write(self, resource: str, value: str) -> None:
        self.accounts.update_or_create(defaults={"value": value}, name=resource)

    def append(self, resource: str, fence: Fence) -> None:
        from django.db.models import F, Value
        from django.db.models.functions import Concat

        history = Concat(F("history"), Value(f" {fencing_token(fence)}"))
        self.accounts.filter(name=resource).fenced_update(fence, history=history)

    def read(self, resource: str) -> tuple[str, int, list[int]]:
        row = self.accounts.get(name=resource)
        return row.value, row.fence, [int(token) for token in row.history.split()]

    def close(self) -> None:
        from django.db import connections

        connections.close_all()


def set_up_django(database: str) -> None:
    """Django with the ``accounts`` app on PostgreSQL database ``database``, once a process."""
    import django
    from django.conf import settings

    if settings.configured:
        if settings.DATABASES["default"]["NAME"] != database:
            raise RuntimeError("Django was set up in this process with another database")
        return
    settings.configure(
        INSTALLED_APPS=["django_project.accounts"],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": database,
                "USER": "postgres",
                "HOST": "127.0.0.1",
                "PORT": 5432,
            }
        },
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()


def open_store(storage: str, address: str) -> Store:
    """The store of ``storage`` at ``address`` (see the module's text)."""
    if storage == "redis":
        return RedisStore(address)
    if storage == "django":
        return DjangoStore(address)
    store = SqlStore(address)
    store.create()
    return store


def write_tokens(
    storage: str, address: str, resource: str, threads: int, tokens: list[int]
) -> list[tuple[int, str]]:
    """Append every token of ``tokens`` from ``threads`` threads, each with its own store:
    ``[token, outcome]`` for each, ``outcome`` being ``accepted``, ``stale`` (StaleFence raised
    naming the token) or the error's text."""
    work: queue.SimpleQueue[int] = queue.SimpleQueue()
    for token in tokens:
        work.put(token)
    outcomes: list[tuple[int, str]] = []
    guard = threading.Lock()

    def writer(store: Store) -> None:
        try:
            for token in iter_queue(work):
                try:
                    store.append(resource, token)
                    outcome = "accepted"
                except StaleFence as error:
                    outcome = "stale" if error.token == token else f"wrong token: {error!r}"
                except Exception as error:
                    outcome = f"error: {error!r}"
                with guard:
                    outcomes.append((token, outcome))
        finally:
            store.close()

    stores = [open_store(storage, address) for _ in range(threads)]
    running = [threading.Thread(target=writer, args=(store,)) for store in stores]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    return outcomes


def iter_queue(work: queue.SimpleQueue[int]) -> Iterator[int]:
    while True:
        try:
            yield work.get_nowait()
        except queue.Empty:
            return


def django_checks(database: str) -> dict[str, Any]:
    """Fenced writes with Django's transactions, on PostgreSQL; what happened, by name."""
    set_up_django(database)
    from django.db import transaction
    from django_project.accounts.models import Account

    accounts = Account.objects
    accounts.all().delete()
    found: dict[str, Any] = {}
    found["created"] = accounts.fenced_update_or_create(5, defaults={"value": "five"}, name="a")
    found["updated_again"] = accounts.fenced_update_or_create(
        6, defaults={"value": "six"}, name="a"
    )
    found["missing_row_updates"] = accounts.filter(name="none").fenced_update(7, value="x")
    try:
        with transaction.atomic():
            accounts.create(name="side")
            accounts.filter(name="a").fenced_update(4, value="stale")
    except StaleFence as error:
        found["stale_in_atomic"] = [error.token, error.stored, str(error)]
    found["side_row_rolled_back"] = not accounts.filter(name="side").exists()
    try:
        with transaction.atomic():
            accounts.filter(name="a").fenced_update(9, value="nine")
            raise LookupError("the block fails after its fenced write")
    except LookupError:
        pass
    found["fence_rolled_back_with_block"] = list(
        accounts.filter(name="a").values_list("value", "fence")
    )
    try:
        accounts.fenced_update_or_create(6, defaults={"value": "stale"}, name="a")
    except StaleFence as error:
        found["stale_upsert"] = [error.token, error.stored]
    try:
        # No row has this value, and creating one breaks the primary key of row "a".
        accounts.fenced_update_or_create(30, defaults={"name": "a"}, value="no such value")
    except Exception as error:
        found["other_constraint"] = type(error).__name__
    found["concurrent"] = concurrent_writers(accounts)
    found["final"] = list(accounts.filter(name="a").values_list("value", "fence"))
    return found


def concurrent_writers(accounts: Any) -> list[str]:
    """A transaction holding token 11's write uncommitted while another writes token 10: the
    second waits for the first's commit, then is refused."""
    from django.db import connections, transaction

    holding, committed = threading.Event(), threading.Event()
    events: list[str] = []

    def first() -> None:
        try:
            with transaction.atomic():
                accounts.filter(name="a").fenced_update(11, value="eleven")
                events.append("11 written")
                holding.set()
                committed.wait(0.5)  # the second is blocked on the row meanwhile
                events.append("11 commits")
        finally:
            connections.close_all()

    def second() -> None:
        holding.wait(10)
        try:
            accounts.filter(name="a").fenced_update(10, value="ten")
            events.append("10 accepted")
        except StaleFence:
            events.append("10 refused")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return events


def main(arguments: list[str]) -> None:
    command, *rest = arguments
    if command == "writers":
        storage, address, resource, threads, tokens = rest
        numbers = [int(token) for token in tokens.split(",")]
        print(json.dumps(write_tokens(storage, address, resource, int(threads), numbers)))
    elif command == "django-checks":
        print(json.dumps(django_checks(rest[0])))
    elif command == "migrate":
        from django.core.management import call_command

        set_up_django(rest[0])
        call_command("migrate", verbosity=0)
        # The app's migration is what makemigrations writes for the model: the field's too.
        call_command("makemigrations", "accounts", check=True, dry_run=True, verbosity=0)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
