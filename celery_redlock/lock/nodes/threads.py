"""Starting a background thread from a caller that a signal handler may interrupt
(`start_thread`).

A handler raising in the caller (Celery's soft time limit, SIGALRM, Ctrl-C: they run in the main
thread, between any two bytecodes) can interrupt ``Thread.start`` after the new thread began,
which then may run or not. So whether a thread runs is learnt from the thread itself (the lock
the reactor's holds while it runs) or from `start_thread` returning (the keeper's thread); a
claim written before the start, for other callers to see (a locator's look, a server's probe),
is dropped when the start raises, or lapses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def start_thread(target: Callable[..., object], *arguments: object, name: str) -> threading.Thread:
    """Start and return a daemon thread named ``name`` running ``target(*arguments)``.

    An exception raised by a signal handler during the start propagates as itself (not as the
    ``KeyError`` CPython may turn it into), and the thread may then run or not."""
    thread = threading.Thread(target=target, args=arguments, name=name, daemon=True)
    try:
        thread.start()
    except KeyError as error:
        # `Thread.start` interrupted right after the new thread registered itself undoes that
        # registration a second time: the interruption surfaces as this KeyError, chained.
        if error.__context__ is None:
            raise
        raise error.__context__ from None
    return thread
