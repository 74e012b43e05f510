"""Running ``celery redlock`` in tests: as an operator runs it (a ``celery`` subprocess loading
`tests.cli_app`) or in-process with click's `CliRunner` and the app Celery's ``-A`` would load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from celery.bin.base import CLIContext
from cli_app import URLS_VARIABLE
from click.testing import CliRunner, Result

from celery_redlock.cli import redlock

REPOSITORY = Path(__file__).resolve().parent.parent
FAST = ("--timeout", "0.3")


def run_celery(urls: list[str], *arguments: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.cli_app redlock ARGUMENTS`` in a subprocess, as an operator runs it."""
    environment = dict(os.environ, PYTHONPATH=str(REPOSITORY))
    environment[URLS_VARIABLE] = ",".join(urls)
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.cli_app", "redlock", *arguments],
        cwd=REPOSITORY,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )


def invoke(app: Any, *arguments: str, input: str | None = None) -> Result:
    """The command in-process, with the app Celery's ``-A`` would have loaded."""
    context = CLIContext(app=app, no_color=True, workdir=None)
    return CliRunner().invoke(redlock, list(arguments), obj=context, input=input)


def as_json(result: Result) -> Any:
    """The JSON a ``--json`` run printed on stdout."""
    return json.loads(result.stdout)
