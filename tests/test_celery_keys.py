"""Lock keys of real task runs: arguments bound to the signature with defaults, canonical,
hashed; raw argument values never reach the lock nodes; unencodable arguments fail the run
with a `LockKeyError` naming the argument, and the worker keeps working.
"""

from __future__ import annotations

import datetime
import decimal
import threading
import uuid
from typing import Any

import pytest
from celery_apps.support import (
    RunLog,
    documented_key,
    embedded_worker,
    lock_keys,
    make_app,
    stored_text,
    template_key,
)
from redlock_support import wait_until

from celery_redlock import DuplicateSkipped, LockKeyError, SingletonTask, singleton_task
from celery_redlock.testing import RedisNodes, RedisServer

pytest_plugins = ["celery_apps.fixtures"]


def test_positional_keyword_and_default_spellings_share_one_key(
    broker: RedisServer, lock_nodes: RedisNodes
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="keys.keyed")
    def keyed(self: SingletonTask, x: Any, y: int = 5, *, options: Any = None) -> str:
        return self.lock.key

    def key_of(*args: Any, **kwargs: Any) -> str:
        return str(keyed.apply_async(args, kwargs).get(timeout=10))

    with embedded_worker(app):
        same = {
            key_of(1),
            key_of(x=1),
            key_of(1, 5),
            key_of(1, y=5),
            key_of(y=5, x=1),
            key_of(1, options=None),
        }
        assert same == {documented_key("keys.keyed", {"x": 1, "y": 5, "options": None})}

        # Mappings are canonical: their order does not matter, their content does.
        mapping = key_of(1, options={"b": 2, "a": [1, {"d": 4, "c": 3}]})
        assert mapping == key_of(1, options={"a": [1, {"c": 3, "d": 4}], "b": 2})

        different = {key_of(2), key_of(1, 6), key_of("1"), key_of([1]), mapping}
        assert len(different) == 5
        assert not different & same
    assert all(not keys for keys in lock_keys(lock_nodes))  # every run released its lock


def test_a_duplicate_spelled_differently_is_skipped_while_other_keys_run(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="keys.report")
    def report(self: SingletonTask, account: int, day: str = "mon") -> str:
        with run_log.run(self.lock.key, account=account):
            if (account, day) == (1, "mon"):
                gate.wait(10)
        return self.lock.key

    with embedded_worker(app):
        first = report.delay(1)
        run_log.wait_started(1)
        with pytest.raises(DuplicateSkipped) as skipped:
            report.apply_async(kwargs={"day": "mon", "account": 1}).get(timeout=10)
        assert report.delay(2).get(timeout=10) != skipped.value.key  # another key runs
        assert report.delay(1, "tue").get(timeout=10) != skipped.value.key
        gate.set()
        assert first.get(timeout=10) == skipped.value.key
    assert [run["account"] for run in run_log.runs()] == [2, 1, 1]


def test_uuid_datetime_decimal_and_bytes_arguments(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)
    ident = uuid.UUID("5f0c6d1e-9a2b-4c3d-8e7f-0123456789ab")
    when = datetime.datetime(2031, 7, 14, 9, 26, 53, 589793, tzinfo=datetime.timezone.utc)
    amount = decimal.Decimal("4711.0815")
    blob = b"raw-bytes-\x00\xfe-payload"
    secret = "account-secret-31337"

    @singleton_task(
        app=app,
        shared=False,
        bind=True,
        name="keys.typed",
        lock_args=("ident", "when", "amount", "blob", "secret"),
    )
    def typed(
        self: SingletonTask,
        ident: uuid.UUID,
        when: datetime.datetime,
        amount: decimal.Decimal,
        blob: bytes,
        secret: str,
        hold: bool = False,
    ) -> dict[str, Any]:
        types = [type(value).__name__ for value in (ident, when, amount, blob, secret)]
        with run_log.run(self.lock.key):
            if hold:
                gate.wait(10)
        return {"key": self.lock.key, "types": types}

    with embedded_worker(app):
        first = typed.delay(ident, when, amount, blob, secret, hold=True)
        run_log.wait_started(1)

        # While the lock is held, look at everything stored on every lock node.
        raw = [
            secret,
            str(ident),
            ident.hex,
            when.isoformat(),
            "2031-07-14",
            str(amount),
            "4711",
            "raw-bytes",
            blob.hex(),
        ]
        # The acquisition returned on a quorum; the third SET may still be on its way.
        assert wait_until(lambda: all(len(keys) == 1 for keys in lock_keys(lock_nodes)))
        stored = stored_text(lock_nodes)
        assert len(stored) >= 6  # at least the lock key and its value on three nodes
        leaked = [(value, text) for value in raw for text in stored if value in text]
        assert not leaked, leaked

        # Equal values are the same lock; a different value of any argument is another one.
        with pytest.raises(DuplicateSkipped):
            typed.delay(
                uuid.UUID(str(ident)), when, decimal.Decimal("4711.0815"), bytes(blob), secret
            ).get(timeout=10)
        variants = [
            (uuid.uuid4(), when, amount, blob, secret),
            (ident, when + datetime.timedelta(microseconds=1), amount, blob, secret),
            (ident, when, decimal.Decimal("4711.0816"), blob, secret),
            (ident, when, amount, blob + b"!", secret),
            (ident, when, amount, blob, secret.upper()),
        ]
        others = [typed.delay(*variant).get(timeout=10) for variant in variants]
        gate.set()
        held = first.get(timeout=10)

    assert held["types"] == ["UUID", "datetime", "Decimal", "bytes", "str"]
    assert len({held["key"], *(other["key"] for other in others)}) == 6
    assert len(run_log.runs()) == 6
    assert all(not keys for keys in lock_keys(lock_nodes))


