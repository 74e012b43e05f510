"""Where the harness's servers listen: 127.0.0.1, on ports that were free a moment ago."""

from __future__ import annotations

import socket

HOST = "127.0.0.1"
"""The address every server of the harness listens on."""


def free_port() -> int:
    """Return a TCP port of :data:`HOST` that was free a moment ago (another process may take it
    before the caller binds it: callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
    return port
