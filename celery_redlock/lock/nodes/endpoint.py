"""One Redis server as the nodes layer reaches it: how to open an authenticated connection to it
(TCP, TLS or a unix socket, through redis-py's connection classes), and its back-off.

A failure backs the server off for 0.25 s, doubling up to 0.5 s while it keeps failing; once that
passes, a background thread probes it (connect, PING) and rounds take it back when it answers.
The back-off is forgotten only when a round gets a good reply, so a server that answers PING but
fails every command (out of memory, read-only) stays backed off.

A server may run commands it was sent while it seemed down (a stalled server resumes and runs the
SETs it holds). So a clean-up it could not be sent, or whose reply never came (`Endpoint.owe`), is
kept and sent by the probe as soon as the server answers again, for as long as what it removes
could still live: nothing a caller sent outlives it by more than a probe. A round about to set a
value first drops the clean-ups owed for it and waits for one the probe is sending (`forgive`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import redis
from redis._parsers import _RESP2Parser
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection, Connection, ConnectionPool, SSLConnection
from redis.exceptions import ClusterDownError, OutOfMemoryError, ResponseError, TryAgainError
from redis.exceptions import RedisError as RedisClientError
from redis.retry import Retry

from ...errors import ConfigurationError
from ...settings import has_credentials, redact_url
from .forks import ProcessLock
from .resp import pack_command
from .threads import start_thread
from .tls import TLSConnection, TLSContexts
from .wakeups import Flag

logger = logging.getLogger(__name__)

FIRST_BACKOFF_SECONDS = 0.25
MAX_BACKOFF_SECONDS = 0.5  # a server that comes back is in use again within about a second
PROBE_START_SECONDS = 1.0
"""How long a claimed probe may take to start before another caller starts one."""
PROBE_TIMEOUT_SECONDS = 1.0
"""How long a probe waits for the server (when the node timeout is shorter): a probe runs in a
thread of its own, so a server that answers late (a busy host) still counts as answering."""
# Error replies after which an owed clean-up is sent again later (a LOADING server raises
# redis-py's BusyLoadingError, a connection error: the whole batch stays owed).
_TRANSIENT = (TryAgainError, ClusterDownError, OutOfMemoryError)

LATENESS_RISE = 0.5
LATENESS_FALL = 0.05
"""How far `Endpoint.lateness` moves toward each reply's delay: quickly up, slowly down."""
MAX_OWED = 100_000
"""Clean-ups kept per server while it does not answer (a safety net: only rounds sent to it, or
locks it granted, owe it one, and each is dropped once what it removes has expired); past that
the oldest (those whose keys expire soonest) are dropped."""

Debt = tuple[float, bytes, str]
"""A clean-up owed to a server: until when it is needed (monotonic), the packed command (an
``EVALSHA``: a few hundred bytes, not the script's source), and the source of its script (one
string shared by every debt), loaded before the debts are sent."""

ACL_HINT = "apply the least-privilege ACL line of README's 'TLS, passwords, ACL users'"

# How servers say that the ACL user may not do something: NOPERM replies, and the errors of
# commands run inside scripts (which the scripts' call() suffixes with "[command <name>]").
_DENIED = ("NOPERM", "can't run this command", "No permissions to access", "ACL failure in script")


def describe_failure(reason: object, user: str | None = None) -> str:
    """A one-line account of why a server gave no usable reply; a denied command names the ACL
    rule that grants it to ``user``, instead of looking like a network failure."""
    text = str(reason)
    if not any(marker in text for marker in _DENIED):
        return text
    named = re.search(r"run the '([^']+)' command", text) or re.search(
        r"\[command ([^\]]+)\]", text
    )
    if "access a key" in text or "access a channel" in text:
        return (
            f"NOPERM: the node's user may not use celery_redlock's keys or channels ({text}); "
            f"its ACL needs ~<key prefix>* and &<key prefix>*; {ACL_HINT}"
        )
    if named is not None:
        command = named.group(1).lower()
        return (
            f"NOPERM: the node's user may not run {command!r}; grant it with "
            f"ACL SETUSER {user or '<user>'} +{command}, or {ACL_HINT}"
        )
    return f"NOPERM: the node's user lacks a permission ({text}); {ACL_HINT}"


