"""Ask every lock node one question at once, and never trust what a node answers.

The operators' commands talk to the nodes only through `ask_every_node`: one thread per node,
each with its own connection whose every command is bounded by the caller's timeout. A question
is a function of a `NodeClient`, which hands back each reply exactly as the node sent it (no
redis-py reply parsing, which breaks on replies a Redis server never gives); the question checks
the replies it reads (`expect_text`, `expect_integer`, `BadReply`). Whatever a node does — no
answer, error replies, replies of the wrong type or shape, bytes that are not RESP, a connection
it closes — ends as that node's one-line error (`NodeAnswer.error`), never as an exception out of
`ask_every_node`. A command an ACL denies is named, with the ``ACL SETUSER`` grant that fixes it.

A node may be several servers (a Redis Cluster: a master per range of hash slots): a question
reads every server (`NodeClient.servers`) or the one that holds a key (`NodeClient.server_for`,
`NodeClient.call_for_key`, which follows ``MOVED`` and ``ASK``), and the node answers once, as
one node; an error names the server that gave it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

from redis.exceptions import AskError, MovedError, NoPermissionError, ResponseError
from redis.exceptions import RedisError as RedisClientError

from ..lock.nodes import Endpoint, ErrorReply, LockNode

Answer = TypeVar("Answer")

DENIED_COMMAND = re.compile(r"'([^']+)' command")
SCRIPT_DENIED = "The user executing the script can't run this command"
REDIRECTIONS_LIMIT = 3  # MOVED to the new master, then ASK while its slot is being moved


class BadReply(Exception):
    """A reply that no Redis server gives to that command: the node is broken, or not Redis."""

    def __init__(self, command: str, reply: Any, expected: str) -> None:
        shown = repr(reply)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        super().__init__(f"bad reply to {command}: {shown}, not {expected}")


@dataclass(frozen=True)
class NodeAnswer(Generic[Answer]):
    """One node's answer to a question: ``value``, or ``error`` (one line) when it has none."""

    node: str
    value: Answer | None = None
    error: str | None = None


class ServerClient:
    """One server's connection while it answers a question: raw replies, checked by the caller.

    ``node`` is the server's name (passwords redacted), ``user`` the ACL user its URL logs in
    as (``<user>`` when it names none: the ``redlock_username`` setting, or Redis's default
    user).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        timeout: float,
        user: str,
        on_use: Callable[[ServerClient], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.node = endpoint.name
        self.user = user
        self.on_use = on_use  # told before every command (which server a failure is about)
        self._client = endpoint.client(timeout=timeout)
        # Replies as the node sent them: redis-py's parsing raises arbitrary errors on garbage.
        self._client.response_callbacks.clear()

    def call(self, *arguments: str | int | bytes) -> Any:
        """Send one command and return its reply; an error reply raises `ResponseError`."""
        if self.on_use is not None:
            self.on_use(self)
        return self._client.execute_command(*arguments)

    def pipeline(self, commands: Sequence[Sequence[str | int | bytes]]) -> list[Any]:
        """Send ``commands`` in one write and return their replies in order, an error reply as
        a `ResponseError` in its place."""
        if self.on_use is not None:
            self.on_use(self)
        pipeline = self._client.pipeline(transaction=False)
        for command in commands:
            pipeline.execute_command(*command)
        return list(pipeline.execute(raise_on_error=False))

    def close(self) -> None:
        """Close the connection."""
        with contextlib.suppress(RedisClientError, OSError):
            self._client.close()


class NodeClient:
    """One lock node while it answers a question: its servers' connections (opened on first
    use), for raw replies checked by the caller.

    A lock node may be several servers: a Redis Cluster keeps each key on the master of its
    hash slot. `servers` gives every server that holds the node's keys now, `server_for` the one
    that holds a key, and `call_for_key` follows the cluster's redirections (``MOVED``,
    ``ASK``) on the way. `call` and `pipeline` go to the node's first server: for questions
    about a standalone server. ``user`` is the ACL user the node's URL logs in as (``<user>``
    when it names none).
    """

    def __init__(self, node: LockNode, timeout: float) -> None:
        self.member = node
        self.node = node.name
        self.user = urlsplit(node.name).username or "<user>"
        self.timeout = timeout
        self.last_server = ""  # the server asked last: named when a node of several fails
        self._servers: dict[int, ServerClient] = {}

    def on(self, endpoint: Endpoint) -> ServerClient:
        """The connection to one of the node's servers (opened on first use)."""
        server = self._servers.get(id(endpoint))
        if server is None:
            server = ServerClient(endpoint, self.timeout, self.user, self._used)
            self._servers[id(endpoint)] = server
        return server

    def _used(self, server: ServerClient) -> None:
        self.last_server = server.node

    def servers(self) -> list[ServerClient]:
        """Every server that holds the node's keys now (a cluster's masters; one otherwise).
        Raises `ConnectionError` when the node cannot tell (a cluster whose slot map cannot be
        read, sentinels that name no master)."""
        endpoints = self.member.endpoints()
        if not endpoints:
            raise ConnectionError(self.member.locating_error())
        return [self.on(endpoint) for endpoint in endpoints]

    def server_for(self, key: str) -> ServerClient:
        """The server that holds ``key`` now, by the node's own routing."""
        endpoint = self.member.endpoint_for(key)
        if endpoint is None:
            raise ConnectionError(self.member.locating_error())
        return self.on(endpoint)

    def call_for_key(self, key: str, *arguments: str | int | bytes) -> Any:
        """Send one command about ``key`` to the server that holds it, following redirections
        (a slot that moved, or is being moved); an error reply raises `ResponseError`."""
        server = self.server_for(key)
        asking = False
        for _ in range(REDIRECTIONS_LIMIT):
            try:
                if not asking:
                    return server.call(*arguments)
                reply = server.pipeline([("ASKING",), arguments])[1]
                if isinstance(reply, ResponseError):
                    raise reply
                return reply
            except AskError as error:  # MovedError too
                server, asking = self.redirected(error, server)
        return server.call(*arguments)

    def redirected(self, error: AskError, server: ServerClient) -> tuple[ServerClient, bool]:
        """Where a ``MOVED`` or ``ASK`` reply of ``server`` sends the command, and whether it
        must go after ``ASKING``; the error itself when the node does not follow it."""
        code = "MOVED" if isinstance(error, MovedError) else "ASK"
        reply = ErrorReply(f"{code} {error.slot_id} {error.host}:{error.port}")
        redirect = self.member.redirect(reply, server.endpoint)
        if redirect is None:
            raise error
        return self.on(redirect.endpoint), redirect.asking

    def call(self, *arguments: str | int | bytes) -> Any:
        """Send one command to the node's first server and return its reply; an error reply
        raises `ResponseError`."""
        return self.servers()[0].call(*arguments)

    def pipeline(self, commands: Sequence[Sequence[str | int | bytes]]) -> list[Any]:
        """Send ``commands`` to the node's first server in one write and return their replies
        in order, an error reply as a `ResponseError` in its place."""
        return self.servers()[0].pipeline(commands)

    def close(self) -> None:
        """Close every connection."""
        for server in self._servers.values():
            server.close()
        self._servers.clear()


