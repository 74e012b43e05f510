"""A Sentinel-managed master as one member of the quorum (`SentinelNode`).

The member is whichever server the sentinels name as the master of the service (``SENTINEL MASTER``:
one they see up, as redis-py's ``Sentinel.discover_master`` requires; where they disagree, the one
named under the newest configuration epoch). Every sentinel is asked, on first use, again in the
background after the master fails or answers ``READONLY`` (demoted), at least every
`REFRESH_SECONDS` while the member is used, and whenever a sentinel announces a failover.

Failovers are heard as they happen (`Announcements`: a subscription to every sentinel's events,
as Redisson does). From the moment a sentinel announces one for the service (``+try-failover``,
the promotion's steps) until the sentinels name a master again (``+switch-master``, or a look that
finds no failover under way), no grant or extension by the member counts: the old master keeps
accepting writes for seconds after a replica was promoted, and what it grants then is not on the
new master (`SentinelNode.vouches_for`). Before every extension, and before every grant while a
sentinel cannot be heard, the sentinels are asked at once (`SentinelNode.confirm`). A graceful
failover carries every replicated key to the new master, where a holder extends its lock as soon
as the switch is announced. Replication is
asynchronous: a grant that a master killed before its replica got it loses is lost with it,
unless ``redlock_wait_replicas`` made it count only once replicas acknowledged it.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, NamedTuple

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError as RedisClientError

from ...errors import RedlockError
from ...settings import redact_url
from .endpoint import PROBE_TIMEOUT_SECONDS, Endpoint, KnownServers
from .locating import Locator, every_answer, first_answer
from .members import LockNode
from .resp import ErrorReply
from .threads import start_thread
from .wakeups import Flag

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 1.0
"""How old the master's address may get before the sentinels are asked again (in the background):
for a sentinel whose announcements this process could not hear (its connection was down)."""

FAILOVER_EVENTS = (
    "+odown",
    "+try-failover",
    "+elected-leader",
    "+failover-state-select-slave",
    "+selected-slave",
    "+failover-state-send-slaveof-noone",
    "+failover-state-wait-promotion",
    "+promoted-slave",
    "+failover-state-reconf-slaves",
    "+failover-detected",
)
"""Sentinel events saying that the master of a service may be replaced now: from the first, its
grants stop counting (a replica may be promoted while the old master still accepts writes)."""
SETTLING_EVENTS = (
    "+switch-master",
    "+failover-end",
    "+failover-end-for-timeout",
    "-failover-abort-not-elected",
    "-failover-abort-no-good-slave",
    "-failover-abort-slave-timeout",
    "-odown",
    "+config-update-from",
)
"""Sentinel events after which the sentinels are asked again which master they name."""
FRESH_SECONDS = 0.05
"""How long ago the sentinels may have been asked for `SentinelNode.confirm` to rely on it: far
less than the two steps of their timer (0.1 s at least) from the start of a failover to the
promotion of a replica."""
LISTEN_SECONDS = 1.0
"""How long a listening thread waits for an announcement before it checks that its member is
still used (and pings the sentinel)."""
SILENT_SECONDS = 3 * LISTEN_SECONDS
"""How long a sentinel may leave a PING unanswered before its connection counts as lost (and is
opened again; meanwhile the member asks the sentinels before every grant)."""


class Named(NamedTuple):
    """What one sentinel says of the service: the master's address, the configuration epoch it
    was named under, and whether this sentinel is failing the master over now."""

    address: tuple[str, int]
    epoch: int
    failing_over: bool


class View(NamedTuple):
    """What the member knows: the master (None until found), and why its grants do not count now
    (empty when they do)."""

    master: Endpoint | None
    doubt: str = ""


class SentinelNode(LockNode):
    """The master the ``sentinels`` name for ``service``, as one member of the quorum; ``master``
    holds its connection options (database, credentials, TLS), not its address."""

    def __init__(
        self,
        url: str,
        sentinels: list[Endpoint],
        service: str,
        master: Endpoint,
        wait_replicas: int = 0,
    ) -> None:
        self.name = redact_url(url)
        self.sentinels = sentinels
        self.service = service
        self.wait_replicas = wait_replicas
        self.servers = KnownServers(master)
        # One value, replaced whole: the listening threads and the looks write it, rounds read it.
        self._view = View(None)
        self._announced = 0  # how many announcements were heard: a look older than one is stale
        self._asking = (-FRESH_SECONDS, Flag())  # the last question `confirm` asked
        self._unanswered_until = 0.0  # `confirm` does not ask until then: nobody answered it
        self.locator = Locator(self.name, self._ask_sentinels, master.timeout)
        self.announcements = Announcements(self)

    def endpoint_for(self, key: str) -> Endpoint | None:
        self.announcements.listen()
        if self.locator.ensure():
            self.locator.refresh_if_older(REFRESH_SECONDS)
        return self._view.master

    def endpoints(self) -> list[Endpoint]:
        self.locator.ensure(wait_for_the_look=True)
        master = self._view.master
        return [master] if master is not None else []

    def locating_error(self) -> str:
        return f"no sentinel named its master ({self.locator.last_error or 'not asked yet'})"

    def vouches_for(self, endpoint: Endpoint) -> str:
        view = self._view
        if view.doubt:
            return f"a failover of {self.service!r} is under way ({view.doubt})"
        if endpoint is not view.master:
            return f"the sentinels no longer name {endpoint.name} as the master"
        return ""

    def notice(self, reply: ErrorReply, endpoint: Endpoint) -> None:
        # Inside a script on Redis 6.2 every error reply is an "ERR ...": read the text too.
        if reply.code in ("READONLY", "LOADING", "MASTERDOWN") or "READONLY" in reply.text:
            self.locator.relocate()

    def notice_failure(self, endpoint: Endpoint) -> None:
        self.locator.relocate()

    def close(self) -> None:
        self.announcements.stop()

    def confirm(self, extension: bool) -> None:
        # The background looks and the announcements keep the view current, but an
        # announcement this process cannot hear (a sentinel it is not subscribed to) may be the
        # start of a failover: then, and before every extension (rare: a third of a ttl apart),
        # the sentinels are asked now. Sentinels that cannot be reached change nothing, and are
        # not asked again by every caller: the background looks go on asking them.
        if not extension and self.announcements.heard_all():
            return
        if not self.locator.located or time.monotonic() < self._unanswered_until:
            return  # the first look is under way, or the sentinels did not answer just now
        patience = self.sentinels[0].timeout
        started, asked = self._asking
        if time.monotonic() - started <= FRESH_SECONDS:
            asked.wait(patience)  # callers at the same moment share one question
            return
        self._asking = (time.monotonic(), asked := Flag())
        try:
            self._ask(patience)
        except RedlockError as error:
            self.locator.last_error = f"{error.__class__.__name__}: {error}"
            self._unanswered_until = time.monotonic() + REFRESH_SECONDS
        finally:
            asked.set()

    def announce(self, event: str, text: str) -> None:
        """Take note of a sentinel's announcement ``event`` (with its text) about any service."""
        if announced_service(event, text) != self.service:
            return
        self._announced += 1
        if event == "+switch-master":
            # "<service> <old ip> <old port> <new ip> <new port>": the sentinel names the new
            # master from now on, the others follow within seconds; a look confirms it.
            parts = text.split()
            if len(parts) == 5 and parts[4].isdigit():
                self._view = View(self.servers.at(parts[3], int(parts[4])))
        elif event in FAILOVER_EVENTS:
            self._view = View(self._view.master, f"a sentinel announced {event}")
        self.locator.relocate(again=True)

    def _ask_sentinels(self) -> None:
        """The locator's look: every sentinel, waited for up to a probe's timeout (a busy host
        answers late). The first look takes the first answer, so that callers wait no longer
        than before, and asks every sentinel again right after."""
        patience = max(self.sentinels[0].timeout, PROBE_TIMEOUT_SECONDS)
        self._ask(patience, every=self.locator.located)
        if not self.locator.located:
            self.locator.relocate(again=True)

    def _ask(self, patience: float, every: bool = True) -> None:
        """Ask the sentinels (``every`` one, or the first to answer) which master they name and
        whether a failover is under way; raises `RedlockError` when none answers."""
        announced = self._announced

        def ask(sentinel: Endpoint) -> Named:
            return self._named_by(sentinel, patience)

        if every:
            answers = every_answer(self.sentinels, ask, patience)
        else:
            answers = [first_answer(self.sentinels, ask)]
        newest = max(answers, key=lambda named: named.epoch)
        failing_over = any(named.failing_over for named in answers)
        doubt = "a sentinel reports a failover in progress" if failing_over else ""
        self._view = View(self.servers.at(*newest.address), doubt)
        if self._announced != announced:
            # An announcement came while the sentinels were asked: their answers may predate
            # it, and the view just written may have replaced the one it made.
            self._view = View(self._view.master, "a sentinel announced a change while asked")
            doubt = self._view.doubt
        if doubt:
            self.locator.relocate(again=True)  # until the sentinels agree again

    def _named_by(self, sentinel: Endpoint, patience: float) -> Named:
        with sentinel.client(timeout=patience) as client:
            state = client.sentinel_master(self.service)  # SENTINEL MASTER, parsed by redis-py
        host, port = master_address(state)
        epoch = state.get("config-epoch")
        return Named((host, port), epoch if isinstance(epoch, int) else -1, failing_over(state))


