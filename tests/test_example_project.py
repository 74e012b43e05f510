"""Smoke test of the demo: `python -m example_project` end to end, briefly, on its own servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(90)
def test_demo_runs_without_overlaps_and_draws_the_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    output = tmp_path / "timeline.png"
    env = {
        name: value
        for name, value in os.environ.items()
        # no configured servers: the demo must start its own Redis nodes and broker
        if not name.startswith(("DEMO_", "CELERY_BROKER", "CELERY_RESULT"))
    }
    command = [sys.executable, "-m", "example_project", "--duration", "6", "--no-beat"]
    result = subprocess.run(
        [*command, "--output", str(output)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "overlapping runs (two runs of one key at the same time): 0" in result.stdout
    total = [line.split() for line in result.stdout.splitlines() if line.startswith("total ")]
    submitted, ran, skipped = (int(field) for field in total[-1][1:4])
    assert submitted > ran > 0 and skipped > 0  # duplicates were submitted, and suppressed
    assert output.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
