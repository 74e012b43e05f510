"""What the nodes layer takes from redis-py, checked against the installed version: these tests
fail when redis-py stops handing over what `celery_redlock.lock.nodes.endpoint` relies on."""

from __future__ import annotations

import inspect
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


def test_redis_py_clients_of_a_node_read_with_redis_py_s_python_parser(one_node) -> None:
    """Where hiredis is installed (as in this suite), redis-py would read with it, and its
    hiredis parser (redis-py 8.1) refuses new TLS connections (tests/test_tls.py): the nodes
    layer asks for redis-py's Python parser (``redis._parsers._RESP2Parser``, a private name)."""
    from redis._parsers import _RESP2Parser

    with Endpoint.from_url(one_node.urls[0], 1.0).client() as client:
        assert client.connection_pool.connection_kwargs["parser_class"] is _RESP2Parser
        assert client.ping() is True


def test_redis_py_takes_no_tls_option_the_nodes_layer_does_not_know() -> None:
    """The nodes layer builds one TLS context per configuration (`nodes.tls.TLSContext.build`)
    the way redis-py builds one per connection, from the TLS options below; a new option of
    redis-py's ``SSLConnection`` must be taught to it (or the connection left to redis-py, as
    with OCSP)."""
    from redis.connection import SSLConnection

    known = {
        "ssl_keyfile",
        "ssl_certfile",
        "ssl_cert_reqs",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
        "ssl_ca_certs",
        "ssl_ca_data",
        "ssl_check_hostname",
        "ssl_ca_path",
        "ssl_password",
        "ssl_validate_ocsp",
        "ssl_validate_ocsp_stapled",
        "ssl_ocsp_context",
        "ssl_ocsp_expected_cert",
        "ssl_min_version",
        "ssl_ciphers",
    }
    taken = set(inspect.signature(SSLConnection.__init__).parameters) - {"self", "kwargs"}
    assert taken <= known, f"redis-py's SSLConnection takes {sorted(taken - known)} now"