def master_address(state: object) -> tuple[str, int]:
    """The address of the master a sentinel's ``SENTINEL MASTER`` reply (parsed by redis-py)
    describes, with redis-py's checks (``Sentinel.check_master_state``): one the sentinel sees
    down or no longer as a master, or whose count of other sentinels is no count, is refused
    (`RedlockError`)."""
    if not isinstance(state, dict):
        raise RedlockError(f"gave a reply no sentinel gives to SENTINEL MASTER: {state!r:.60}")
    if not state.get("is_master") or state.get("is_sdown") or state.get("is_odown"):
        raise RedlockError(
            f"does not see {state.get('name')!r} up as a master ({state.get('flags')})"
        )
    others = state.get("num-other-sentinels")
    if not isinstance(others, int) or others < 0:  # redis-py's min_other_sentinels: 0
        raise RedlockError(f"sees {others!r} other sentinels")
    host, port = state.get("ip"), state.get("port")
    if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
        raise RedlockError(f"names no valid master address: {host!r}:{port!r}")
    return host, port


def failing_over(state: dict[str, Any]) -> bool:
    """Whether a sentinel's ``SENTINEL MASTER`` reply says it is failing the master over now."""
    return "failover_in_progress" in str(state.get("flags", "")).split(",")


def announced_service(event: str, text: str) -> str:
    """The service a sentinel's announcement is about: ``+switch-master`` names it first, events
    about a master say ``master <service> <ip> <port>``, events about a replica end with
    ``@ <service> <master ip> <master port>``."""
    parts = text.split()
    if event == "+switch-master" and parts:
        return parts[0]
    if "@" in parts and parts.index("@") + 1 < len(parts):
        return parts[parts.index("@") + 1]
    if len(parts) >= 2 and parts[0] == "master":
        return parts[1]
    return ""


