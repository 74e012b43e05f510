"""Configuration errors, URL forms (unix socket, ACL user, password, TLS) and exception pickling."""

from __future__ import annotations

import logging
import pickle
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from redlock_support import value_on

from celery_redlock import (
    DuplicateSkipped,
    LockLost,
    LockNotAcquired,
    QuorumUnavailable,
    Redlock,
    RedlockError,
    RedlockSettings,
)
from celery_redlock.errors import ConfigurationError
from celery_redlock.testing import RedisServer

# --- every bad input ---------------------------------------------------------------------------

BAD_CONSTRUCTOR_ARGUMENTS = [
    pytest.param({"urls": []}, r"redlock_urls is empty; list the", id="no-urls"),
    pytest.param({"urls": ["http://x"]}, r"not a Redis URL .*; use redis://", id="http-url"),
    pytest.param({"urls": [""]}, r"not a Redis URL .*; use redis://", id="empty-url"),
    pytest.param({"urls": [None]}, r"is not a URL; use redis://", id="none-url"),
    pytest.param(
        {"urls": ["redis://host:notaport"]},
        r"has an invalid port; use redis://host:6379/0",
        id="bad-port",
    ),
    pytest.param(
        {"urls": ["redis://alice:secret@127.0.0.1:notaport/0"]},
        r"has an invalid port; use redis://host:6379/0",
        id="bad-port-with-password",
    ),
    pytest.param({"retry_count": 0}, r"retry_count\) must be a whole number of at", id="rc0"),
    pytest.param({"retry_count": -2}, r"retry_count\) must be a whole number of at", id="rc-"),
    pytest.param({"retry_count": 1.5}, r"retry_count\) must be a whole number", id="rc-float"),
    pytest.param({"retry_count": "3"}, r"retry_count\) must be a whole number", id="rc-str"),
    pytest.param({"retry_count": True}, r"retry_count\) must be a whole number", id="rc-bool"),
    pytest.param({"retry_delay": -0.1}, r"retry_delay must be .*, 0 or more", id="rd-"),
    pytest.param({"retry_delay": float("nan")}, r"retry_delay must be a number", id="rd-nan"),
    pytest.param({"retry_delay": "0.2"}, r"retry_delay must be a number of seconds", id="rd-str"),
    pytest.param({"clock_drift_factor": 0.5}, r"from 0 to 0.5 \(0.01 is usual\)", id="cd-half"),
    pytest.param({"clock_drift_factor": 2}, r"drift_factor must be a fraction", id="cd-2"),
    pytest.param({"clock_drift_factor": -0.1}, r"clock_drift_factor must be a fraction", id="cd-"),
    pytest.param({"node_timeout": 0}, r"node_timeout must be a positive", id="nt0"),
    pytest.param({"node_timeout": -1}, r"node_timeout must be a positive", id="nt-"),
    pytest.param({"node_timeout": None}, r"node_timeout must be a positive number", id="nt-none"),
    pytest.param(
        {"key_prefix": 5}, r"key_prefix must be a non-empty string such as 'redlock:'", id="prefix"
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_CONSTRUCTOR_ARGUMENTS)
def test_bad_constructor_arguments_raise_configuration_error(overrides, message):
    arguments = {"urls": ["redis://127.0.0.1:1/0"], **overrides}
    with pytest.raises(ConfigurationError, match=message) as info:
        Redlock(**arguments)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, RedlockError)
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param({"ttl": 0}, r"ttl must be a positive number of seconds", id="ttl0"),
        pytest.param({"ttl": -5}, r"ttl must be a positive number of seconds", id="ttl-"),
        pytest.param({"ttl": 0.04}, r"leaves no validity .*use a ttl of at least", id="ttl-tiny"),
        pytest.param({"resource": ""}, r"resource must be a non-empty string", id="resource"),
        pytest.param({"resource": 7}, r"resource must be a non-empty string", id="resource-int"),
    ],
)
def test_bad_acquire_arguments_raise_configuration_error(call, message):
    # Validation happens before any network traffic: the node URL is never contacted.
    dlm = Redlock(["redis://127.0.0.1:1/0"], node_timeout=0.05)
    arguments = {"resource": "r", "ttl": 5.0, **call}
    with pytest.raises(ConfigurationError, match=message):
        dlm.acquire(**arguments)


