"""Secrets stay secret: passwords are redacted wherever a URL is shown, and `redlock_password`
is a home for them that Celery itself masks in ``celery inspect conf`` and ``celery report``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from celery_apps.support import embedded_worker, make_app
from conftest import MakeRedisNodes

from celery_redlock import RedlockSettings, singleton_task
from celery_redlock.integration.runtime import AppRuntime
from celery_redlock.settings import redact_url
from celery_redlock.testing import RedisServer

pytest_plugins = ["celery_apps.fixtures"]

SECRET = "s3cret-word"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:s3cret-word@h:6379/0", "redis://user:***@h:6379/0"),
        ("redis://:s3cret-word@h:6379", "redis://:***@h:6379"),
        ("redis://h:6379/0?password=s3cret-word&db=2", "redis://h:6379/0?password=***&db=2"),
        ("rediss://h:6380/0?ssl_password=s3cret-word", "rediss://h:6380/0?ssl_password=***"),
        ("unix:///run/redis.sock?password=s3cret-word", "unix:///run/redis.sock?password=***"),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_passwords_are_redacted_from_every_part_of_a_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    settings = RedlockSettings(urls=(url,), password=SECRET)
    assert SECRET not in repr(settings)


def test_a_password_in_a_url_is_redacted_and_pointed_at_its_home(
    redis_nodes: MakeRedisNodes, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_nodes(1, password=SECRET)[0]
    url = f"redis://127.0.0.1:{server.port}/0?password={SECRET}"
    runtime = AppRuntime(RedlockSettings(urls=(url,)))
    with caplog.at_level(logging.WARNING, logger="celery_redlock"):
        runtime.check_nodes()
    assert SECRET not in caplog.text
    assert "redlock_password" in caplog.text  # where the password belongs instead
    assert "does not answer" not in caplog.text  # the URL's password was used


def test_redlock_password_logs_in_and_is_masked_by_celery(
    broker: RedisServer, redis_nodes: MakeRedisNodes
) -> None:
    nodes = redis_nodes(3, password=SECRET)
    urls = [f"redis://127.0.0.1:{server.port}/0" for server in nodes]  # no credentials
    app = make_app(broker, urls, redlock_password=SECRET)

    @singleton_task(app=app, shared=False, bind=True, name="secrets.job")
    def job(self: object) -> str:
        return "ran"

    with embedded_worker(app, pool="solo", concurrency=1):
        assert job.delay().get(timeout=10) == "ran"  # the nodes accepted redlock_password
        replies = app.control.inspect(timeout=3).conf(with_defaults=False)
    assert replies, "the worker answered `inspect conf`"
    shown = json.dumps(replies)
    assert SECRET not in shown
    (conf,) = replies.values()
    assert conf["redlock_password"] != SECRET and set(conf["redlock_password"]) == {"*"}


def test_celery_report_masks_redlock_password(broker: RedisServer) -> None:
    environment = {
        **os.environ,
        "CRL_BROKER_URL": broker.url,
        "CRL_SETTINGS": json.dumps({"redlock_password": SECRET}),
    }
    report = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "celery_apps.config_app", "report"],
        cwd=os.path.dirname(__file__),
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "redlock_password" in report.stdout
    assert SECRET not in report.stdout + report.stderr
