"""Smoke test of the demo: `python -m example_project` end to end, briefly, on its own servers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

COALESCING_LINE = re.compile(
    r"^coalescing: (?P<key>.+?)\s+(?P<bursts>\d+) bursts, (?P<triggers>\d+) triggers -> "
    r"(?P<runs>\d+) runs \(per burst: (?P<per_burst>[\d ]+)\)$"
)


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
    lines = result.stdout.splitlines()
    assert "overlapping runs (two runs of one key at the same time): 0" in lines
    fencing = [line for line in lines if line.startswith("fencing:")]
    assert fencing and "reports written" in fencing[0], result.stdout[-3000:]
    assert any(line.endswith("refused: StaleFence") for line in lines)
    total = [line.split() for line in lines if line.startswith("total ")]
    submitted, ran, skipped, _retried, _waited, coalesced = (int(field) for field in total[-1][1:7])
    assert submitted > ran > 0 and skipped > 0  # duplicates were submitted, and suppressed
    assert coalesced > 0  # duplicates arriving during a run merged into its pending run

    coalescing = [match for line in lines if (match := COALESCING_LINE.match(line))]
    assert {match["key"] for match in coalescing} == {
        "search index shop-eu",
        "search index shop-us",
    }, result.stdout[-3000:]
    for match in coalescing:
        bursts, runs = int(match["bursts"]), int(match["runs"])
        per_burst = [int(count) for count in match["per_burst"].split()]
        assert len(per_burst) == bursts and sum(per_burst) == runs
        # Each burst: the run its first trigger started, at most one follow-up for the rest.
        assert all(count <= 2 for count in per_burst), match.group(0)
        assert runs <= 2 * bursts < int(match["triggers"])
    assert output.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
