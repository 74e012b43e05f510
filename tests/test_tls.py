"""Lock nodes over TLS with verification (``rediss://``), on TLS-only ``redis-server`` processes
and certificates the harness makes (`TLSCertificates`): an authority, a server certificate for
127.0.0.1, a client certificate, and an unrelated authority.

- server verification: ``?ssl_ca_certs=<the authority>&ssl_cert_reqs=required``;
- client certificates (``ssl_certfile``, ``ssl_keyfile``) for servers that require one;
- a wrong authority, a missing client certificate and a hung server: an error that says what is
  wrong, within about ``node_timeout``, never a hang;
- a Celery worker whose singleton tasks lock (and wait for release notifications) over TLS;
- ``admin.node_status`` and ``celery redlock status`` over TLS;
- one TLS context per configuration and process: three members' connections, made by 16 threads
  at once, share one; a forked child makes its own;
- a first call connects to every member at once (what that saves is measured by
  benchmarks/bench_tls_first_call.py: wall time is too noisy on a busy machine to assert).
"""

from __future__ import annotations

import gc
import json
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from celery_apps.support import LockSignals, embedded_worker, make_app
from cli_app import create_app
from cli_support import FAST, invoke
from env_cli_app import run_redlock_command
from redlock_support import (
    exit_code_of_forked_child,
    first_calls,
    slow_reactor_disposals,
    wait_until,
)
from topologies import TLSCertificates, TopologyServer

from celery_redlock import QuorumUnavailable, Redlock, admin, singleton_task
from celery_redlock.lock.outcomes import Unavailable
from celery_redlock.testing import RedisServer

NODE_TIMEOUT = 0.5
# An error must come within about node_timeout: generous for a busy machine, far below a hang.
PROMPT = 2.0
VERIFY_FAILED = "certificate verify failed"


@pytest.fixture(scope="module")
def certificates() -> Iterator[TLSCertificates]:
    """The module's authority, server and client certificates, and an unrelated authority."""
    with TLSCertificates.create() as made:
        yield made


def start_tls_servers(certificates: TLSCertificates, client_certificates: bool) -> list[Any]:
    """Three started TLS-only servers; with ``client_certificates`` they require one."""
    servers = []
    try:
        for _ in range(3):
            servers.append(
                TopologyServer(tls=certificates, tls_auth_clients=client_certificates).start()
            )
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


@pytest.fixture(scope="module")
def verifying_servers(certificates: TLSCertificates) -> Iterator[list[RedisServer]]:
    """Three TLS servers that ask clients for no certificate: the client verifies the server."""
    servers = start_tls_servers(certificates, client_certificates=False)
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def mutual_servers(certificates: TLSCertificates) -> Iterator[list[RedisServer]]:
    """Three TLS servers that require a client certificate signed by the authority."""
    servers = start_tls_servers(certificates, client_certificates=True)
    yield servers
    for server in servers:
        server.stop()


def tls_url(
    server: RedisServer,
    authority: Path,
    certificates: TLSCertificates | None = None,
) -> str:
    """The ``rediss://`` URL a user writes: verify the server against ``authority`` (required)
    and, with ``certificates``, present their client certificate."""
    url = (
        f"rediss://127.0.0.1:{server.port}/0"
        f"?ssl_ca_certs={quote(str(authority))}&ssl_cert_reqs=required"
    )
    if certificates is not None:
        url += f"&ssl_certfile={quote(str(certificates.client_certificate))}"
        url += f"&ssl_keyfile={quote(str(certificates.client_key))}"
    return url


def values_on(servers: list[RedisServer], key: str) -> list[str | None]:
    """``key``'s value on each server (the harness's clients speak TLS with its certificates)."""
    values = []
    for server in servers:
        with server.client(decode_responses=True, socket_timeout=5) as client:
            values.append(client.get(key))
    return values


def round_trip(redlock: Redlock, servers: list[RedisServer], resource: str) -> None:
    """Acquire, check the lock on every server, extend, release: the whole lock path."""
    lock = redlock.acquire(resource, 10, owner="tls test")
    assert lock is not None
    assert wait_until(lambda: values_on(servers, lock.key) == [lock.value] * 3)
    holder = redlock.holder_of(resource)
    assert holder is not None and holder.holder == "tls test"
    assert redlock.extend(lock)
    assert redlock.release(lock)
    assert wait_until(lambda: values_on(servers, lock.key) == [None] * 3)


