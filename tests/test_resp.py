"""Commands as the nodes layer writes them, and the two reply parsers of the nodes layer
(`celery_redlock.lock.nodes.resp`): hiredis's, used
where the ``hiredis`` extra is installed, and the one in Python, used elsewhere, give the same
replies from the same bytes however the reads split them, and refuse the same garbage. Pure
functions of bytes: every test with lock nodes runs one of them against real servers (hiredis in
the default suite, the Python parser in the nox sessions, which install no hiredis)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_redlock.lock.nodes.resp import (
    INCOMPLETE,
    REPLY_LIMIT,
    ErrorReply,
    HiredisReplyParser,
    ProtocolError,
    PythonReplyParser,
    ReplyParser,
    new_reply_parser,
    pack_command,
)

pytest.importorskip("hiredis")

PARSERS = [PythonReplyParser, HiredisReplyParser]


def encode(reply: Any) -> bytes:
    """RESP2 bytes of a reply as the parsers return it (a status reply is given as a tuple)."""
    if reply is None:
        return b"$-1\r\n"
    if isinstance(reply, int):
        return b":%d\r\n" % reply
    if isinstance(reply, bytes):
        return b"$%d\r\n%b\r\n" % (len(reply), reply)
    if isinstance(reply, tuple):
        return b"+%b\r\n" % reply[0]
    if isinstance(reply, ErrorReply):
        return b"-%b\r\n" % reply.text.encode()
    return b"*%d\r\n" % len(reply) + b"".join(encode(item) for item in reply)


def expected(reply: Any) -> Any:
    """What a parser returns for `encode(reply)`."""
    if isinstance(reply, tuple):
        return reply[0]
    if isinstance(reply, ErrorReply):
        return ("error", reply.text)
    if isinstance(reply, list):
        return [expected(item) for item in reply]
    return reply


def comparable(reply: Any) -> Any:
    if isinstance(reply, ErrorReply):
        return ("error", reply.text)
    if isinstance(reply, list):
        return [comparable(item) for item in reply]
    return reply


def parse_in_chunks(parser: ReplyParser, data: bytes, cuts: list[int]) -> list[Any]:
    replies = []
    start = 0
    for end in [*sorted(set(cuts)), len(data)]:
        parser.feed(data[start:end])
        start = end
        while (reply := parser.next_reply()) is not INCOMPLETE:
            replies.append(comparable(reply))
    return replies


line_text = st.binary(max_size=20).filter(lambda text: b"\r" not in text and b"\n" not in text)
replies = st.recursive(
    st.none()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.binary(max_size=40)
    | st.tuples(line_text)
    | st.builds(ErrorReply, st.text("ABCERR xyz:0123456789", min_size=1, max_size=30)),
    lambda children: st.lists(children, max_size=4),
    max_leaves=12,
)


@given(st.lists(replies, min_size=1, max_size=5), st.lists(st.integers(0, 400), max_size=8))
@pytest.mark.parametrize("parser_class", PARSERS)
def test_the_same_replies_however_the_reads_split_them(
    parser_class: type[ReplyParser], sent: list[Any], cuts: list[int]
) -> None:
    data = b"".join(encode(reply) for reply in sent)
    cuts = [cut for cut in cuts if cut < len(data)]
    assert parse_in_chunks(parser_class(), data, cuts) == [expected(reply) for reply in sent]


@pytest.mark.parametrize("parser_class", PARSERS)
@pytest.mark.parametrize(
    "garbage", [b"\r\n", b"hello, I am no Redis\r\n", b":12x\r\n", b"*two\r\n", b"$abc\r\n"]
)
def test_bytes_that_are_not_resp_are_refused(
    parser_class: type[ReplyParser], garbage: bytes
) -> None:
    parser = parser_class()
    parser.feed(garbage)
    with pytest.raises(ProtocolError):
        parser.next_reply()


@pytest.mark.parametrize("parser_class", PARSERS)
@pytest.mark.parametrize("start", [b"+", b"$2000000\r\n", b"*3\r\n:1\r\n+"])
def test_a_reply_that_never_ends_is_refused_after_the_limit(
    parser_class: type[ReplyParser], start: bytes
) -> None:
    parser = parser_class()
    parser.feed(start + b"x" * (REPLY_LIMIT // 2))
    assert parser.next_reply() is INCOMPLETE  # a long reply may still be under way
    parser.feed(b"x" * REPLY_LIMIT)
    with pytest.raises(ProtocolError):
        parser.next_reply()


def test_connections_parse_with_hiredis_where_it_is_installed() -> None:
    assert isinstance(new_reply_parser(), HiredisReplyParser)


@given(
    st.lists(
        st.one_of(st.text(), st.integers(), st.binary(), st.booleans()), min_size=1, max_size=12
    )
)
def test_a_command_is_each_argument_as_a_bulk_string_of_its_bytes(arguments: list[Any]) -> None:
    # Text is UTF-8 (a length counts bytes, not characters), bytes go as they are, numbers as
    # their decimal text: the fast path for ASCII text must write what the general one does.
    encoded = [part if isinstance(part, bytes) else str(part).encode() for part in arguments]
    expected = b"*%d\r\n" % len(encoded) + b"".join(
        b"$%d\r\n%b\r\n" % (len(part), part) for part in encoded
    )
    assert pack_command(*arguments) == expected