# --- URL forms ---------------------------------------------------------------------------------


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory (unix socket paths are limited to ~100 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="rl-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_unix_socket_url(short_tmp):
    path = short_tmp / "r.sock"
    with RedisServer(extra_args=["--unixsocket", str(path), "--unixsocketperm", "700"]) as server:
        dlm = Redlock([f"unix://{path}"])
        lock = dlm.acquire("unix", ttl=5.0)
        assert lock is not None
        assert value_on(server, lock.key) == lock.value  # seen over TCP: the same server
        assert dlm.release(lock) is True
        assert value_on(server, lock.key) is None


def test_acl_user_and_password_url(caplog):
    caplog.set_level(logging.DEBUG, logger="celery_redlock")
    acl = ["--user", "alice", "on", ">s3cret-pw", "~*", "&*", "+@all"]
    with RedisServer(extra_args=acl) as server:
        good = Redlock([f"redis://alice:s3cret-pw@127.0.0.1:{server.port}/0"], retry_count=1)
        assert [node.name for node in good.nodes] == [
            f"redis://alice:***@127.0.0.1:{server.port}/0"
        ]
        lock = good.acquire("acl", ttl=5.0)
        assert lock is not None
        assert value_on(server, lock.key) == lock.value
        assert good.release(lock) is True
        assert value_on(server, lock.key) is None

        bad = Redlock([f"redis://alice:wrong-pw@127.0.0.1:{server.port}/0"], retry_count=1)
        with pytest.raises(QuorumUnavailable) as info:
            bad.acquire("acl", ttl=5.0)
        assert info.value.answered == 0
    assert "is unavailable" in caplog.text  # the failure is logged...
    for secret in ("s3cret-pw", "wrong-pw"):  # ...without any password
        assert secret not in caplog.text
        assert secret not in str(info.value)
        assert secret not in repr([node.name for node in bad.nodes])


def test_acl_user_without_channel_permission_still_releases():
    """Redis 7 gives new ACL users no pub/sub channels (acl-pubsub-default resetchannels), so
    `user alice on >pw ~* +@all` cannot PUBLISH. The release notification is an extra: the
    release itself must still be done and reported."""
    acl = ["--user", "alice", "on", ">pw", "~*", "+@all"]
    with RedisServer(extra_args=acl) as server:
        dlm = Redlock([f"redis://alice:pw@127.0.0.1:{server.port}/0"], retry_count=1)
        lock = dlm.acquire("acl-channels", ttl=5.0)
        assert lock is not None
        released = dlm.release(lock)
        assert value_on(server, lock.key) is None
        assert released is True


def test_requirepass_url_and_wrong_password(caplog):
    caplog.set_level(logging.DEBUG, logger="celery_redlock")
    with RedisServer(password="right-secret") as server:
        dlm = Redlock([server.url], retry_count=1)
        assert "right-secret" not in repr([node.name for node in dlm.nodes])
        lock = dlm.acquire("pw", ttl=5.0)
        assert lock is not None
        assert dlm.release(lock) is True
        wrong = Redlock([f"redis://:wrong-secret@127.0.0.1:{server.port}/0"], retry_count=1)
        assert [node.name for node in wrong.nodes] == [f"redis://:***@127.0.0.1:{server.port}/0"]
        with pytest.raises(QuorumUnavailable):
            wrong.acquire("pw", ttl=5.0)
    assert "is unavailable" in caplog.text
    assert "right-secret" not in caplog.text
    assert "wrong-secret" not in caplog.text


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    ca_key, ca_cert = directory / "ca.key", directory / "ca.crt"
    key, request, cert = (
        directory / "server.key",
        directory / "server.csr",
        directory / "server.crt",
    )
    extensions = directory / "san.cnf"
    extensions.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"]
    commands = [
        [
            "openssl",
            "req",
            "-x509",
            *ec,
            "-keyout",
            ca_key,
            "-out",
            ca_cert,
            "-subj",
            "/CN=test-ca",
        ],
        ["openssl", "req", *ec, "-keyout", key, "-out", request, "-subj", "/CN=127.0.0.1"],
        [
            *("openssl", "x509", "-req", "-in", request, "-CA", ca_cert, "-CAkey", ca_key),
            *("-CAcreateserial", "-out", cert, "-days", "1", "-extfile", extensions),
        ],
    ]
    for command in commands:
        subprocess.run([str(part) for part in command], check=True, capture_output=True)
    return ca_cert, cert, key


def test_tls_url(short_tmp):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    ca_cert, cert, key = _make_certificates(short_tmp)
    tls_port = _free_port()
    server = RedisServer(
        extra_args=[
            "--tls-port", str(tls_port),
            "--tls-cert-file", str(cert),
            "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(ca_cert),
            "--tls-auth-clients", "no",
        ]
    )  # fmt: skip
    try:
        server.start()
    except RuntimeError as error:
        if "tls" in str(error).lower() and (
            "not supported" in str(error).lower() or "bad directive" in str(error).lower()
        ):
            pytest.skip(f"this redis-server was built without TLS support: {error}")
        raise
    with server:
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={ca_cert}&ssl_cert_reqs=required"
        dlm = Redlock([url], node_timeout=0.5)
        lock = dlm.acquire("tls", ttl=5.0)
        assert lock is not None
        assert value_on(server, lock.key) == lock.value
        assert dlm.extend(lock, ttl=6.0) is True
        assert dlm.release(lock) is True
        assert value_on(server, lock.key) is None
        # The certificate is checked: without the CA the node is unavailable.
        untrusted = Redlock(
            [f"rediss://127.0.0.1:{tls_port}/0?ssl_cert_reqs=required"],
            node_timeout=0.5,
            retry_count=1,
        )
        with pytest.raises(QuorumUnavailable):
            untrusted.acquire("tls", ttl=5.0)


# --- exceptions survive pickling ---------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        LockNotAcquired("redlock:k", "worker-1"),
        LockNotAcquired("redlock:k"),
        DuplicateSkipped("redlock:k", "worker-2"),
        QuorumUnavailable("redlock:k", 1, 2),
        LockLost("redlock:k", "expired"),
        LockLost("redlock:k"),
        ConfigurationError("ttl must be a number"),
        RedlockError("base"),
    ],
    ids=repr,
)
def test_exceptions_are_picklable(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert copy.args == error.args
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)


def test_reprs_show_neither_passwords_nor_tokens(one_node):
    settings = RedlockSettings(urls=("redis://alice:s3cret-pw@127.0.0.1:1/0",))
    assert "s3cret-pw" not in repr(settings) and "alice:***@" in repr(settings)
    with pytest.raises(ConfigurationError) as raised:
        RedlockSettings(urls={"redis://alice:s3cret-pw@127.0.0.1:1/0"})  # type: ignore[arg-type]
    assert "s3cret-pw" not in str(raised.value)
    lock = Redlock(one_node.urls).acquire("repr", ttl=5.0)
    assert lock is not None and lock.token not in repr(lock)