def ask_every_node(
    nodes: Sequence[LockNode], question: Callable[[NodeClient], Answer], timeout: float
) -> list[NodeAnswer[Answer]]:
    """Ask every node ``question`` at once, each command bounded by ``timeout`` seconds; one
    `NodeAnswer` per node, in ``nodes`` order. Never raises for what a node does."""

    def ask(node: LockNode) -> NodeAnswer[Answer]:
        client = NodeClient(node, timeout)
        try:
            return NodeAnswer(node.name, value=question(client))
        except BadReply as error:
            return NodeAnswer(node.name, error=where(client, str(error)))
        except (RedisClientError, OSError) as error:
            return NodeAnswer(node.name, error=where(client, describe_error(error, client.user)))
        except Exception as error:  # what a parser makes of garbage: the node's fault, not ours
            why = f"unreadable reply ({describe_error(error)})"
            return NodeAnswer(node.name, error=where(client, why))
        finally:
            client.close()

    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="redlock-admin") as pool:
        return list(pool.map(ask, nodes))


def where(client: NodeClient, error: str) -> str:
    """``error``, naming the server that gave it when the node is several servers."""
    if client.last_server and client.last_server != client.node:
        return f"{client.last_server}: {error}"
    return error


def describe_error(error: BaseException, user: str = "<user>") -> str:
    """One line about a connection or command error. An ACL denial says what the node's
    ``user`` may not do, and the ``ACL SETUSER`` grant that allows it."""
    fix = access_fix(error, user)
    if fix is not None:
        return fix
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def access_fix(error: BaseException, user: str) -> str | None:
    """For an error reply an ACL causes, what is denied and how to grant it; else None."""
    error_text = str(error)
    if isinstance(error, NoPermissionError) or error_text.startswith("NOPERM"):
        command = DENIED_COMMAND.search(error_text)
        if command is not None:
            name = command.group(1)
            return f"the node's user may not run '{name}'; grant it with ACL SETUSER {user} +{name}"
        if "key" in error_text:
            return (
                "the node's user may not access these keys; grant it the key prefix with "
                f"ACL SETUSER {user} ~<key prefix>*"
            )
        if "channel" in error_text:
            return (
                "the node's user may not use the release channels; grant them with "
                f"ACL SETUSER {user} &<key prefix>*"
            )
        return f"NOPERM {error_text} (an ACL denial: see ACL GETUSER {user})"
    if isinstance(error, ResponseError) and SCRIPT_DENIED in error_text:
        return (
            "the node's user may not run a command inside the script; grant the read, write "
            f"and scripting commands with ACL SETUSER {user} +@read +@write +@scripting"
        )
    return None


def text(value: Any) -> str:
    """A reply's bytes as text (invalid UTF-8 replaced)."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def expect_text(reply: Any, command: str) -> str:
    """``reply`` as text when it is a string reply; else `BadReply`."""
    if isinstance(reply, (bytes, str)):
        return text(reply)
    raise BadReply(command, reply, "a string")


def expect_integer(reply: Any, command: str) -> int:
    """``reply`` when it is an integer reply; else `BadReply`."""
    if isinstance(reply, int) and not isinstance(reply, bool):
        return reply
    raise BadReply(command, reply, "an integer")