def failing_acquisition(urls: list[str]) -> tuple[QuorumUnavailable, float]:
    """The error of an acquisition on ``urls`` that must fail, and how long it took."""
    redlock = Redlock(urls, node_timeout=NODE_TIMEOUT)
    started = time.monotonic()
    try:
        with pytest.raises(QuorumUnavailable) as raised:
            redlock.acquire("tls:refused", 10)
        return raised.value, time.monotonic() - started
    finally:
        redlock.close()


# -- verification -------------------------------------------------------------------------------


def test_the_server_is_verified_against_the_authority(
    verifying_servers: list[RedisServer], certificates: TLSCertificates
) -> None:
    urls = [tls_url(server, certificates.ca_certificate) for server in verifying_servers]
    redlock = Redlock(urls, node_timeout=NODE_TIMEOUT)
    try:
        round_trip(redlock, verifying_servers, "tls:verified")
    finally:
        redlock.close()


def test_client_certificates_log_in_where_the_server_requires_one(
    mutual_servers: list[RedisServer], certificates: TLSCertificates
) -> None:
    urls = [tls_url(server, certificates.ca_certificate, certificates) for server in mutual_servers]
    redlock = Redlock(urls, node_timeout=NODE_TIMEOUT)
    try:
        round_trip(redlock, mutual_servers, "tls:mutual")
    finally:
        redlock.close()


def test_without_a_client_certificate_the_server_refuses_promptly(
    mutual_servers: list[RedisServer], certificates: TLSCertificates
) -> None:
    urls = [tls_url(server, certificates.ca_certificate) for server in mutual_servers]

    error, seconds = failing_acquisition(urls)

    assert error.answered == 0 and error.needed == 2
    assert len(error.reasons) == 3
    assert seconds < PROMPT, seconds


def test_a_wrong_authority_fails_promptly_with_a_verification_error(
    verifying_servers: list[RedisServer], certificates: TLSCertificates
) -> None:
    wrong = certificates.unrelated_ca_certificate
    urls = [tls_url(server, wrong) for server in verifying_servers]

    error, seconds = failing_acquisition(urls)

    assert seconds < PROMPT, seconds  # with node_timeout 0.5 s; measured 0.1-0.8 s
    assert error.answered == 0
    assert len(error.reasons) == 3
    assert all(VERIFY_FAILED in reason for reason in error.reasons), error.reasons
    assert VERIFY_FAILED in str(error)

    # One attempt (no retries) fails as fast, and says the same.
    redlock = Redlock(urls, node_timeout=NODE_TIMEOUT)
    try:
        started = time.monotonic()
        outcome = redlock.attempt("tls:refused-once", 10, rounds=1)
        assert time.monotonic() - started < PROMPT
    finally:
        redlock.close()
    assert isinstance(outcome, Unavailable)
    assert VERIFY_FAILED in str(outcome.error)


def test_a_hung_tls_server_costs_one_node_timeout(
    mutual_servers: list[RedisServer], certificates: TLSCertificates
) -> None:
    """A server that accepts the connection but never finishes the TLS handshake (SIGSTOP:
    the kernel still accepts) is given up after node_timeout; the others decide."""
    urls = [tls_url(server, certificates.ca_certificate, certificates) for server in mutual_servers]
    hung = mutual_servers[0]
    hung.pause()
    redlock = Redlock(urls, node_timeout=NODE_TIMEOUT)
    try:
        started = time.monotonic()
        lock = redlock.acquire("tls:hung", 10)
        seconds = time.monotonic() - started
        assert lock is not None
        assert seconds < PROMPT, seconds
        redlock.release(lock)
    finally:
        hung.resume()
        redlock.close()


# -- Celery and the operators' commands ---------------------------------------------------------


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    """The broker and result back-end (plain TCP: only the lock nodes speak TLS here)."""
    with RedisServer() as server:
        yield server


def test_a_worker_runs_singleton_tasks_on_tls_lock_nodes(
    mutual_servers: list[RedisServer], certificates: TLSCertificates, broker: RedisServer
) -> None:
    urls = [tls_url(server, certificates.ca_certificate, certificates) for server in mutual_servers]
    app = make_app(broker, urls)
    gate, started = threading.Event(), {}

    @singleton_task(
        app=app,
        shared=False,
        bind=True,
        name="tls.sync",
        lock_args=("account",),
        on_duplicate="wait",
        lock_ttl=30,
    )
    def sync(self: Any, account: int, hold: bool = False) -> str:
        started[self.request.id] = time.monotonic()
        if hold:
            assert wait_until(lambda: None not in values_on(mutual_servers, self.lock.key))
            gate.wait(10)
        return str(self.lock.key)

    signals = LockSignals().connect()
    try:
        with embedded_worker(app, concurrency=2):
            first = sync.delay(1, hold=True)
            assert wait_until(lambda: first.id in started, 10)
            second = sync.delay(1)
            # The duplicate waits for the release notification (subscribed over TLS).
            signals.wait("lock_duplicate", task_id=second.id, policy="wait")
            assert second.id not in started
            released = time.monotonic()
            gate.set()
            key = first.get(timeout=10)
            assert second.get(timeout=10) == key
    finally:
        gate.set()
        signals.disconnect()
    # Woken by the release, not by the end of the holder's 30 s ttl.
    assert started[second.id] - released < 5
    assert wait_until(lambda: values_on(mutual_servers, key) == [None] * 3)


