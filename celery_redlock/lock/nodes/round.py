"""One round: a script call on every member of a quorum at once, and its replies as they arrive
(`Round`). A member whose key moved is followed (MOVED, ASK), a server that lost its scripts gets
the source (NOSCRIPT); an error reply, or one the script cannot give, counts as no answer and
backs the server off.

A round nobody waits for (``attended=False``: a release at the end of a run, the clean-up of a
failed attempt) is only sent; the reactor thread checks its replies the same way when they
arrive, and follows a key that moved from there. A server that is backed off, or gives no reply,
is owed a clean-up (`Endpoint.owe`): it gets it once it answers again."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..scripts import Script
from .channel import NO_REPLY, Slot, patience
from .endpoint import Endpoint
from .members import LockNode
from .reactor import Reactor, Waiting
from .resp import ErrorReply, pack_arguments, pack_command

Judge = Callable[[Any], "bool | None"]
"""Tells what one member's reply to a script means: True — it did what was asked; False — it
answered, and refused; None — the reply is not one the script can return (untrusted input: it
counts as no answer, like an error reply)."""

# Error replies that are no answer but an address: send the command there (or after a script
# load) and wait for that reply instead.
_FOLLOWED = ("MOVED", "ASK", "NOSCRIPT")
FOLLOW_UPS_PER_MEMBER = 3


def endpoint_of(node: LockNode, key: str) -> Endpoint | None:
    """The server a command on ``key`` goes to now (`LockNode.endpoint_for`); a standalone
    member's own, without the call."""
    endpoint = node.fixed_endpoint
    return endpoint if endpoint is not None else node.endpoint_for(key)


@dataclass
class RoundResult:
    """What one round learned: each member's reply (``NO_REPLY`` where none was usable), how many
    members answered (error replies and replies the script cannot give are not answers), how
    many succeeded, for each member without a usable reply why (else None), and which members
    the command never went to (`unsent`: they cannot have run it)."""

    replies: list[Any]
    successes: int
    answered: int
    finished_at: float
    failures: list[str | None]
    unsent: frozenset[int] = frozenset()  # the members the command never went to

    def unavailable_reasons(self, names: Sequence[str]) -> tuple[str, ...]:
        """``"<member>: <why>"`` for every member that gave no usable reply."""
        return tuple(
            f"{name}: {why}" for name, why in zip(names, self.failures, strict=True) if why
        )


@dataclass(eq=False, slots=True)
class NodeCall:
    """One member's part of a round: the slots of the commands sent to it (the script call,
    perhaps after ``ASKING`` and before ``WAIT``), and which of them carries the answer."""

    index: int
    endpoint: Endpoint
    alone: bool = False  # the script on its first key only (`Script.alone`)
    slots: list[Slot] = field(default_factory=list)
    main: Slot | None = None
    replicas: Slot | None = None  # the WAIT reply, when the member waits for replicas


class ScriptHeads:
    """``EVAL <source>`` (``by_source``) or ``EVALSHA <sha>`` of each script, packed once."""

    def __init__(self) -> None:
        self._heads: dict[tuple[str, bool], bytes] = {}

    def __call__(self, script: Script, by_source: bool) -> bytes:
        head = self._heads.get((script.name, by_source))
        if head is None:
            arguments = ("EVAL", script.source) if by_source else ("EVALSHA", script.sha)
            head = self._heads[(script.name, by_source)] = pack_arguments(*arguments)
        return head


@dataclass(frozen=True)
class Members:
    """What a round needs of its group."""

    nodes: Sequence[LockNode]
    node_timeout: float
    reactor: Reactor
    script_head: Callable[[Script, bool], bytes]


