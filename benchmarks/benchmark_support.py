"""What the benchmark scripts share: a clean exit on SIGTERM, the ``--variant LABEL=DIR``
argument, the nearest-rank percentile, the machine and server facts their reports name, and the
servers' settings (`PRODUCTION_SERVER`).

Not a benchmark itself: the scripts import it from their own directory (``python
benchmarks/bench_locks.py`` puts ``benchmarks/`` first on the path, and so does each worker
process they start).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import platform
import signal
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

# redis-server's own default, as lock nodes run in production (the test harness runs them at hz
# 100 so that they stop fast): their CPU per lock is measured as users would see it.
PRODUCTION_SERVER = ("--hz", "10")


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so the servers are stopped on the way out."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def variant_argument(text: str) -> tuple[str, str]:
    """``--variant LABEL=DIR`` as (label, absolute directory); an argparse ``type``."""
    label, separator, directory = text.partition("=")
    if not separator or not label or not directory:
        raise argparse.ArgumentTypeError(f"expected LABEL=DIR, got {text!r}")
    return label, os.path.abspath(directory)


def percentile(values: Iterable[float], fraction: float) -> float:
    """The nearest-rank percentile of ``values`` (at least one)."""
    ordered = sorted(values)
    return float(ordered[max(1, math.ceil(fraction * len(ordered))) - 1])


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo where there is one."""
    model = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return model


def server_version(executable: str) -> str:
    """``redis-server --version``'s (or valkey-server's) first words: ``Redis server
    v=7.0.15``; the executable's name and ``?`` when it does not say."""
    try:
        output = subprocess.run(
            [executable, "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        output = ""
    return output.split(" sha=")[0] or f"{Path(executable).name} ?"


def quiet_logging(verbose: bool) -> None:
    """Failures are counted in a benchmark's tables; the library's log lines would only drown
    them (``verbose``: show them)."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        return
    logging.getLogger().addHandler(logging.NullHandler())
    logging.getLogger().setLevel(logging.CRITICAL)
