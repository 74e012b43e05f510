"""The Redis protocol (RESP2) on the wire: commands encoded once for every node, and replies
parsed incrementally from whatever bytes have arrived, so that one read can carry the replies of
many callers' pipelined commands. Replies are parsed by hiredis where it is installed (the
``hiredis`` extra, as redis-py does; about 2 µs less per reply), else in Python.

A parser (`ReplyParser`) turns the bytes read from one connection into replies, in order: `feed`
adds bytes; `next_reply` returns the next complete reply, or `INCOMPLETE` when the bytes so far end
inside one. Status replies are ``bytes`` (``b"OK"``), bulk strings ``bytes``, nil ``None``,
integers ``int``, arrays ``list``, errors `ErrorReply`. It raises `ProtocolError` on bytes that
are not RESP, and on a reply still incomplete after `REPLY_LIMIT` bytes."""

from __future__ import annotations

from typing import Any, cast

try:
    import hiredis
except ImportError:  # the hiredis extra is not installed
    hiredis = None  # type: ignore[assignment]

REPLY_LIMIT = 1_000_000
"""Bytes a reply may take before it is complete: a node sending more is not answering a lock
script (whose replies are a few hundred bytes), and is not buffered for ever."""


def pack_arguments(*arguments: str | int | bytes) -> bytes:
    """The arguments as RESP bulk strings, without the array header: for a part that several
    commands share (a script's ``EVALSHA <sha>``), encoded once (`pack_command`)."""
    if bytes not in map(type, arguments):
        # Every round packs its call here: text and numbers in one string, encoded once (where
        # every character is one byte, a length in characters is one in bytes).
        text = "".join([f"${len(part)}\r\n{part}\r\n" for part in map(str, arguments)])
        if text.isascii():
            return text.encode()
    parts: list[bytes] = []
    for argument in arguments:
        if argument.__class__ is not bytes:
            argument = str(argument).encode()
        parts += (b"$%d\r\n" % len(argument), argument, b"\r\n")
    return b"".join(parts)


def pack_command(*arguments: str | int | bytes, head: bytes = b"", head_count: int = 0) -> bytes:
    """Encode one command in RESP, the same bytes for every node. ``head`` holds the first
    ``head_count`` arguments already packed (`pack_arguments`)."""
    return b"*%d\r\n" % (head_count + len(arguments)) + head + pack_arguments(*arguments)


class ErrorReply:
    """An error reply (``-ERR ...``, ``-NOSCRIPT ...``, ``-MOVED 3999 host:port``...), kept as a
    value: it is the answer to one command, not a failure of the connection. ``code`` is its
    first word."""

    __slots__ = ("code", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.code = text.partition(" ")[0]

    def __repr__(self) -> str:
        return f"ErrorReply({self.text!r})"

    def __str__(self) -> str:
        return self.text


class ProtocolError(Exception):
    """The bytes from a node are not RESP: the connection can no longer be trusted."""


class NeedMore(Exception):
    """The buffer ends inside a reply (raised by the parser, never outside this module)."""


def new_reply_parser() -> ReplyParser:
    """A parser for one connection: hiredis's where it is installed, else `PythonReplyParser`."""
    return PythonReplyParser() if hiredis is None else HiredisReplyParser()


class HiredisReplyParser:
    """A `ReplyParser` on hiredis's reader (C): the same replies from well-formed RESP."""

    __slots__ = ("_reader",)

    def __init__(self) -> None:
        # Any callable will do for replyError (the stubs ask for an exception): the reader
        # returns what it builds.
        self._reader = hiredis.Reader(replyError=cast(Any, ErrorReply), notEnoughData=INCOMPLETE)

    def feed(self, data: bytes) -> None:
        self._reader.feed(data)

    def next_reply(self) -> Any:
        try:
            reply = self._reader.gets()
        except hiredis.ProtocolError as error:
            raise ProtocolError(str(error)) from None
        if reply is INCOMPLETE and self._reader.len() > REPLY_LIMIT:
            raise ProtocolError(f"a reply longer than {REPLY_LIMIT} bytes")
        return reply


class PythonReplyParser:
    """A `ReplyParser` in Python, for where hiredis is not installed."""

    __slots__ = ("_buffer", "_position")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._position = 0

    def feed(self, data: bytes) -> None:
        if self._position:
            del self._buffer[: self._position]
            self._position = 0
        self._buffer += data

    def next_reply(self) -> Any:
        if self._position >= len(self._buffer):
            return INCOMPLETE
        try:
            reply, self._position = self._parse(self._position)
        except NeedMore:
            if len(self._buffer) - self._position > REPLY_LIMIT:
                raise ProtocolError(f"a reply longer than {REPLY_LIMIT} bytes") from None
            return INCOMPLETE
        return reply

    def _parse(self, start: int) -> tuple[Any, int]:
        end = self._buffer.find(b"\r\n", start)
        if end < 0:
            raise NeedMore
        line, position = bytes(self._buffer[start:end]), end + 2
        if not line:
            raise ProtocolError("an empty reply line")
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest, position
        if kind == b":":
            return self._integer(rest), position
        if kind == b"$":
            length = self._integer(rest)
            if length < 0:
                return None, position
            end = position + length
            if len(self._buffer) < end + 2:
                raise NeedMore
            if self._buffer[end : end + 2] != b"\r\n":
                raise ProtocolError("a bulk string without its end")
            return bytes(self._buffer[position:end]), end + 2
        if kind == b"*":
            count = self._integer(rest)
            if count < 0:
                return None, position
            items = []
            for _ in range(count):
                item, position = self._parse(position)
                items.append(item)
            return items, position
        if kind == b"-":
            return ErrorReply(rest.decode(errors="replace")), position
        raise ProtocolError(f"a reply starting with {line[:20]!r}")

    @staticmethod
    def _integer(text: bytes) -> int:
        try:
            return int(text)
        except ValueError:
            raise ProtocolError(f"{text[:20]!r} is not a number") from None


ReplyParser = HiredisReplyParser | PythonReplyParser


class _Incomplete:
    def __repr__(self) -> str:
        return "INCOMPLETE"


INCOMPLETE: Any = _Incomplete()
"""What `ReplyParser.next_reply` returns while the next reply has not fully arrived."""