class Round(Waiting):
    """One script call on every member at once, and its replies as they arrive."""

    def __init__(
        self,
        members: Members,
        script: Script,
        keys: Sequence[str],
        arguments: Sequence[str | int],
        judge: Judge,
        every: bool,
        grants: bool,
        owed_until: float = 0.0,
        attended: bool = True,
        spared: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__()
        self.nodes = nodes = members.nodes
        self.node_timeout = members.node_timeout
        self.quorum = len(nodes) // 2 + 1
        self.reactor = members.reactor
        self.script = script
        self.script_head = members.script_head
        self.key = keys[0]
        self.call = (len(keys), *keys, *arguments)
        self.judge = judge
        self.every = every
        self.grants = grants  # a grant that must reach the replicas of members that wait for them
        # A member that does not answer is owed it until then (its first argument the value it
        # removes), but those ``spared``: what it removes never reached them.
        self.owed_until = owed_until
        self.spared = spared
        self.attended = attended
        # Scripts marked inline (releases), and every call nobody waits for, carry their source:
        # a NOSCRIPT that arrives after the round decided, or unattended, would go unanswered.
        self.by_source = script.inline or not attended
        count = len(nodes)
        self.replies: list[Any] = [NO_REPLY] * count
        self.why_not: list[str | None] = ["not asked"] * count
        self.calls: list[NodeCall | None] = [None] * count
        self.sent = [False] * count  # the command went to the member (or where it pointed)
        self.follow_ups: list[tuple[NodeCall, Slot]] = []
        # A member's command is followed to another server (or sent again with its script) at
        # most this often per round: a redirection loop (ASKING denied) ends as no answer.
        self.follow_ups_left = [FOLLOW_UPS_PER_MEMBER] * count
        self.outstanding = 0
        self.successes = 0
        self.answered = 0
        self.failures = 0
        self.finished = False
        self.deadline = 0.0
        self.patience = self.node_timeout

    def start(self) -> None:
        """Send to every member that is not backed off. When those are too few for a quorum,
        give the members being probed (in parallel) one node_timeout and take in those that
        answered (an attended round only)."""
        packed = self._packed(by_source=self.by_source)
        now = time.monotonic()
        self.outstanding = len(self.nodes)  # before any slot is sent: nobody delivers yet
        skipped: list[tuple[int, LockNode, Endpoint | None]] = []
        lateness: list[float] = []
        for index, node in enumerate(self.nodes):
            endpoint = endpoint_of(node, self.key)
            if endpoint is None or endpoint.is_backed_off(now):
                skipped.append((index, node, endpoint))
            else:
                lateness.append(endpoint.lateness)
                self._send(index, node, endpoint, packed, asking=False)
        if skipped:
            self._skip(skipped, packed)
        self.patience = patience(self.node_timeout, lateness, self.quorum)
        self.deadline = time.monotonic() + self.patience

    def _packed(self, by_source: bool, alone: bool = False) -> bytes:
        call = self.call
        if alone:
            call = (1, call[1], *call[1 + int(call[0]) :])
        return pack_command(*call, head=self.script_head(self.script, by_source), head_count=2)

    def _owe(self, index: int, endpoint: Endpoint) -> None:
        if self.owed_until and index not in self.spared:
            value = str(self.call[1 + int(self.call[0])]).encode()
            packed = self._packed(by_source=False)
            endpoint.owe(value, packed, self.owed_until, self.script.source)

    def _skip(self, skipped: list[tuple[int, LockNode, Endpoint | None]], packed: bytes) -> None:
        reactor = self.reactor
        with reactor.lock:
            for index, node, endpoint in skipped:
                why = endpoint.last_error if endpoint is not None else node.locating_error()
                self._settle(index, f"skipped while backed off ({why})")
        for index, node, endpoint in skipped:
            if endpoint is not None:
                node.notice_failure(endpoint)
                self._owe(index, endpoint)
        probing = [
            (index, node, endpoint)
            for index, node, endpoint in skipped
            if endpoint is not None and endpoint.probing
        ]
        sent = sum(call is not None for call in self.calls)
        if not (self.attended and probing and sent < self.quorum):
            return
        until = time.monotonic() + self.node_timeout
        for _, _, endpoint in probing:
            endpoint.wait_for_probe(until - time.monotonic())
        now = time.monotonic()
        for index, node, endpoint in probing:
            if not endpoint.is_backed_off(now):
                with reactor.lock:
                    self.outstanding += 1
                    self.failures -= 1
                self._send(index, node, endpoint, packed, asking=False)

    def _send(
        self,
        index: int,
        node: LockNode,
        endpoint: Endpoint,
        packed: bytes,
        asking: bool,
        alone: bool = False,
    ) -> None:
        call = NodeCall(index, endpoint, alone)
        waits = self.grants and node.wait_replicas
        commands = [pack_command("ASKING"), packed] if asking else [packed]
        if waits:
            # Half the node timeout: WAIT holds up the replies of the whole (shared)
            # connection while it waits, and its own reply must arrive within the round.
            timeout_ms = max(1, int(self.node_timeout * 500))
            commands.append(pack_command("WAIT", node.wait_replicas, timeout_ms))
        call.slots = slots = [Slot(self, call) for _ in commands]
        now = time.monotonic()  # the round's deadline counts from here: so does the silence
        for slot in slots:
            slot.sent_at = now
        call.main = call.slots[1 if asking else 0]
        call.replicas = call.slots[-1] if waits else None
        packed = b"".join(commands)  # the command itself when alone
        self.calls[index] = call
        self.sent[index] = True
        self.why_not[index] = None
        self.reactor.send(endpoint, packed, call.slots)

    # -- replies (with the reactor's lock held) ----------------------------------------------

    def deliver(self, slot: Slot) -> Callable[[], object] | None:
        call: NodeCall = slot.tag
        # A call is taken once, with its last slot: the slots of one call are answered in order
        # (all of them, when its connection fails), often several in one read.
        if self.calls[call.index] is not call or slot is not call.slots[-1]:
            return None  # a superseded call, or the rest of its replies is still to come
        assert call.main is not None
        reply = call.main.reply
        if (
            isinstance(reply, ErrorReply)
            and (
                reply.code in _FOLLOWED
                or (reply.code == "TRYAGAIN" and self.script.alone and not call.alone)
            )
            and self.follow_ups_left[call.index] > 0
        ):
            if not self.finished:
                self.follow_ups_left[call.index] -= 1
                if not self.attended:  # followed by the reactor thread, once its lock is free
                    return lambda: self._follow(call, reply)
                self.follow_ups.append((call, call.main))
                self.call_attention()
                return None
            if reply.code == "NOSCRIPT":
                return self._late_noscript(call, reply)
        self._take(call)
        return None

    def _late_noscript(self, call: NodeCall, reply: ErrorReply) -> Callable[[], object] | None:
        """A NOSCRIPT read after the round was finished: the member did not run the call, and
        the server is not at fault (it lost its scripts). A member of a round that succeeded
        runs it anyway (with the source), so that it holds what the others do — but only if
        nothing was queued to it since (a release sent behind the call must not be overtaken),
        and queued at once, ahead of the requests callers posted meanwhile."""
        self._settle(call.index, f"answered after the round decided: {reply}")
        main = call.main
        assert main is not None
        channel = main.channel
        if (
            self.successes >= self.quorum
            and channel is not None
            and channel.queued == main.queued_as
        ):
            packed = self._packed(by_source=True, alone=call.alone)
            return lambda: self.reactor.send_at_once(call.endpoint, packed, [Slot(None, "late")])
        return None

    def _send_unattended(self, call: NodeCall, reply: object) -> None:
        """A round that succeeded while a member's NOSCRIPT was still to be followed: the member
        runs the call anyway (with the source, unattended), so that it holds what the others do.
        Sent before the round returns: ahead of whatever the caller sends next (a release)."""
        noscript = isinstance(reply, ErrorReply) and reply.code == "NOSCRIPT"
        if noscript and self.successes >= self.quorum:
            packed = self._packed(by_source=True)
            self.reactor.send(call.endpoint, packed, [Slot(None, "late")])

    def _take(self, call: NodeCall) -> None:
        assert call.main is not None
        index, reply, endpoint = call.index, call.main.reply, call.endpoint
        node = self.nodes[index]
        if call.main.failure:
            node.notice_failure(endpoint)
            self._owe(index, endpoint)
            self._settle(index, call.main.failure)
            return
        asked = call.slots[0].reply  # after ASKING: the reply to ASKING
        if call.main is not call.slots[0] and isinstance(asked, ErrorReply):
            reply = asked  # ASKING refused (an ACL without +asking): that is the answer
        if isinstance(reply, ErrorReply):
            node.notice(reply, endpoint)  # MOVED, READONLY...: the member learns anew
            if reply.code in ("MOVED", "ASK", "TRYAGAIN"):
                # The slot is being moved (TRYAGAIN: its keys are split between two masters for
                # a moment): no answer this round, and no fault of the server's.
                self._settle(index, f"the slot is moving: {reply}")
            else:
                endpoint.mark_down(time.monotonic(), f"error reply: {reply}")
                self._owe(index, endpoint)
                self._settle(index, endpoint.last_error)
            return
        verdict = self.judge(reply)
        if verdict is None:
            why = f"a reply the {self.script.name} script cannot give: {reply!r:.80}"
            endpoint.mark_down(time.monotonic(), why)
            self._settle(index, endpoint.last_error)
            return
        if verdict and call.replicas is not None:
            acknowledged = call.replicas.reply
            if isinstance(acknowledged, ErrorReply):  # WAIT refused (an ACL without +wait)
                endpoint.mark_down(time.monotonic(), f"error reply: {acknowledged}")
                self._settle(index, endpoint.last_error)
                return
            if not isinstance(acknowledged, int) or acknowledged < node.wait_replicas:
                node.notice_failure(endpoint)  # a failover may have left the master alone
                self._settle(
                    index,
                    f"{acknowledged if isinstance(acknowledged, int) else 'no'} of "
                    f"{node.wait_replicas} replicas acknowledged the write in time",
                )
                return
        if verdict and self.grants and (why := node.vouches_for(endpoint)):
            self._settle(index, why)
            return
        self.replies[index] = reply
        self.answered += 1
        self.outstanding -= 1
        if verdict:
            self.successes += 1
        else:
            self.failures += 1
        self._check()

    def _settle(self, index: int, why: str) -> None:
        self.why_not[index] = why
        self.failures += 1
        self.outstanding -= 1
        self._check()

    def _check(self) -> None:
        if not self.satisfied and self.decided():
            self.satisfy()

    def decided(self) -> bool:
        """True once the outcome is known: a quorum succeeded, a majority refused, or no quorum
        can succeed and every reply in flight has been read."""
        if self.outstanding <= 0:
            return True
        if self.every:
            return False
        quorum = self.quorum
        if self.successes >= quorum:
            return True
        if self.failures < len(self.nodes) - quorum + 1:
            return False
        return self.answered >= quorum

    def collect(self) -> None:
        """Wait for replies until the outcome is known or node_timeout has passed (counted from
        the last send), following redirections and script loads on the way. Once the deadline
        passed, the reactor reads every socket once more before the round gives up on the
        members still silent: on a busy host their replies may have arrived in time, unread
        while the reactor thread waited for a CPU."""
        reactor = self.reactor
        looked = False
        while True:
            reactor.wait(self, self.deadline)
            if self.satisfied and not self.attention:
                return  # satisfied is set once and for all: no lock needed to read it
            with reactor.lock:
                follow_ups, self.follow_ups = self.follow_ups, []
                self.attention = False
                satisfied = self.satisfied
            if satisfied:
                for call, slot in follow_ups:
                    self._send_unattended(call, slot.reply)
                return
            if follow_ups:
                for call, slot in follow_ups:
                    self._follow(call, slot.reply)
                self.deadline = max(self.deadline, time.monotonic() + self.patience)
                continue
            if time.monotonic() >= self.deadline:
                if looked:
                    break
                looked = True
                reactor.look(self.patience)
        self._time_out()

    def _follow(self, call: NodeCall, reply: ErrorReply) -> None:
        index, alone = call.index, call.alone
        node = self.nodes[index]
        if reply.code == "NOSCRIPT":
            # The server lost its script cache (restart, SCRIPT FLUSH): send the source.
            packed = self._packed(by_source=True, alone=alone)
            self._send(index, node, call.endpoint, packed, asking=False, alone=alone)
            return
        if reply.code == "TRYAGAIN":
            # The slot is half migrated: its keys are split between two servers, which no
            # script can span. The script runs on the lock key alone, wherever that lives now.
            endpoint = node.endpoint_for(self.key)
            if endpoint is not None:
                packed = self._packed(by_source=self.by_source, alone=True)
                self._send(index, node, endpoint, packed, asking=False, alone=True)
                return
            redirect = None
        else:
            redirect = node.redirect(reply, call.endpoint)
        if redirect is None:
            with self.reactor.lock:
                self._take(call)
            return
        packed = self._packed(by_source=self.by_source, alone=alone)
        self._send(index, node, redirect.endpoint, packed, asking=redirect.asking, alone=alone)

    def _time_out(self) -> None:
        """Whoever has not answered misses this round. A server that sent nothing for the
        round's patience is backed off (the reactor fails its connection once it is silent for
        `nodes.channel.hung_after`, with every slot waiting on it). One that keeps answering,
        only late, is left alone: its late replies are read and dropped."""
        now = time.monotonic()
        waited = f"no reply within {self.patience:.3g}s"
        for call in self.calls:
            if (
                call is not None
                and call.main is not None
                and not call.main.done
                and self.reactor.silent_for(call.endpoint, now, self.patience)
            ):
                call.endpoint.mark_down(now, waited)
        with self.reactor.lock:
            for call in self.calls:
                if call is not None and not all(slot.done for slot in call.slots):
                    self.calls[call.index] = None
                    if call.endpoint.is_backed_off(now):
                        # Silent: its connection may fail before the command is read. A server
                        # that is only late reads it in order behind what it was sent before.
                        self._owe(call.index, call.endpoint)
                    if call.main is not None and call.main.done and call.replicas is not None:
                        why = f"its replicas did not acknowledge within {self.patience:.3g}s"
                        self._settle(call.index, f"{why} (WAIT)")
                    else:
                        self._settle(call.index, waited)
            self.finished = True

    def finish(self) -> RoundResult:
        """What the round learned; replies arriving later are read and dropped."""
        if self.outstanding <= 0:  # every member has answered or failed: nothing changes now
            self.finished = True
            return RoundResult(
                self.replies,
                self.successes,
                self.answered,
                time.monotonic(),
                self.why_not,
                self.unsent(),
            )
        with self.reactor.lock:
            self.finished = True
            # Follow-ups delivered after `collect` last looked: from now on `_late` takes them.
            follow_ups, self.follow_ups = self.follow_ups, []
            result = RoundResult(
                list(self.replies),
                self.successes,
                self.answered,
                time.monotonic(),
                list(self.why_not),
                self.unsent(),
            )
        for call, slot in follow_ups:
            self._send_unattended(call, slot.reply)
        return result

    def unsent(self) -> frozenset[int]:
        """The members the command never went to (backed off, or not located)."""
        if all(self.sent):
            return frozenset()
        return frozenset(index for index, sent in enumerate(self.sent) if not sent)