def test_lock_args_lock_key_templates_and_callables(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, bind=True, name="keys.sync", lock_args=("account_id",))
    def sync(self: SingletonTask, account_id: int, page: int = 0) -> str:
        return self.lock.key

    @singleton_task(
        app=app, shared=False, bind=True, name="keys.export", lock_key="account:{account_id}"
    )
    def export(self: SingletonTask, account_id: int, fmt: str = "csv") -> str:
        with run_log.run(self.lock.key, task="export"):
            if fmt == "hold":
                gate.wait(10)
        return self.lock.key

    @singleton_task(
        app=app,
        shared=False,
        bind=True,
        name="keys.purge",
        lock_key="account:{account_id}",
    )
    def purge(self: SingletonTask, account_id: int) -> str:
        with run_log.run(self.lock.key, task="purge"):
            pass
        return self.lock.key

    def by_account(account_id: int, **_: Any) -> str:
        return f"acct-{account_id}"

    @singleton_task(app=app, shared=False, bind=True, name="keys.audit", lock_key=by_account)
    def audit(self: SingletonTask, account_id: int, level: int = 1) -> str:
        return self.lock.key

    with embedded_worker(app):
        assert sync.delay(7, 1).get(timeout=10) == sync.delay(7, page=2).get(timeout=10)
        assert sync.delay(7).get(timeout=10) == documented_key("keys.sync", {"account_id": 7})
        assert sync.delay(8).get(timeout=10) != documented_key("keys.sync", {"account_id": 7})

        # Two tasks rendering the same lock_key share one lock.
        held = export.delay(7, "hold")
        run_log.wait_started(1)
        with pytest.raises(DuplicateSkipped):
            purge.delay(7).get(timeout=10)
        assert purge.delay(8).get(timeout=10) == template_key("account:8")
        gate.set()
        assert held.get(timeout=10) == template_key("account:7")

        assert audit.delay(7, level=3).get(timeout=10) == template_key("acct-7")
    assert [run["task"] for run in run_log.runs()] == ["purge", "export"]


def test_unencodable_arguments_fail_with_lock_key_error_and_the_worker_goes_on(
    broker: RedisServer, lock_nodes: RedisNodes
) -> None:
    # The pickle serializer lets an argument through that canonical JSON cannot encode.
    app = make_app(
        broker,
        lock_nodes,
        task_serializer="pickle",
        result_serializer="pickle",
        accept_content=["pickle", "json"],
    )
    ran: list[object] = []

    @singleton_task(app=app, shared=False, name="keys.ingest")
    def ingest(source: str, payload: object = None) -> str:
        ran.append(payload)
        return source

    with embedded_worker(app, concurrency=2):
        failed = ingest.delay("feed", payload=object())
        with pytest.raises(LockKeyError) as raised:
            failed.get(timeout=10)
        assert failed.state == "FAILURE"
        assert "'payload'" in str(raised.value)
        assert "lock_args" in str(raised.value)  # and it says how to fix it

        with pytest.raises(LockKeyError, match="signature"):
            app.send_task("keys.ingest", ("feed", 1, 2, 3)).get(timeout=10)

        assert ingest.delay("next", payload={"ok": [1, 2]}).get(timeout=10) == "next"
        assert ingest.delay("last").get(timeout=10) == "last"
    assert ran == [{"ok": [1, 2]}, None]  # the failed calls never ran their body
    assert all(not keys for keys in lock_keys(lock_nodes))


def test_deeply_nested_arguments_fail_with_lock_key_error_naming_them(
    broker: RedisServer, lock_nodes: RedisNodes
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(app=app, shared=False, name="keys.deep")
    def deep(source: str, tree: object = None) -> str:
        return source

    nested: list[object] = []
    innermost = nested
    for _ in range(500):  # deeper than Python's own recursion would allow to encode
        innermost.append([])
        innermost = innermost[0]  # type: ignore[assignment]
    with pytest.raises(LockKeyError, match=r"'tree'.*nested more than 100 levels"):
        deep.lock_key_for("feed", tree=nested)
    cycle: list[object] = []
    cycle.append(cycle)
    with pytest.raises(LockKeyError, match="'tree'"):
        deep.lock_key_for("feed", tree=cycle)
    # Through a worker: the run fails with the same error, and the worker goes on.
    shallow = {"a": [[{"b": 1}]]}
    with embedded_worker(app, concurrency=1, pool="solo"):
        failed = deep.delay("feed", tree=nested)
        with pytest.raises(LockKeyError, match="'tree'"):
            failed.get(timeout=10)
        assert deep.delay("ok", tree=shallow).get(timeout=10) == "ok"
