"""The app ``celery -A celery_apps.config_app worker`` loads in tests/test_guarantees_prefork.py:
the settings in ``CRL_SETTINGS`` and the task options in ``CRL_TASK_OPTIONS`` (both JSON) are
applied on top of `celery_apps.subprocesses.subprocess_app`'s, so a test can start a worker with
a bad configuration and see it refuse to start."""

from __future__ import annotations

import json
import os

from celery_apps.subprocesses import subprocess_app
from celery_redlock import SingletonTask

app = subprocess_app("config_app")
app.conf.update(json.loads(os.environ.get("CRL_SETTINGS", "{}")))


@app.task(base=SingletonTask, **json.loads(os.environ.get("CRL_TASK_OPTIONS", "{}")))
def job() -> str:
    """Never run: the tests only start and stop workers."""
    return "ran"
