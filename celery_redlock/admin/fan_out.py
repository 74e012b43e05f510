"""Ask every lock node one question at once, and never trust what a node answers.

The operators' commands talk to the nodes only through `ask_every_node`: one thread per node,
each with its own connection whose every command is bounded by the caller's timeout. A question
is a function of a `NodeClient`, which hands back each reply exactly as the node sent it (no
redis-py reply parsing, which breaks on replies a Redis server never gives); the question checks
the replies it reads (`expect_text`, `expect_integer`, `BadReply`). Whatever a node does — no
answer, error replies, replies of the wrong type or shape, bytes that are not RESP, a connection
it closes — ends as that node's one-line error (`NodeAnswer.error`), never as an exception out of
`ask_every_node`. A command an ACL denies is named, with the ``ACL SETUSER`` grant that fixes it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

from redis.exceptions import NoPermissionError, ResponseError
from redis.exceptions import RedisError as RedisClientError

from ..nodes import LockNode

Answer = TypeVar("Answer")

DENIED_COMMAND = re.compile(r"'([^']+)' command")
SCRIPT_DENIED = "The user executing the script can't run this command"


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


class NodeClient:
    """One node's connection while it answers a question: raw replies, checked by the caller.

    ``user`` is the ACL user the node's URL logs in as (``<user>`` when it names none: the
    ``redlock_username`` setting, or Redis's default user).
    """

    def __init__(self, node: LockNode, timeout: float) -> None:
        self.node = node.name
        self.user = urlsplit(node.name).username or "<user>"
        self._client = node.client(timeout=timeout)
        # Replies as the node sent them: redis-py's parsing raises arbitrary errors on garbage.
        self._client.response_callbacks.clear()

    def call(self, *arguments: str | int | bytes) -> Any:
        """Send one command and return its reply; an error reply raises `ResponseError`."""
        return self._client.execute_command(*arguments)

    def pipeline(self, commands: Sequence[Sequence[str | int | bytes]]) -> list[Any]:
        """Send ``commands`` in one write and return their replies in order, an error reply as
        a `ResponseError` in its place."""
        pipeline = self._client.pipeline(transaction=False)
        for command in commands:
            pipeline.execute_command(*command)
        return list(pipeline.execute(raise_on_error=False))

    def close(self) -> None:
        """Close the connection."""
        with contextlib.suppress(RedisClientError, OSError):
            self._client.close()


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
            return NodeAnswer(node.name, error=str(error))
        except (RedisClientError, OSError) as error:
            return NodeAnswer(node.name, error=describe_error(error, client.user))
        except Exception as error:  # what a parser makes of garbage: the node's fault, not ours
            return NodeAnswer(node.name, error=f"unreadable reply ({describe_error(error)})")
        finally:
            client.close()

    if not nodes:
        return []
    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="redlock-admin") as pool:
        return list(pool.map(ask, nodes))


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