class Announcements:
    """This process's subscriptions to the failover announcements of every sentinel of ``node``:
    one thread per sentinel, started on first use (again in a forked child), ended by `stop` or
    within `LISTEN_SECONDS` once the member is gone. A connection that fails is opened again,
    and the sentinels are asked anew: an announcement may have been missed meanwhile."""

    def __init__(self, node: SentinelNode) -> None:
        self._node = weakref.ref(node)
        self._sentinels = list(node.sentinels)
        # No lock: one held by another thread at a fork would stay held in the child for ever.
        # Two threads starting at once merely subscribe twice.
        self._listening_pid = 0
        self._generation = 0  # a thread of an older generation ends
        self._heard: set[str] = set()  # the sentinels whose announcements this process hears

    def listen(self) -> None:
        """Start listening in this process unless it does."""
        pid = os.getpid()
        if self._listening_pid == pid:
            return
        try:
            self._listening_pid = pid
            self._generation += 1
            self._heard = set()
            for sentinel in self._sentinels:
                start_thread(
                    self._listen,
                    sentinel,
                    pid,
                    self._generation,
                    name=f"celery-redlock announcements {sentinel.name}",
                )
        except BaseException:
            # Interrupted (a soft time limit) before every sentinel surely has its thread: the
            # claim goes (those started end), and the next caller starts them all anew. No
            # signal handler can run between entering this block and the claim's removal.
            self._listening_pid = 0
            raise

    def heard_all(self) -> bool:
        """Whether this process hears every sentinel's announcements now."""
        return self._listening_pid == os.getpid() and len(self._heard) == len(self._sentinels)

    def stop(self) -> None:
        """Stop listening (a later `listen` starts again)."""
        self._listening_pid = 0
        self._generation += 1
        self._heard = set()

    def _wanted(self, pid: int, generation: int) -> bool:
        return (
            self._listening_pid == pid == os.getpid()
            and self._generation == generation
            and self._node() is not None
        )

    def _listen(self, sentinel: Endpoint, pid: int, generation: int) -> None:
        failures = 0
        while self._wanted(pid, generation):
            try:
                self._subscribed(sentinel, pid, generation)
                failures = 0
            except (RedisClientError, OSError) as error:
                self._heard.discard(sentinel.name)
                if failures == 0:
                    logger.info("sentinel %s: not listening to it: %s", sentinel.name, error)
                failures += 1
                time.sleep(min(0.1 * 2**failures, LISTEN_SECONDS))

    def _subscribed(self, sentinel: Endpoint, pid: int, generation: int) -> None:
        timeout = max(sentinel.timeout, PROBE_TIMEOUT_SECONDS)
        with sentinel.client(timeout=timeout) as client, client.pubsub() as pubsub:
            pubsub.subscribe(*FAILOVER_EVENTS, *SETTLING_EVENTS)
            confirmed = 0
            heard_at, pinged = time.monotonic(), False
            while self._wanted(pid, generation):
                message = pubsub.get_message(timeout=LISTEN_SECONDS)
                silent = time.monotonic() - heard_at
                if message is None:
                    # A connection dropped on the way (a firewall forgetting an idle one) says
                    # nothing: an unanswered PING tells.
                    if silent > SILENT_SECONDS:
                        raise RedisConnectionError(f"no answer to PING for {silent:.3g}s")
                    if silent >= LISTEN_SECONDS and not pinged:
                        pubsub.ping()
                        pinged = True
                    continue
                heard_at, pinged = time.monotonic(), False
                if message["type"] == "subscribe":
                    confirmed += 1
                    if confirmed == len(FAILOVER_EVENTS) + len(SETTLING_EVENTS):
                        self._now_hearing(sentinel, generation)
                elif message["type"] == "message":
                    self._tell(_text(message["channel"]), _text(message["data"]))

    def _now_hearing(self, sentinel: Endpoint, generation: int) -> None:
        node = self._node()  # not kept between messages: the member may go meanwhile
        if node is not None:
            # Listening now: whatever was announced before may have been missed.
            node.locator.relocate(again=True)
            if self._generation == generation:
                self._heard.add(sentinel.name)

    def _tell(self, event: str, text: str) -> None:
        node = self._node()
        if node is not None:
            node.announce(event, text)


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
