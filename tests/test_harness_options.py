"""The process options of `celery_redlock.testing.ManagedProcess` reach the process through every
kind of managed process, and every ``with`` block of the harness ends with what closing its
resource means."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from topologies import TLSCertificates

from celery_redlock.testing import (
    CeleryBeat,
    CeleryProcess,
    CeleryWorker,
    ManagedProcess,
    RedisServer,
)

_APP_MODULE = """\
import os

from celery import Celery

app = Celery("options_app")
print("variable:", os.environ.get("HARNESS_OPTION_MARK"), flush=True)
print("directory:", os.getcwd(), flush=True)
"""


def test_a_celery_process_passes_every_process_option_to_the_process(tmp_path: Path) -> None:
    modules, directory = tmp_path / "modules", tmp_path / "run"
    modules.mkdir()
    directory.mkdir()
    (modules / "options_app.py").write_text(_APP_MODULE)
    log = tmp_path / "report.log"
    process = CeleryProcess(
        "options_app",
        ["report"],
        environment={"HARNESS_OPTION_MARK": "from-the-options"},
        inherit_environment=True,
        python_path=[modules],
        working_directory=directory,
        log_path=log,
        label="reporter",
    )
    assert process.label == "reporter"
    assert process.log_path == log
    assert process.start().wait(60) == 0
    output = process.log_text()
    assert "variable: from-the-options" in output
    assert f"directory: {directory}" in output


def test_the_celery_kinds_default_their_label_and_take_the_options_they_are_given(
    tmp_path: Path,
) -> None:
    worker = CeleryWorker("proj:app", "alpha@here", log_path=tmp_path / "w.log")
    beat = CeleryBeat("proj:app", tmp_path / "schedule", log_path=tmp_path / "b.log")
    other = CeleryProcess("proj:app", ["inspect", "ping"], log_path=tmp_path / "o.log")
    assert (worker.label, beat.label, other.label) == ("alpha@here", "beat", "inspect")
    assert worker.log_path == tmp_path / "w.log"
    named = CeleryWorker("proj:app", "alpha@here", label="first", log_path=tmp_path / "n.log")
    assert named.label == "first"


@pytest.mark.parametrize(
    ("kind", "arguments"),
    [
        (ManagedProcess, (["true"],)),
        (CeleryProcess, ("proj:app", ["worker"])),
        (CeleryWorker, ("proj:app", "alpha")),
        (CeleryBeat, ("proj:app", "schedule")),
    ],
)
def test_a_keyword_that_is_no_process_option_is_refused(
    kind: type[ManagedProcess], arguments: tuple[Any, ...]
) -> None:
    with pytest.raises(TypeError, match="log_file"):
        kind(*arguments, log_file="x.log")


def test_each_with_block_ends_with_what_closing_its_resource_means(tmp_path: Path) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with ManagedProcess(sleeper, log_path=tmp_path / "sleep.log") as process:
        assert process.is_running
    assert process.returncode == -signal.SIGKILL  # a process is killed

    with RedisServer() as server, server.client(socket_timeout=10) as client:
        assert client.ping()
    assert server.returncode == 0  # a server is stopped gracefully (SIGTERM)

    with TLSCertificates.create(tmp_path / "certificates") as certificates:
        assert certificates.ca_certificate.exists()
    assert not certificates.directory.exists()  # certificates are deleted
