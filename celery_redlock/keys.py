"""Lock keys for task calls: which arguments identify a piece of work, hashed.

Arguments are bound to the task's signature with defaults applied, so ``f(1)`` and ``f(x=1)``
give the same key; they are encoded as canonical JSON (sorted keys, with tagged forms for UUID,
datetime, date, time, Decimal, bytes and sets) and hashed with SHA-256. Raw argument values
never reach Redis.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import inspect
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import ConfigurationError, RedlockError

LockKey = str | Callable[..., str] | None


class LockKeyError(RedlockError, TypeError):
    """The arguments of a call cannot be turned into a lock key (the message names the fix)."""


def _encode_special(value: Any) -> Any:
    if isinstance(value, uuid.UUID):
        return {"$uuid": str(value)}
    if isinstance(value, datetime.datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, datetime.date):
        return {"$date": value.isoformat()}
    if isinstance(value, datetime.time):
        return {"$time": value.isoformat()}
    if isinstance(value, decimal.Decimal):
        return {"$decimal": str(value)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, (set, frozenset)):
        return {"$set": sorted(canonical_json(item) for item in value)}
    raise TypeError(type(value).__name__)


def canonical_json(value: Any) -> str:
    """One stable JSON text per value: equal inputs give equal texts, whatever their key order."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_encode_special
    )


def digest(text: str) -> str:
    """The SHA-256 hex digest of ``text``."""
    return hashlib.sha256(text.encode()).hexdigest()


def bind_arguments(
    signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any], task_name: str
) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults included."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise LockKeyError(
            f"cannot derive the lock key of task {task_name!r}: the call does not match its "
            f"signature{signature} ({error})"
        ) from error
    bound.apply_defaults()
    return dict(bound.arguments)


def check_lock_args(signature: inspect.Signature, lock_args: Sequence[str], task_name: str) -> None:
    """Raise `ConfigurationError` unless every name in ``lock_args`` is a parameter."""
    unknown = [name for name in lock_args if name not in signature.parameters]
    if unknown:
        raise ConfigurationError(
            f"lock_args of task {task_name!r} names {unknown}, which are not parameters of "
            f"{task_name}{signature}; list parameter names, or use lock_args=() to lock on the "
            "task name alone"
        )


def resource_for_call(
    task_name: str,
    signature: inspect.Signature,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    lock_args: Sequence[str] | None,
    lock_key: LockKey,
) -> str:
    """The lock resource of one call (the key prefix is added by `Redlock`).

    - ``lock_key`` set: ``"key:" + sha256(rendered key)``, shared by every task rendering the same
      key (a template is formatted with the bound arguments; a callable gets the raw call);
    - ``lock_args == ()``: the task name alone;
    - otherwise: ``task name + ":" + sha256(canonical JSON of the chosen arguments)``.
    """
    if callable(lock_key):
        rendered = lock_key(*args, **kwargs)
        if not isinstance(rendered, str):
            raise LockKeyError(
                f"lock_key callable of task {task_name!r} returned {type(rendered).__name__}; "
                "it must return a str"
            )
        return "key:" + digest(rendered)
    if lock_args is not None and len(lock_args) == 0 and lock_key is None:
        return task_name
    arguments = bind_arguments(signature, args, kwargs, task_name)
    if isinstance(lock_key, str):
        try:
            rendered = lock_key.format(**arguments)
        except (KeyError, IndexError, AttributeError, ValueError) as error:
            raise LockKeyError(
                f"lock_key {lock_key!r} of task {task_name!r} cannot be formatted with the "
                f"arguments {sorted(arguments)} ({error!r}); use only parameter names in braces"
            ) from error
        return "key:" + digest(rendered)
    if lock_args is not None:
        arguments = {name: arguments[name] for name in lock_args}
    try:
        text = canonical_json(arguments)
    except (TypeError, ValueError) as error:
        culprit = _first_unencodable(arguments)
        raise LockKeyError(
            f"argument {culprit!r} of task {task_name!r} cannot be encoded into a lock key "
            f"({error}); name the arguments that identify the work with lock_args=(...), or "
            "give lock_key='template {argument}' or a callable returning a str"
        ) from error
    return f"{task_name}:{digest(text)}"


def _first_unencodable(arguments: Mapping[str, Any]) -> str:
    for name, value in arguments.items():
        try:
            canonical_json(value)
        except (TypeError, ValueError):
            return name
    return "?"
