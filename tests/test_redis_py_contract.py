"""What the nodes layer takes from redis-py, checked against the installed version: these tests
fail when redis-py stops handing over what `celery_redlock.lock.nodes.endpoint` relies on."""

from __future__ import annotations

import socket

from celery_redlock.lock.nodes.endpoint import Endpoint


def test_redis_py_hands_over_its_connected_socket(one_node) -> None:
    """`Endpoint.open_socket` lets redis-py connect and authenticate, then takes the
    connection's socket (``_sock``, a private attribute): it must be a connected socket."""
    sock = Endpoint.from_url(one_node.urls[0], 1.0).open_socket()
    try:
        assert isinstance(sock, socket.socket)
        sock.settimeout(1.0)
        sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        assert sock.recv(64) == b"+PONG\r\n"
    finally:
        sock.close()
