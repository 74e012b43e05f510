"""Defining singleton tasks and configuring the app: every decorator form, Celery's own options
passing through, bad options and settings failing early with ConfigurationError.

Tasks run on Celery's embedded worker against a harness Redis broker; lock nodes are three
other harness nodes (or the broker itself where ``redlock_urls`` defaults to it).
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
from celery import Celery, Task
from celery_apps.support import (
    LockSignals,
    RunLog,
    documented_key,
    embedded_worker,
    key_gone,
    make_app,
)
from redlock_support import pttls_on

from celery_redlock import (
    ConfigurationError,
    DuplicateSkipped,
    LockNotAcquired,
    RedlockSettings,
    SingletonTask,
    singleton_task,
)
from celery_redlock.integration.plan import LOCK_OPTIONS
from celery_redlock.integration.runtime import AppRuntime
from celery_redlock.settings import unknown_setting_messages
from celery_redlock.testing import RedisNodes, RedisServer

pytest_plugins = ["celery_apps.fixtures"]


# -- decorator forms ---------------------------------------------------------------------------


def test_bare_decorator_is_a_shared_singleton_task(
    broker: RedisServer, lock_nodes: RedisNodes, lock_signals: LockSignals
) -> None:
    app = make_app(broker, lock_nodes)
    app.set_current()

    @singleton_task
    def bare_rebuild_report(account_id: int, day: str) -> str:
        return f"{account_id}/{day}"

    name = f"{__name__}.bare_rebuild_report"
    assert isinstance(app.tasks[name], SingletonTask)
    with embedded_worker(app):
        assert bare_rebuild_report.delay(7, "mon").get(timeout=10) == "7/mon"

    (acquired,) = lock_signals.of("lock_acquired", task=name)
    assert acquired["key"] == documented_key(name, {"account_id": 7, "day": "mon"})
    (released,) = lock_signals.wait("lock_released", task=name)
    assert released["state"] == "SUCCESS"
    assert released["released"] is True
    assert key_gone(lock_nodes, acquired["key"])


def test_options_and_every_celery_option_pass_through(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)

    @singleton_task(
        app=app,
        shared=False,
        name="reports.sync_account",
        bind=True,
        max_retries=7,
        default_retry_delay=3,
        acks_late=True,
        rate_limit="50/s",
        soft_time_limit=40,
        lock_ttl=12,
        lock_args=("account_id",),
        on_duplicate="raise",
    )
    def sync_account(self: SingletonTask, account_id: int, full: bool = False) -> dict[str, Any]:
        with run_log.run(self.lock.key, task_id=self.request.id):
            observed = {
                "name": self.name,
                "id": self.request.id,
                "ttl": self.lock.ttl,
                "key": self.lock.key,
                "pttls": pttls_on(lock_nodes, self.lock.key),
            }
            gate.wait(10)
        return observed

    task = app.tasks["reports.sync_account"]
    assert isinstance(task, SingletonTask)
    assert (task.max_retries, task.default_retry_delay, task.acks_late) == (7, 3, True)
    assert (task.rate_limit, task.soft_time_limit) == ("50/s", 40)
    assert (task.lock_ttl, tuple(task.lock_args), task.on_duplicate) == (
        12,
        ("account_id",),
        "raise",
    )

    with embedded_worker(app):
        first = sync_account.delay(5, full=True)
        run_log.wait_started(1)
        # lock_args=("account_id",): `full` does not matter, and on_duplicate="raise" fails it.
        with pytest.raises(LockNotAcquired):
            sync_account.delay(5).get(timeout=10)
        gate.set()
        observed = first.get(timeout=10)

    key = documented_key("reports.sync_account", {"account_id": 5})
    assert observed["name"] == "reports.sync_account"
    assert observed["id"] == first.id  # bind=True: `self` is the task, with its request
    assert observed["key"] == key
    assert observed["ttl"] == 12
    assert all(10_000 < pttl <= 12_000 for pttl in observed["pttls"]), observed["pttls"]
    assert len(run_log.runs()) == 1
    assert key_gone(lock_nodes, key)


def test_app_task_with_base_and_empty_lock_args_locks_the_task_name(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)

    @app.task(
        base=SingletonTask,
        lock_args=(),
        name="maintenance.nightly_cleanup",
        bind=True,
        shared=False,
    )
    def nightly_cleanup(self: SingletonTask, scope: str = "all") -> str:
        with run_log.run(self.lock.key):
            gate.wait(10)
        return self.lock.key

    with embedded_worker(app):
        first = nightly_cleanup.delay("logs")
        run_log.wait_started(1)
        with pytest.raises(DuplicateSkipped):  # other arguments, same lock: the task name
            nightly_cleanup.delay("tmp").get(timeout=10)
        gate.set()
        assert first.get(timeout=10) == "redlock:{maintenance.nightly_cleanup}"
    assert len(run_log.runs()) == 1


class AccountTask(SingletonTask):
    """A base with lock options as class attributes."""

    lock_ttl = 9
    lock_args = ("account_id",)
    on_duplicate = "raise"


class CleanupTask(SingletonTask):
    """A class-based singleton task with its own ``run``."""

    name = "maintenance.class_cleanup"
    lock_args = ()
    on_duplicate = "skip"

    def run(self, scope: str = "all") -> str:
        return f"{self.lock.key} {scope}"


def test_subclass_class_attributes_and_class_based_tasks(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    app = make_app(broker, lock_nodes)

    @app.task(base=AccountTask, bind=True, name="accounts.rebuild", shared=False)
    def rebuild(self: SingletonTask, account_id: int, day: str) -> list[int]:
        with run_log.run(self.lock.key):
            observed = pttls_on(lock_nodes, self.lock.key)
            if account_id == 1:
                gate.wait(10)
        return observed

    cleanup = app.register_task(CleanupTask())

    with embedded_worker(app):
        first = rebuild.delay(1, "mon")
        run_log.wait_started(1)
        with pytest.raises(LockNotAcquired):  # the class's on_duplicate="raise"
            rebuild.delay(1, "tue").get(timeout=10)
        other_account = rebuild.delay(2, "mon").get(timeout=10)  # another key runs meanwhile
        gate.set()
        observed = first.get(timeout=10)
        assert cleanup.delay("tmp").get(timeout=10) == "redlock:{maintenance.class_cleanup} tmp"

    assert all(0 < pttl <= 9_000 for pttl in observed + other_account)
    assert len(run_log.runs()) == 2
    assert key_gone(lock_nodes, documented_key("accounts.rebuild", {"account_id": 1}))


def _account_body(account_id: int, day: str = "mon") -> None:
    """A function to decorate in the bad-option tests.

    They pass ``shared=False``: Celery's ``app.task`` otherwise registers the task with every
    app finalized later in the process, and a bad one would break all of them.
    """


BAD_OPTIONS = [
    pytest.param({"on_duplicate": "sometimes"}, "on_duplicate", id="on_duplicate"),
    pytest.param({"on_unavailable": "ignore"}, "on_unavailable", id="on_unavailable"),
    pytest.param({"lock_args": ("acount_id",)}, "acount_id", id="lock_args-unknown"),
    pytest.param({"lock_args": "account_id"}, "lock_args", id="lock_args-str"),
    pytest.param({"lock_ttl": 0}, "lock_ttl", id="lock_ttl-zero"),
    pytest.param({"lock_ttl": -5}, "lock_ttl", id="lock_ttl-negative"),
    pytest.param({"lock_wait": 0}, "lock_wait", id="lock_wait"),
    pytest.param({"lock_hold": -1}, "lock_hold", id="lock_hold"),
    pytest.param({"lock_auto_extend": "yes"}, "lock_auto_extend", id="lock_auto_extend"),
    pytest.param({"lock_key": 42}, "lock_key", id="lock_key"),
    pytest.param({"lock_key": "acct:{acount_id}"}, "acount_id", id="lock_key-unknown"),
    pytest.param({"lock_key": "acct:{0}"}, r"\['0'\]", id="lock_key-positional"),
    pytest.param(
        {"lock_args": ("account_id",), "lock_key": "acct:{account_id}"},
        "both lock_args and lock_key",
        id="lock_args-and-lock_key",
    ),
]


@pytest.mark.parametrize(("options", "named"), BAD_OPTIONS)
def test_bad_options_fail_when_the_task_is_defined(options: dict[str, Any], named: str) -> None:
    app = Celery("bad_options", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.finalize()
    with pytest.raises(ConfigurationError, match=named):
        singleton_task(app=app, name="bad.finalized", shared=False, **options)(_account_body)
    with pytest.raises(ConfigurationError, match=named):
        app.task(base=SingletonTask, name="bad.base", shared=False, **options)(_account_body)
    assert "bad.finalized" not in app.tasks

    with pytest.raises(ConfigurationError, match=named):
        type("BadSubclass", (SingletonTask,), {**options, "run": _account_body})


@pytest.mark.parametrize(("options", "named"), BAD_OPTIONS[:3])
def test_bad_options_fail_when_a_lazy_app_finalizes(options: dict[str, Any], named: str) -> None:
    app = Celery("bad_lazy", broker="redis://127.0.0.1:1/0", set_as_current=False)
    singleton_task(app=app, name="bad.lazy", shared=False, **options)(_account_body)
    with pytest.raises(ConfigurationError, match=named):
        app.finalize()


MISSPELLED_OPTIONS = [
    pytest.param(
        {"on_dupliacte": "retry"}, "'on_dupliacte'.*did you mean 'on_duplicate'", id="dup"
    ),
    pytest.param({"lock_tll": 5}, "'lock_tll'.*did you mean 'lock_ttl'", id="ttl"),
    pytest.param({"lock_arg": ("account_id",)}, "did you mean 'lock_args'", id="args"),
    pytest.param({"unavailable": "raise"}, "did you mean 'on_unavailable'", id="unavailable"),
]


@pytest.mark.parametrize(("options", "named"), MISSPELLED_OPTIONS)
def test_misspelled_lock_options_are_refused_with_the_closest_name(
    options: dict[str, Any], named: str
) -> None:
    app = Celery("misspelled", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.finalize()
    with pytest.raises(ConfigurationError, match=named):
        singleton_task(app=app, name="typo.finalized", shared=False, **options)(_account_body)
    with pytest.raises(ConfigurationError, match=named):
        app.task(base=SingletonTask, name="typo.base", shared=False, **options)(_account_body)
    with pytest.raises(ConfigurationError, match=named):
        type("TypoSubclass", (SingletonTask,), {**options, "run": _account_body})
    assert "typo.finalized" not in app.tasks

    lazy = Celery("misspelled_lazy", broker="redis://127.0.0.1:1/0", set_as_current=False)
    singleton_task(app=lazy, name="typo.lazy", shared=False, **options)(_account_body)
    with pytest.raises(ConfigurationError, match=named):
        lazy.finalize()


def test_misspellings_are_checked_against_every_lock_option() -> None:
    assert set(LOCK_OPTIONS) == set(SingletonTask.__annotations__)


def test_names_that_are_no_misspelled_lock_option_pass_through() -> None:
    # Celery's own options close to a lock option (on_retry, on_failure), a subclass's own
    # helpers and attributes far from any lock option are the task's business.
    app = Celery("own_names", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.finalize()
    task = singleton_task(
        app=app,
        name="own.names",
        shared=False,
        on_failure=lambda *args: None,
        typing=False,
        lock_timeout_note="not an option",
        locks=3,
    )(_account_body)
    assert (task.typing, task.locks, task.lock_timeout_note) == (False, 3, "not an option")

    class WithHelpers(SingletonTask):
        abstract = True
        lock_plan_note = "a subclass's own attribute"

        def lock_key_for_account(self, account_id: int) -> str:
            return self.lock_key_for(account_id)

    assert WithHelpers.lock_plan_note


def test_lock_args_of_a_bound_task_name_caller_parameters_only() -> None:
    app = Celery("bound_args", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.finalize()

    def bound(self: SingletonTask, account_id: int) -> None:
        """`self` is the task, not something a caller passes."""

    with pytest.raises(ConfigurationError, match="'self'"):
        singleton_task(app=app, bind=True, shared=False, name="b.one", lock_args=("self",))(bound)
    task = singleton_task(
        app=app, bind=True, shared=False, name="b.two", lock_args=("account_id",)
    )(bound)
    assert task.lock_args == ("account_id",)


def test_the_app_given_by_position_is_refused_with_the_fix() -> None:
    app = Celery("by_position", broker="redis://127.0.0.1:1/0", set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"singleton_task\(app=app"):
        singleton_task(app)(_account_body)
    with pytest.raises(ConfigurationError, match="only positional argument"):
        singleton_task(_account_body, _account_body)


def test_base_must_be_a_singleton_task() -> None:
    app = Celery("bad_base", broker="redis://127.0.0.1:1/0", set_as_current=False)
    with pytest.raises(ConfigurationError, match="SingletonTask"):
        singleton_task(app=app, base=Task, shared=False)(_account_body)


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ({}, 3600.0),  # kombu's default visibility_timeout (Redis, SQS)
        ({"broker_transport_options": {"visibility_timeout": 600}}, 600.0),
        ({"broker_transport_options": {"visibility_timeout": 0}}, 3600.0),
        ({"broker_transport_options": {"polling_interval": 1}}, 3600.0),
        (
            {"broker_transport_options": {"visibility_timeout": 600}, "redlock_completed_ttl": 90},
            90,
        ),
    ],
)
def test_completion_records_live_the_brokers_redelivery_window(
    conf: dict[str, Any], expected: float
) -> None:
    settings = RedlockSettings.from_conf({"redlock_urls": ["redis://127.0.0.1:1/0"], **conf})
    assert settings.completed_ttl == expected


def test_lock_urls_default_to_a_redis_broker(broker: RedisServer) -> None:
    app = make_app(broker, lock_nodes=None)
    assert RedlockSettings.from_conf(app.conf).urls == (broker.url,)

    @singleton_task(app=app, shared=False, bind=True, name="defaults.on_broker")
    def on_broker(self: SingletonTask) -> tuple[str, str | None, str]:
        with broker.client(decode_responses=True) as client:
            return self.lock.key, client.get(self.lock.key), self.lock.token

    with embedded_worker(app):
        key, value, token = on_broker.delay().get(timeout=10)
    assert key == documented_key("defaults.on_broker", {})
    assert value is not None and value.startswith(token)  # the lock lived on the broker node
    with broker.client() as client:
        assert client.exists(key) == 0  # released from the broker node


@pytest.mark.parametrize(
    "broker_url", ["amqp://guest:guest@127.0.0.1:1//", "memory://", None], ids=str
)
def test_non_redis_broker_without_lock_urls_is_a_helpful_error(broker_url: str | None) -> None:
    app = Celery("not_redis", broker=broker_url, set_as_current=False)
    if broker_url is None:
        app.conf.broker_url = None

    @singleton_task(app=app, shared=False, name="not_redis.job")
    def job() -> str:
        return "ran"

    with pytest.raises(ConfigurationError, match="redlock_urls") as raised:
        RedlockSettings.from_conf(app.conf)
    assert "not Redis" in str(raised.value)
    assert "redis://" in str(raised.value)  # it shows what to write
    with pytest.raises(ConfigurationError, match="redlock_urls"):
        job()  # a direct call needs the lock nodes too: no silent unguarded run


BAD_SETTINGS = [
    pytest.param({"redlock_on_duplicate": "sometimes"}, "redlock_on_duplicate", id="dup"),
    pytest.param({"redlock_on_unavailable": "ignore"}, "redlock_on_unavailable", id="unav"),
    pytest.param({"redlock_ttl": 0}, "redlock_ttl", id="ttl-zero"),
    pytest.param({"redlock_ttl": -1.5}, "redlock_ttl", id="ttl-negative"),
    pytest.param({"redlock_auto_extend": "yes"}, "redlock_auto_extend", id="auto_extend"),
    pytest.param({"redlock_compat_0_2": "no"}, "redlock_compat_0_2", id="compat_0_2"),
    pytest.param({"redlock_legacy_layout": "no"}, "redlock_legacy_layout", id="legacy_layout"),
    pytest.param({"redlock_urls": []}, "redlock_urls", id="urls-empty"),
]


@pytest.mark.parametrize(("settings", "named"), BAD_SETTINGS)
def test_bad_settings_are_configuration_errors(
    broker: RedisServer, settings: dict[str, Any], named: str
) -> None:
    app = make_app(broker, ["redis://127.0.0.1:1/0"], task_always_eager=True, **settings)

    @singleton_task(app=app, shared=False, name="settings.job")
    def job() -> str:
        return "ran"

    with pytest.raises(ConfigurationError, match=named):
        RedlockSettings.from_conf(app.conf)
    with pytest.raises(ConfigurationError, match=named):
        job.delay().get(timeout=5)


def test_unknown_setting_names_get_the_closest_known_name() -> None:
    assert unknown_setting_messages(
        ["redlock_url", "redlock_tll", "redlock_pasword", "redlock_urls", "broker_url"]
    ) == [
        "celery_redlock knows no setting redlock_pasword (did you mean redlock_password?)",
        "celery_redlock knows no setting redlock_tll (did you mean redlock_ttl?)",
        "celery_redlock knows no setting redlock_url (did you mean redlock_urls?)",
    ]
    # Under Django's namespace, upper-case names outside it are other libraries' settings.
    django = ["CELERY_REDLOCK_URL", "CELERY_REDLOCK_TTL", "REDLOCK_TLL", "CELERY_BROKER_URL"]
    assert unknown_setting_messages([*django, "redlock_tll"], "CELERY_") == [
        "celery_redlock knows no setting CELERY_REDLOCK_URL (did you mean CELERY_REDLOCK_URLS?)",
        "celery_redlock knows no setting redlock_tll (did you mean redlock_ttl?)",
    ]
    assert unknown_setting_messages(["REDLOCK_URLS"]) == [
        "celery_redlock knows no setting REDLOCK_URLS (did you mean redlock_urls?)"
    ]
    assert unknown_setting_messages(["redlock_zzzzzzzz"]) == [
        "celery_redlock knows no setting redlock_zzzzzzzz (README's Settings lists the known ones)"
    ]
    # A deprecated name is known (read, with its own warning), and never suggested.
    assert unknown_setting_messages(["redlock_legacy_layout", "redlock_compat_02"]) == [
        "celery_redlock knows no setting redlock_compat_02 (did you mean redlock_compat_0_2?)"
    ]
    assert unknown_setting_messages(["CELERY_REDLOCK_LEGACY_LAYOUT"], "CELERY_") == []


def test_unknown_settings_warn_or_with_strict_settings_refuse(
    broker: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(broker, lock_nodes=None, redlock_url=["redis://127.0.0.1:1/0"], redlock_tll=5)
    with caplog.at_level("WARNING", logger="celery_redlock.settings"):
        settings = RedlockSettings.from_conf(app.conf)
    assert settings.urls == (broker.url,)  # redlock_url is not read: the broker holds the locks
    assert [record.getMessage() for record in caplog.records] == [
        "celery_redlock knows no setting redlock_tll (did you mean redlock_ttl?); it is ignored",
        "celery_redlock knows no setting redlock_url (did you mean redlock_urls?); it is ignored",
    ]
    app.conf.redlock_strict_settings = True
    with pytest.raises(
        ConfigurationError, match=r"redlock_url \(did you mean redlock_urls"
    ) as raised:
        RedlockSettings.from_conf(app.conf)
    assert "redlock_strict_settings is on" in str(raised.value)
    app.conf.redlock_strict_settings = "yes"
    with pytest.raises(ConfigurationError, match="redlock_strict_settings must be True or False"):
        RedlockSettings.from_conf(app.conf)


def test_unknown_settings_in_django_namespace_name_the_namespaced_setting(
    broker: RedisServer,
) -> None:
    class DjangoSettings:
        CELERY_BROKER_URL = broker.url
        CELERY_REDLOCK_URL = broker.url
        CELERY_REDLOCK_STRICT_SETTINGS = True
        REDLOCK_URL = "another library's setting"

    app = Celery("django_typo", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    with pytest.raises(ConfigurationError) as raised:
        RedlockSettings.from_conf(app.conf)
    assert str(raised.value) == (
        "celery_redlock knows no setting CELERY_REDLOCK_URL (did you mean CELERY_REDLOCK_URLS?) "
        "(redlock_strict_settings is on: fix or remove the name)"
    )


def test_the_0_2_copy_setting_under_django_names_both_spellings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class DjangoSettings:
        CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
        CELERY_REDLOCK_COMPAT_0_2 = False

    app = Celery("django_compat", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    assert RedlockSettings.from_conf(app.conf).compat_0_2 is False
    assert (
        RedlockSettings.from_conf(
            Celery("defaults", set_as_current=False, broker=DjangoSettings.CELERY_BROKER_URL).conf
        ).compat_0_2
        is True
    )

    class DeprecatedName:
        CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
        CELERY_REDLOCK_LEGACY_LAYOUT = False

    app = Celery("django_deprecated", set_as_current=False)
    app.config_from_object(DeprecatedName, namespace="CELERY")
    with caplog.at_level("WARNING", logger="celery_redlock.settings"):
        assert RedlockSettings.from_conf(app.conf).compat_0_2 is False
    assert [record.getMessage() for record in caplog.records] == [
        "CELERY_REDLOCK_LEGACY_LAYOUT is deprecated: name it CELERY_REDLOCK_COMPAT_0_2 (the same "
        "setting); the old name will go"
    ]


def test_django_style_celery_namespace(
    broker: RedisServer, lock_nodes: RedisNodes, gate: threading.Event, run_log: RunLog
) -> None:
    class DjangoSettings:
        CELERY_BROKER_URL = broker.url
        CELERY_RESULT_BACKEND = broker.url
        CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
        CELERY_WORKER_HIJACK_ROOT_LOGGER = False
        CELERY_BROKER_TRANSPORT_OPTIONS: ClassVar[dict[str, float]] = {"polling_interval": 0.1}
        CELERY_REDLOCK_URLS = ",".join(lock_nodes.urls)  # as an environment variable gives it
        CELERY_REDLOCK_TTL = 7
        CELERY_REDLOCK_ON_DUPLICATE = "raise"
        CELERY_REDLOCK_KEY_PREFIX = "django-locks:"
        CELERY_REDLOCK_NODE_TIMEOUT = 0.5
        REDLOCK_TTL = 99  # not in the namespace: ignored

    app = Celery("django_proj", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    settings = AppRuntime.for_app(app).settings
    assert settings.urls == tuple(lock_nodes.urls)
    assert (settings.ttl, settings.on_duplicate, settings.key_prefix) == (
        7,
        "raise",
        "django-locks:",
    )
    assert settings.node_timeout == 0.5

    @singleton_task(app=app, shared=False, bind=True, name="django.job")
    def job(self: SingletonTask, item: int) -> list[int]:
        with run_log.run(self.lock.key):
            observed = pttls_on(lock_nodes, self.lock.key)
            gate.wait(10)
        return observed

    with embedded_worker(app):
        first = job.delay(1)
        run_log.wait_started(1)
        with pytest.raises(LockNotAcquired):  # CELERY_REDLOCK_ON_DUPLICATE
            job.delay(1).get(timeout=10)
        gate.set()
        observed = first.get(timeout=10)

    assert run_log.runs()[0]["key"] == documented_key("django.job", {"item": 1}, "django-locks:")
    assert all(5_000 < pttl <= 7_000 for pttl in observed), observed