def test_node_status_and_the_status_command_over_tls(
    mutual_servers: list[RedisServer], certificates: TLSCertificates
) -> None:
    urls = [tls_url(server, certificates.ca_certificate, certificates) for server in mutual_servers]
    app = create_app(urls)

    statuses = admin.node_status(app, timeout=NODE_TIMEOUT)
    in_process = invoke(app, "status", *FAST)
    command = run_redlock_command(urls, "status", "--json", *FAST)

    for status, server in zip(statuses, mutual_servers, strict=True):
        with server.client(decode_responses=True) as client:
            version = client.info("server")["redis_version"]
        assert status.reachable and status.error is None, status
        assert status.redis_version == version and status.role == "master"
        assert status.could_not_read == ()
    assert in_process.exit_code == 0, in_process.output
    assert "3 of 3 reachable, a majority is 2: OK" in in_process.output
    assert command.returncode == 0, command.stdout + command.stderr
    report = json.loads(command.stdout)
    assert (report["reachable"], report["has_quorum"]) == (3, True)
    assert all(node["node"].startswith("rediss://127.0.0.1:") for node in report["nodes"])


def test_status_names_a_node_whose_certificate_fails_verification(
    mutual_servers: list[RedisServer], certificates: TLSCertificates
) -> None:
    authority, wrong = certificates.ca_certificate, certificates.unrelated_ca_certificate
    urls = [tls_url(server, authority, certificates) for server in mutual_servers[:2]]
    urls.append(tls_url(mutual_servers[2], wrong, certificates))
    app = create_app(urls)

    started = time.monotonic()
    statuses = admin.node_status(app, timeout=NODE_TIMEOUT)
    seconds = time.monotonic() - started
    result = invoke(app, "status", *FAST)

    assert seconds < PROMPT, seconds
    assert [status.reachable for status in statuses] == [True, True, False]
    assert statuses[2].error is not None and VERIFY_FAILED in statuses[2].error
    assert result.exit_code == 0, result.output  # a majority is reachable
    assert "2 of 3 reachable" in result.output and VERIFY_FAILED in result.output


# -- one context per TLS configuration ----------------------------------------------------------


class TLSActivity:
    """Counts kept around the real ``ssl`` functions (nothing else changes): contexts made
    (``ssl.create_default_context``, which redis-py and the nodes layer call for each context
    they build) and TLS handshakes under way (``ssl.SSLContext.wrap_socket``, which makes
    them). Kept in lists, without a lock: a forked child must not find one held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: list[None] = []
        self.under_way: list[str] = []  # the names of the threads handshaking
        self.most_under_way = 0
        make_context, wrap_socket = ssl.create_default_context, ssl.SSLContext.wrap_socket
        activity = self

        def counting_make_context(*arguments: Any, **options: Any) -> ssl.SSLContext:
            activity.made.append(None)
            return make_context(*arguments, **options)

        def counting_wrap_socket(self: ssl.SSLContext, *arguments: Any, **options: Any) -> Any:
            mark = threading.current_thread().name
            activity.under_way.append(mark)
            activity.most_under_way = max(activity.most_under_way, len(activity.under_way))
            try:
                return wrap_socket(self, *arguments, **options)
            finally:
                activity.under_way.remove(mark)

        monkeypatch.setattr(ssl, "create_default_context", counting_make_context)
        monkeypatch.setattr(ssl.SSLContext, "wrap_socket", counting_wrap_socket)

    @property
    def contexts_made(self) -> int:
        """How many contexts were made so far."""
        return len(self.made)

    @property
    def handshakes_under_way(self) -> int:
        """How many handshakes are under way now."""
        return len(self.under_way)


def test_first_calls_of_16_threads_make_one_context_for_three_members(
    mutual_servers: list[RedisServer],
    certificates: TLSCertificates,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    urls = [tls_url(server, certificates.ca_certificate, certificates) for server in mutual_servers]
    activity = TLSActivity(monkeypatch)
    redlock = Redlock(urls, node_timeout=NODE_TIMEOUT)
    try:
        first_calls(redlock, 16, "tls:first")
        # Later connections (a server that closed them, a probe) take the same context.
        redlock.close()
        first_calls(redlock, 16, "tls:again")
    finally:
        redlock.close()
    assert activity.contexts_made == 1  # 7 before: one per connection


@pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"
)
def test_a_forked_child_makes_its_own_context(
    mutual_servers: list[RedisServer],
    certificates: TLSCertificates,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A child does not use the context it inherited (a lock of OpenSSL's inside it that a
    thread of the parent held at the fork would stay held): its first calls make one of its own,
    once; the parent keeps using its own."""
    urls = [tls_url(server, certificates.ca_certificate, certificates) for server in mutual_servers]
    activity = TLSActivity(monkeypatch)
    redlock = Redlock(urls, node_timeout=NODE_TIMEOUT)
    try:
        first_calls(redlock, 1, "tls:parent")
        made_before = activity.contexts_made

        def child() -> bool:
            first_calls(redlock, 16, "tls:child")
            return activity.contexts_made == made_before + 1

        assert exit_code_of_forked_child(child) == 0
        first_calls(redlock, 1, "tls:parent-again")
    finally:
        redlock.close()
    assert activity.contexts_made == 1  # the parent's, for all its connections


@pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"
)
def test_a_forked_childs_16_first_calls_dispose_of_the_parents_connections_once(
    mutual_servers: list[RedisServer],
    certificates: TLSCertificates,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parent's connections, disposed of by the child's first call while its other threads
    ask for the connections too, are disposed of once, and every thread takes the child's one
    set of connections; dropping the group in the child disposes of the child's, not again of
    the parent's. Each disposal closed the wake-up pipe's descriptor numbers again, by then the
    child's new TLS connections' ("Bad file descriptor", "Socket operation on non-socket",
    "[SSL: UNEXPECTED_MESSAGE]")."""
    urls = [tls_url(server, certificates.ca_certificate, certificates) for server in mutual_servers]
    # Held by the list alone: the child drops it (its finalizer disposes of the connections).
    redlocks = [Redlock(urls, node_timeout=NODE_TIMEOUT)]
    try:
        first_calls(redlocks[0], 1, "tls:parent")

        def child() -> bool:
            closes = slow_reactor_disposals(monkeypatch, 0.2)
            first_calls(redlocks[0], 16, "tls:child")
            first_calls(redlocks[0], 16, "tls:child-again")
            redlocks.clear()
            gc.collect()
            # The parent's reactor and the child's (its thread closes its sockets on its way out),
            # each once (and those of other dropped groups).
            wait_until(lambda: len(closes) >= 2, timeout=2.0)
            return len(closes) == len(set(closes)) >= 2

        assert exit_code_of_forked_child(child) == 0
        first_calls(redlocks[0], 1, "tls:parent-again")
    finally:
        redlocks[0].close()


# -- every member connected at once -------------------------------------------------------------


def test_a_first_call_connects_to_every_member_at_once(
    mutual_servers: list[RedisServer],
    certificates: TLSCertificates,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped servers (SIGSTOP: the kernel still accepts) hold every handshake: the first call
    has all three under way at once, where it used to wait out one before starting the next."""
    urls = [tls_url(server, certificates.ca_certificate, certificates) for server in mutual_servers]
    activity = TLSActivity(monkeypatch)
    redlock = Redlock(urls, node_timeout=5.0)  # longer than the handshakes are held
    taken: list[Any] = []
    caller = threading.Thread(target=lambda: taken.append(redlock.acquire("tls:at-once", 10)))

    def its_handshakes() -> int:
        # Those of the caller and its helpers: not those of earlier tests' probes.
        return sum(
            name == caller.name or name.startswith("celery-redlock connect")
            for name in list(activity.under_way)
        )

    seen = [0]
    for server in mutual_servers:
        server.pause()
    try:
        caller.start()
        all_at_once = wait_until(lambda: seen.append(its_handshakes()) or seen[-1] == 3, 4.0)
    finally:
        for server in mutual_servers:
            server.resume()
        caller.join(15)
    try:
        assert all_at_once, f"at most {max(seen)} of 3 handshakes at once"
        assert taken and taken[0] is not None  # the servers answer once resumed
        assert redlock.release(taken[0])
    finally:
        redlock.close()
