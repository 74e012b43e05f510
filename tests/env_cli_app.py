"""The app ``celery -A tests.env_cli_app redlock ...`` loads (tests/test_acl.py, tests/test_tls.py):
its lock nodes and, when given, the ACL user it logs in as come from the environment, the
credentials through ``redlock_username`` and ``redlock_password`` (settings Celery masks), never
inside a URL. The broker is ``memory://``: the command never talks to it. `run_redlock_command`
runs the command on it in a subprocess, as an operator would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from celery import Celery

URLS_VARIABLE = "ENV_APP_REDLOCK_URLS"
USERNAME_VARIABLE = "ENV_APP_REDLOCK_USERNAME"
PASSWORD_VARIABLE = "ENV_APP_REDLOCK_PASSWORD"
REPOSITORY = Path(__file__).resolve().parent.parent

app = Celery("env_cli_app", broker="memory://", backend="cache+memory://", set_as_current=False)
app.conf.redlock_urls = os.environ.get(URLS_VARIABLE, "redis://127.0.0.1:6379/0").split(",")
app.conf.redlock_username = os.environ.get(USERNAME_VARIABLE)
app.conf.redlock_password = os.environ.get(PASSWORD_VARIABLE)


def run_redlock_command(
    urls: list[str],
    *arguments: str,
    username: str | None = None,
    password: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.env_cli_app redlock ARGUMENTS`` in a subprocess, on lock nodes ``urls``
    (no commas in them), logging in as ``username`` with ``password`` when given."""
    environment = dict(os.environ, PYTHONPATH=str(REPOSITORY))
    environment[URLS_VARIABLE] = ",".join(urls)
    for variable, value in ((USERNAME_VARIABLE, username), (PASSWORD_VARIABLE, password)):
        environment.pop(variable, None)
        if value is not None:
            environment[variable] = value
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.env_cli_app", "redlock", *arguments],
        cwd=REPOSITORY,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
