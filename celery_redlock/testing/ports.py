"""Where the harness's servers listen: 127.0.0.1, on ports that were free a moment ago."""

from __future__ import annotations

import contextlib
import socket

__all__ = ["HOST", "free_port"]

HOST = "127.0.0.1"
"""The address every server of the harness listens on."""

_HIGHEST_PORT = 65535
_ATTEMPTS = 50


def free_port(*, also_free_at_offset: int | None = None) -> int:
    """Return a TCP port of :data:`HOST` that was free a moment ago (another process may take it
    before the caller binds it: callers retry).

    With ``also_free_at_offset``, the port that many above was free too (a Redis Cluster node
    listens on its port plus 10000 for the cluster bus).

    Raises:
        RuntimeError: no such pair of ports was found in a few dozen tries.
    """
    for _ in range(_ATTEMPTS):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((HOST, 0))
            port: int = probe.getsockname()[1]
            if also_free_at_offset is None:
                return port
            other = port + also_free_at_offset
            if other > _HIGHEST_PORT:
                continue
            with (
                contextlib.suppress(OSError),
                socket.socket(socket.AF_INET, socket.SOCK_STREAM) as second,
            ):
                second.bind((HOST, other))
                return port
    raise RuntimeError(f"found no free port of {HOST} with port+{also_free_at_offset} free too")