# Connection arguments that turn off CLIENT SETINFO (spelled differently across redis-py).
_NO_CLIENT_SETINFO: dict[str, Any] = {"driver_info": None}  # redis-py 7 and later
try:
    Connection(driver_info=None)
except TypeError:
    _NO_CLIENT_SETINFO = {"lib_name": None, "lib_version": None}


class OwnPoolClient(redis.Redis):
    """A redis-py client whose ``close()`` (and ``with`` block) also closes its pool's
    connections, which redis-py 5.0's ``close()`` leaves open."""

    def close(self) -> None:
        """Return the client's connection and close every connection of its pool."""
        super().close()
        self.connection_pool.disconnect()


def _close_unwound_sockets(error: BaseException) -> None:
    """Close the sockets held by the frames ``error`` unwound, and those of the errors it was
    raised from (redis-py raises its own from an `OSError`): nobody else can reach them any more.
    One is the TLS socket ``ssl`` leaves open when the server resets the connection before the
    handshake (its check for a connection that is not there yet raises past its clean-up)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        trace: TracebackType | None = cause.__traceback__
        while trace is not None:
            for value in trace.tb_frame.f_locals.values():
                if isinstance(value, socket.socket):
                    # Not value.close(): a socket whose constructor was interrupted lacks the
                    # attributes close() reads. detach() needs none of them.
                    descriptor = value.detach()
                    if descriptor != -1:
                        os.close(descriptor)
            trace = trace.tb_next
        cause = cause.__cause__ or cause.__context__


class Endpoint:
    """One Redis server: its connection options, and its health in this process. ``name`` is
    the server as it may be shown (passwords redacted)."""

    def __init__(
        self, name: str, connection_class: type[AbstractConnection], options: dict[str, Any]
    ) -> None:
        self.name = name
        self.connection_class = connection_class
        self.options = options
        self.last_error = ""  # why the server was last backed off, for error messages
        # Seconds from queueing a command to reading its reply, smoothed: on a busy host it
        # grows with the time the reading thread waits for a CPU, not only with the server.
        self.lateness = 0.0
        self._suspect = False  # True from a failure until a probe sees the server answer
        self._down_until = 0.0
        self._backoff = 0.0
        # No lock guards the probe: a lock held by another thread at a fork would stay held in
        # the child for ever. Two threads starting a probe at once merely probe twice.
        self._probing_pid = 0  # the process that claimed the probe
        self._probe_claimed_at = 0.0
        self._probe_running_pid = 0  # the process whose probe thread runs
        self._probe_sleeping = False
        self._probe_finished = Flag()
        # Clean-ups owed to the server, by the value each removes: (monotonic time it is useless
        # after, packed command); in the order owed, which is roughly the order of expiry. And
        # those a probe is sending now (`_payment_done` is set once their replies are read).
        self._owed: dict[bytes, Debt] = {}
        self._paying: dict[bytes, Debt] = {}
        self._payment_done = Flag()
        self._debts_guard = ProcessLock()
        self._debts_pid = os.getpid()  # the process the debts are of

    @classmethod
    def from_url(
        cls,
        url: str,
        node_timeout: float,
        username: str | None = None,
        password: str | None = None,
        tls_contexts: TLSContexts | None = None,
    ) -> Endpoint:
        """The server a ``redis://``, ``rediss://`` or ``unix://`` URL names, reached with
        ``node_timeout`` for connecting and every read, no retries, RESP2, no CLIENT SETINFO.

        ``username``, ``password``: the credentials where the URL names none.
        ``tls_contexts``: where a ``rediss://`` server takes its TLS context, shared with the
        servers of the same TLS options (by default one of its own)."""
        credentials = {} if has_credentials(url) else {"username": username, "password": password}
        try:
            pool = ConnectionPool.from_url(
                url,
                socket_timeout=node_timeout,
                socket_connect_timeout=node_timeout,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                protocol=2,
                **credentials,
            )
        except (ValueError, TypeError) as error:
            raise ConfigurationError(
                f"redlock_urls: cannot use lock node URL {redact_url(url)!r}: "
                f"{str(error).rstrip('.')}; the form is redis://[user:password@]host:port/db"
            ) from error
        options: dict[str, Any] = dict(pool.connection_kwargs)
        # No CLIENT SETINFO in the handshake: connecting to a hung server then costs nothing
        # until the round's own command, which every server is waited for in parallel.
        options.update(_NO_CLIENT_SETINFO)
        # redis-py's own parser even where hiredis is installed: with hiredis, redis-py (8.1) takes
        # the TLS session tickets a server sends after the handshake for unread replies when the
        # handshake read nothing (no CLIENT SETINFO, no AUTH), and drops every new TLS connection of
        # a pool ("Connection not ready"). The nodes layer's own connections parse with `resp`.
        options["parser_class"] = _RESP2Parser
        connection_class: type[AbstractConnection] = pool.connection_class
        if connection_class is SSLConnection:
            connection_class = TLSConnection
            options["tls_context"] = (tls_contexts or TLSContexts()).for_options(options)
        return cls(redact_url(url), connection_class, options)

    def at(self, host: str, port: int) -> Endpoint:
        """Another server with the same connection options (credentials, TLS, timeouts)."""
        options = {**self.options, "host": host, "port": port}
        scheme = self.name.partition("://")[0] or "redis"
        return Endpoint(f"{scheme}://{host}:{port}", self.connection_class, options)

    @property
    def timeout(self) -> float:
        """Seconds a command to the server is waited for: the node timeout."""
        return float(self.options.get("socket_timeout") or 0.0)

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) of a TCP server, None for a unix socket."""
        host, port = self.options.get("host"), self.options.get("port")
        return (str(host), int(port)) if host is not None and port is not None else None

    def open_socket(self) -> socket.socket:
        """A new connected, authenticated socket (TLS negotiated), blocking, with the node
        timeout. Raises redis-py's errors or `OSError`."""
        connection = self.connection_class(**self.options)
        taken: Any = connection
        try:
            connection.connect()
            # The one place the package takes redis-py's socket: the connection did the
            # handshake (AUTH, SELECT, TLS); the nodes layer reads and writes it from here on.
            sock: socket.socket = taken._sock
        except BaseException as error:
            # redis-py closes its socket on its own errors only: one interrupted (a signal
            # handler raising: a soft time limit) is closed here, not left to the garbage
            # collector, whether the connection holds it or redis-py's connect still did.
            connection.disconnect()
            _close_unwound_sockets(error)
            raise
        taken._sock = None
        return sock

    def client(self, timeout: float | None = None) -> redis.Redis:
        """A plain redis-py client for this server, by default with the node's timeouts."""
        options = dict(self.options)
        if timeout is not None:
            options.update(socket_timeout=timeout, socket_connect_timeout=timeout)
        return OwnPoolClient(
            connection_pool=ConnectionPool(connection_class=self.connection_class, **options)
        )

    def is_backed_off(self, now: float) -> bool:
        """True while the server is skipped after a failure (starting a probe once it is due)."""
        if not self._suspect:
            return False
        if now >= self._down_until:
            self._start_probe()
        return True

    def _start_probe(self) -> None:
        pid = os.getpid()
        if self._probing_pid == pid and (
            self._probe_running_pid == pid
            or time.monotonic() - self._probe_claimed_at < PROBE_START_SECONDS
        ):
            return  # a probe is on its way in this process
        # A caller interrupted between here and the thread's start (a soft time limit) leaves a
        # claim no thread runs: past PROBE_START_SECONDS the next caller starts one after all.
        self._probe_claimed_at = time.monotonic()
        self._probing_pid = pid
        self._probe_finished = Flag()
        # Not due yet: the probe sleeps first (so `probing` is False until then, from now on).
        self._probe_sleeping = self._down_until > time.monotonic()
        start_thread(self._probe, self._probe_finished, name=f"celery-redlock probe {self.name}")

    def _probe(self, finished: Flag) -> None:
        """Probe the server once it is due; while clean-ups are owed to it, again after each
        back-off until it answers (and is sent them) or they are no longer needed."""
        self._probe_running_pid = os.getpid()
        try:
            while True:
                wait = self._down_until - time.monotonic()
                if wait > 0:
                    self._probe_sleeping = True
                    time.sleep(wait)
                    self._probe_sleeping = False
                if self._probe_once() or not self._still_owed(time.monotonic()):
                    return
        finally:
            self._probe_running_pid = 0
            self._probing_pid = 0
            finished.set()
            if self._still_owed(time.monotonic()):
                self._start_probe()  # owed while this probe was finishing

    def _probe_once(self) -> bool:
        timeout = max(self.timeout, PROBE_TIMEOUT_SECONDS)
        options = {**self.options, "socket_timeout": timeout, "socket_connect_timeout": timeout}
        connection = self.connection_class(**options)
        try:
            connection.connect()
            # PING is in the least-privilege ACL README documents; a user denied it still shows
            # that the server answers (its NOPERM is an answer), so it does not count against it.
            sent = time.monotonic()
            connection.send_command("PING", check_health=False)
            try:
                if connection.read_response() not in (b"PONG", "PONG"):
                    raise ResponseError("the server does not answer PING with PONG")
            except ResponseError as error:
                if not str(error).startswith("NOPERM"):
                    raise
            self._observe(time.monotonic() - sent)  # rounds wait as long as it takes now
            self._pay(connection)
        except Exception as error:  # whatever it is, the probe thread goes on (backed off)
            _close_unwound_sockets(error)
            self.mark_down(time.monotonic(), error)
            return False
        finally:
            with contextlib.suppress(RedisClientError, OSError):
                connection.disconnect()
        self._suspect = False
        return True

    def owe(self, value: bytes, packed: bytes, until: float, source: str) -> None:
        """Send ``packed`` (an ``EVALSHA`` of the script whose source is ``source``: a clean-up of
        ``value``, harmless when run again) to the server once it answers again, unless
        ``until`` (monotonic) has passed by then: for a clean-up it was not sent, or did not
        answer, as it may still run what it was sent before. A later clean-up of the same value
        replaces an earlier one. Costs the same however much is owed: what expired is dropped
        as it goes."""
        with self._debts():  # `forgive` may be going through them in another thread
            owed = self._owed
            owed.pop(value, None)
            owed[value] = (until, packed, source)
            self._drop_expired(time.monotonic())
            if len(owed) > MAX_OWED:
                del owed[next(iter(owed))]
        self._start_probe()

    def forgive(self, value: bytes) -> bool:
        """Drop the clean-up owed for ``value``, right before a round sets ``value`` again (a
        later round of the acquisition that owed it, with the same token): sent after it, it
        would remove the lock. When a probe is sending it now, wait for its reply first (on its
        own connection, it could run after the round), two probe timeouts at most; one still on
        its way then backs the server off until the probe is done with it, so that the round
        skips the server. Returns True if one was owed or on its way (the server may hold
        ``value``)."""
        if not (self._owed or self._paying):
            return False  # nothing owed: the common case, with no lock taken
        deadline = time.monotonic() + 2 * max(self.timeout, PROBE_TIMEOUT_SECONDS)
        owed = False
        while True:
            with self._debts():
                owed = self._owed.pop(value, None) is not None or owed
                in_flight = value in self._paying
                done = self._payment_done
            if not in_flight:
                return owed
            owed = True
            left = deadline - time.monotonic()
            if left <= 0:
                self.mark_down(time.monotonic(), "a clean-up sent to it is still unanswered")
                return owed
            # A payment that fails puts its clean-ups back: the next pass drops it.
            done.wait(left)

    @property
    def owed(self) -> int:
        """How many clean-ups wait for the server to answer again."""
        return len(self._owed)

    def _debts(self) -> threading.Lock:
        """The lock over the clean-ups. A child process gets a new one (another thread may have
        held it at the fork), the same for all its threads, and its first thread to ask owes
        again what the parent was sending, while the others wait."""
        guard = self._debts_guard.held()
        pid = os.getpid()
        if self._debts_pid != pid:
            with guard:
                if self._debts_pid != pid:
                    self._owed.update(self._paying)
                    self._paying = {}
                    self._payment_done = Flag()
                    self._debts_pid = pid  # last: no thread skips the wait above before it
        return guard

    def _drop_expired(self, now: float) -> None:
        """Drop the clean-ups no longer needed from the front (called with the debts' lock)."""
        owed = self._owed
        while owed:
            value = next(iter(owed))
            if owed[value][0] > now:
                return
            del owed[value]

    def _still_owed(self, now: float) -> bool:
        with self._debts():
            self._drop_expired(now)
            return bool(self._owed)

    def _pay(self, connection: AbstractConnection) -> None:
        """Send every clean-up still needed on ``connection`` (a new one: the server reads it
        after what the old connections hold); any that fail stay owed."""
        now = time.monotonic()
        with self._debts():
            batch = {value: debt for value, debt in self._owed.items() if debt[0] > now}
            self._owed = {}
            if not batch:
                return
            self._paying = batch
            done = self._payment_done = Flag()
        unpaid: dict[bytes, Debt] = {}
        try:
            # The scripts first: a server that restarted has none in its cache.
            sources = list(dict.fromkeys(source for _, _, source in batch.values()))
            loads = [pack_command("SCRIPT", "LOAD", source) for source in sources]
            payload = b"".join([*loads, *(packed for _, packed, _ in batch.values())])
            connection.send_packed_command([payload], False)
            for _ in loads:
                connection.read_response()
            for value, debt in batch.items():
                try:
                    connection.read_response()
                except ResponseError as error:
                    # Out of memory, loading, busy: the key may still be there, later. Any other
                    # refusal (MOVED, READONLY after a failover, a denied command) will not change
                    # by sending it again: the key lives elsewhere, or the rounds see the fault.
                    if isinstance(error, _TRANSIENT) or str(error).startswith("BUSY"):
                        unpaid[value] = debt
                        self.last_error = describe_failure(error, self.options.get("username"))
        except BaseException:
            unpaid = batch
            raise
        finally:
            with self._debts():
                for value, debt in unpaid.items():  # behind any owed meanwhile: it is older
                    self._owed.setdefault(value, debt)
                self._paying = {}
            done.set()
        if unpaid:
            raise ResponseError(f"clean-ups refused: {self.last_error}")

    @property
    def probing(self) -> bool:
        """True while this process's probe of the server is under way (not waiting to be due)."""
        return self._probing_pid == os.getpid() and not self._probe_sleeping

    def wait_for_probe(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the probe under way, if any, to finish."""
        if self.probing and timeout > 0:
            self._probe_finished.wait(timeout)

    def mark_down(self, now: float, reason: object) -> None:
        """Skip this server for a while (doubling each time it fails again, up to a cap)."""
        was_up = self._backoff == 0.0
        self.last_error = describe_failure(reason, self.options.get("username"))
        self._backoff = min(MAX_BACKOFF_SECONDS, max(FIRST_BACKOFF_SECONDS, self._backoff * 2))
        self._down_until = now + self._backoff
        self._suspect = True
        if was_up:
            logger.warning(
                "lock node %s is unavailable (%s); skipping it for %.2fs, then probing again",
                self.name,
                self.last_error,
                self._backoff,
            )

    def mark_answered(self, delay: float = 0.0) -> None:
        """Record a good reply, read ``delay`` seconds after its command was queued: the server
        takes part in every round again, and its `lateness` follows the delay."""
        self._observe(delay)
        if self._backoff:
            logger.info("lock node %s answers again", self.name)
            self._backoff = 0.0
            with self._debts():
                if not self._paying:  # else the probe ends the back-off once they are sent
                    self._suspect = False

    def _observe(self, delay: float) -> None:
        lateness = self.lateness
        rate = LATENESS_RISE if delay > lateness else LATENESS_FALL
        self.lateness = lateness + (delay - lateness) * rate


class KnownServers:
    """The servers a member has learned of, one `Endpoint` per address, kept with its health and
    connection however often the member learns of it again; new ones take ``template``'s
    connection options."""

    def __init__(self, template: Endpoint, known: Iterable[Endpoint] = ()) -> None:
        self.template = template
        self._by_address = {endpoint.address: endpoint for endpoint in known if endpoint.address}
        self._guard = threading.Lock()  # only around the dictionary update, never around I/O

    def at(self, host: str, port: int) -> Endpoint:
        """The server at ``host:port``."""
        endpoint = self._by_address.get((host, port))
        if endpoint is None:
            with self._guard:
                endpoint = self._by_address.setdefault((host, port), self.template.at(host, port))
        return endpoint

    def all(self) -> list[Endpoint]:
        """Every server learned of so far."""
        return list(self._by_address.values())
