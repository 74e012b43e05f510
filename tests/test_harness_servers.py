"""Kinds of single server the harness runs: TLS with its own certificates, Valkey, ACL users,
replicas."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redlock_support import wait_until
from topologies import (
    VALKEY_SERVER_ENVIRONMENT_VARIABLE,
    TLSCertificates,
    TopologyServer,
    ValkeyServer,
    find_valkey_server,
)
from topologies.servers import role

from celery_redlock.testing import RedisNodes, RedisServer


@pytest.fixture(scope="module")
def certificates() -> Iterator[TLSCertificates]:
    with TLSCertificates.create() as made:
        yield made


@pytest.fixture(scope="module")
def tls_server(certificates: TLSCertificates) -> Iterator[RedisServer]:
    """A TLS-only server that requires client certificates (the server's default)."""
    with TopologyServer(tls=certificates) as server:
        yield server


def test_certificates_pass_a_strict_handshake_with_their_authority_only(
    tls_server: RedisServer, certificates: TLSCertificates
) -> None:
    def ping(authority: Path) -> bytes:
        context = ssl.create_default_context(cafile=str(authority))
        context.verify_flags |= getattr(ssl, "VERIFY_X509_STRICT", 0)  # as Python 3.13 does
        context.load_cert_chain(certificates.client_certificate, certificates.client_key)
        with (
            socket.create_connection(("127.0.0.1", tls_server.port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as connection,
        ):
            connection.sendall(b"PING\r\n")
            return connection.recv(64)

    assert ping(certificates.ca_certificate) == b"+PONG\r\n"
    with pytest.raises(ssl.SSLCertVerificationError):
        ping(certificates.unrelated_ca_certificate)


def test_tls_server_serves_its_rediss_url_and_nothing_in_plain_text(
    tls_server: RedisServer, certificates: TLSCertificates
) -> None:
    url = tls_server.url
    assert url.startswith(f"rediss://127.0.0.1:{tls_server.port}/0?ssl_ca_certs=")
    assert "ssl_certfile=" in url and "ssl_keyfile=" in url
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        assert client.ping() is True
        assert client.config_get("port") == {"port": "0"}  # no plain-text port at all
    with tls_server.client() as client:  # the harness's own client speaks TLS too
        assert client.info("server")["process_id"] == tls_server.pid
    plain = tls_server.client(ssl=False, socket_timeout=2)  # no retries
    with plain, pytest.raises(redis.ConnectionError):
        plain.ping()


def test_tls_server_refuses_a_client_that_trusts_another_authority(
    tls_server: RedisServer, certificates: TLSCertificates
) -> None:
    url = tls_server.tls_url(ca_certificate=certificates.unrelated_ca_certificate)
    with (
        redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2) as client,
        pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        client.ping()


def test_tls_server_requires_a_client_certificate_unless_told_otherwise(
    tls_server: RedisServer, certificates: TLSCertificates
) -> None:
    without_certificate = tls_server.tls_url(client=False)
    assert "ssl_certfile" not in without_certificate
    with (
        redis.Redis.from_url(without_certificate, socket_timeout=2) as client,
        pytest.raises(redis.ConnectionError),
    ):
        client.ping()
    relaxed = TopologyServer(tls=certificates, tls_auth_clients=False)
    with relaxed, redis.Redis.from_url(relaxed.tls_url(client=False), socket_timeout=5) as client:
        assert client.ping() is True


def test_a_plain_server_has_no_tls_url() -> None:
    server = TopologyServer(port=6390)
    with pytest.raises(RuntimeError, match="serves no TLS"):
        server.tls_url()


def test_valkey_server_reports_its_valkey_version() -> None:
    with ValkeyServer() as server, server.client(decode_responses=True) as client:
        information = client.info("server")
        assert information.get("valkey_version")
        assert information["process_id"] == server.pid
        assert information["executable"] == find_valkey_server()


def test_valkey_nodes_through_the_executable_option() -> None:
    with RedisNodes(3, executable=find_valkey_server()) as nodes:
        for server in nodes:
            with server.client(decode_responses=True) as client:
                assert client.info("server").get("valkey_version")


def test_valkey_binary_chosen_by_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bundled = find_valkey_server()
    monkeypatch.setenv(VALKEY_SERVER_ENVIRONMENT_VARIABLE, bundled)
    assert find_valkey_server() == bundled
    monkeypatch.setenv(VALKEY_SERVER_ENVIRONMENT_VARIABLE, str(tmp_path / "no-valkey-here"))
    with pytest.raises(RuntimeError, match=VALKEY_SERVER_ENVIRONMENT_VARIABLE):
        find_valkey_server()


LEAST_PRIVILEGE = "ACL SETUSER locks on >s3cret resetkeys ~redlock:* +acl|whoami +get +set"


def test_acl_lines_create_users_at_every_start() -> None:
    with RedisServer(acl_lines=[LEAST_PRIVILEGE]) as server:
        for _ in range(2):  # the first start, then a restart (a new, empty server)
            with redis.Redis.from_url(server.user_url("locks", "s3cret")) as client:
                assert client.execute_command("ACL", "WHOAMI") in ("locks", b"locks")
                assert client.set("redlock:{a}", "1") is True
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.set("other", "1")
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.keys("*")
            server.restart()


def test_apply_acl_runs_one_line_on_a_running_server() -> None:
    with RedisServer(password="admin") as server:
        server.apply_acl("acl setuser 'reader' on '>a b' ~* +get")
        with redis.Redis.from_url(server.user_url("reader", "a b")) as client:
            assert client.get("missing") is None
        assert "reader" in server.user_url("reader", "a b")
        with pytest.raises(ValueError, match="ACL SETUSER"):
            server.apply_acl("CONFIG SET maxmemory 1")
        with pytest.raises(redis.ResponseError):
            server.apply_acl("ACL SETUSER broken +no-such-command")


def test_a_replica_follows_its_master() -> None:
    with RedisServer(password="pw") as master, TopologyServer(replica_of=master) as replica:
        assert role(replica) == "slave"
        with master.client() as client:
            client.set("replicated", "yes")
        with replica.client() as client:
            assert wait_until(lambda: client.get("replicated") == b"yes", timeout=10)
