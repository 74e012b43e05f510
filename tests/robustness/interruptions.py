"""Where an exception raised in a thread can land the way a signal handler's can (the exception
nemesis's trace faults, and tests/test_interrupted_everywhere.py): never where it would skip the
clean-up of a ``try`` or ``with`` block, which no signal handler can do."""

from __future__ import annotations

import dis
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from functools import cache
from types import CodeType, FrameType
from typing import Any


@cache
def handlers(code: CodeType) -> dict[int, int]:
    """For each instruction of ``code`` that an exception handler covers (by offset), the
    handler's own offset (CPython 3.11 and later: one entry of the exception table covers it)."""
    covering: dict[int, int] = {}
    entries = dis.Bytecode(code).exception_entries  # type: ignore[attr-defined]  # not in typeshed
    for entry in entries:
        for offset in range(entry.start, entry.end, 2):
            covering[offset] = entry.target
    return covering


def handling(code: CodeType, offset: int) -> list[int]:
    """The handlers an exception raised at ``offset`` passes through in ``code``, innermost
    first: the one covering it, then the one covering that one's code, and so on."""
    chain: list[int] = []
    covering = handlers(code)
    target = covering.get(offset)
    while target is not None and target not in chain:
        chain.append(target)
        target = covering.get(target)
    return chain


def escapes_a_block(code: CodeType, previous: int | None, offset: int) -> bool:
    """True when an exception raised at instruction ``offset`` would skip a handler (of a ``try``,
    or the ``__exit__`` of a ``with``) that covered ``previous``, the instruction run just before.

    CPython leaves a few instructions at the edges of a block uncovered, or covered only by an
    outer block: the call of a ``with``'s ``__exit__`` (a new line event at the ``with``
    statement's line), the NOP of a ``try:``, a ``break``, the end of a ``for`` loop, a
    ``finally`` body run without an exception. An exception raised there skips the block's
    clean-up (a lock stays held for ever), which no signal handler can do: CPython runs handlers
    only on a function's entry, at a loop's back edge and right after a call returns, all of them
    inside the block. The trace function does not raise there."""
    if previous is None:
        return False
    before = handling(code, previous)
    return bool(before) and before[0] not in handling(code, offset)


# The instructions after which CPython 3.11 runs pending signal handlers: a function's entry
# (RESUME, where ``previous`` is None), a loop's back edge, and the return of a call.
CHECKS_FOR_SIGNALS = frozenset({"RESUME", "JUMP_BACKWARD", "CALL", "CALL_FUNCTION_EX"})


@cache
def opnames(code: CodeType) -> dict[int, str]:
    """Each instruction of ``code`` by offset: its operation's name."""
    return {instruction.offset: instruction.opname for instruction in dis.get_instructions(code)}


def signal_can_land(code: CodeType, previous: int | None, offset: int) -> bool:
    """True where a signal handler's exception could be raised: right after ``previous`` ran (an
    instruction after which CPython runs handlers), at ``offset`` (the next one), without
    skipping a block's clean-up (`escapes_a_block`). A trace function raising at a line event
    elsewhere (after a ``NOP`` that leaves a ``for`` loop, right before a ``with``'s
    ``__exit__`` call) does what no signal handler can."""
    if previous is not None and opnames(code).get(previous) not in CHECKS_FOR_SIGNALS:
        return False
    return not escapes_a_block(code, previous, offset)


class InstructionTracer:
    """The local trace function of one frame: it follows the frame's instructions (opcode
    events) and calls ``at(frame, previous)`` before each one runs (at its line event and at its
    opcode event), ``previous`` the offset of the instruction run before it (None at the
    frame's first)."""

    __slots__ = ("at", "previous")

    def __init__(self, at: Callable[[FrameType, int | None], None]) -> None:
        self.at = at
        self.previous: int | None = None

    def __call__(self, frame: FrameType, event: str, argument: Any) -> InstructionTracer:
        if event in ("opcode", "line"):
            self.at(frame, self.previous)
        if event == "opcode":
            self.previous = frame.f_lasti
        return self


def after_call_of(code: CodeType, name: str) -> int:
    """The offset of the instruction right after ``code`` first calls something named ``name``
    (a function, or a method as ``object.name(...)``): where a handler's exception lands once
    that call returned."""
    instructions = list(dis.get_instructions(code))
    for index, instruction in enumerate(instructions):
        if instruction.argval == name and instruction.opname.startswith("LOAD"):
            for following in range(index, len(instructions)):
                if instructions[following].opname in ("CALL", "CALL_FUNCTION"):
                    return instructions[following + 1].offset
    raise AssertionError(f"{code.co_name} calls nothing named {name!r}")


@contextmanager
def raising_once(
    codes: Collection[CodeType],
    where: Callable[[FrameType, int | None], bool],
    exception: BaseException,
    threads: bool = False,
) -> Iterator[list[str]]:
    """Raise ``exception`` once, before the first instruction of a function of ``codes`` at which
    ``where(frame, previous)`` is true (``previous``: the offset of the instruction run before
    it in that frame, None at the frame's first), the way a signal handler's exception is
    raised. In this thread, or with ``threads`` in the threads started from now on instead.
    Yields a list that names where it raised (``"function at offset N"``) once it did."""
    raised: list[str] = []

    def tracer(frame: FrameType, event: str, argument: Any) -> Callable[..., Any] | None:
        if frame.f_code not in codes or raised:
            return None
        previous: int | None = None

        def local(frame: FrameType, event: str, argument: Any) -> Callable[..., Any] | None:
            nonlocal previous
            if event != "opcode" or raised:
                return local
            offset, before, previous = frame.f_lasti, previous, frame.f_lasti
            if where(frame, before):
                raised.append(f"{frame.f_code.co_name} at offset {offset}")
                raise exception  # CPython unsets the tracing of this thread
            return local

        frame.f_trace_opcodes = True
        return local

    install = threading.settrace if threads else sys.settrace
    install(tracer)
    try:
        yield raised
    finally:
        install(None)  # type: ignore[arg-type]
