"""Lock keys for task calls: which arguments identify a piece of work, hashed.

Arguments are bound to the task's signature with defaults applied (``f(1)`` and ``f(x=1)`` give
one key), encoded as canonical JSON (sorted keys; tagged forms for UUID, datetime, date, time,
Decimal, bytes, sets, dicts with keys that are not strings, and an errback's request) and hashed
with SHA-256: raw argument values never reach Redis.

Keys depend on values *as the worker receives them*: at enqueue time (``lock_on_enqueue``) the
arguments first go through the task's serializer and back (`as_delivered`). Numbers keep their
type (``1``, ``1.0`` and ``Decimal("1")`` are three keys; ``True`` is not ``1``); tuples and lists
are the same sequence.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import inspect
import json
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery.app.task import Context
from kombu import serialization

from ..errors import ConfigurationError, RedlockError

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
    if isinstance(value, Context):
        # An errback's first argument: the failed task's request. Its id names the work.
        return {"$request": value.id}
    if isinstance(value, BaseException):
        return {"$exception": type(value).__qualname__}
    raise TypeError(type(value).__name__)


_SCALARS = (str, int, float, bool, type(None))

MAX_NESTING = 100


class TooDeep(ValueError):
    """An argument nests lists or dicts more than `MAX_NESTING` levels deep."""


def _with_typed_keys(value: Any, depth: int = 0) -> Any:
    """``value`` with every dict whose keys are not all strings tagged, so that ``{1: "a"}`` and
    ``{"1": "a"}`` (different calls under pickle or msgpack) differ.
    `TooDeep` past `MAX_NESTING` levels (a self-referencing list would recurse for ever)."""
    if isinstance(value, _SCALARS):
        return value
    if depth >= MAX_NESTING:
        raise TooDeep(f"nested more than {MAX_NESTING} levels deep")
    depth += 1
    if isinstance(value, dict):
        items = [(key, _with_typed_keys(item, depth)) for key, item in value.items()]
        if all(isinstance(key, str) for key in value):
            return dict(items)
        pairs = [[canonical_json(key), item] for key, item in items]
        return {"$dict": sorted(pairs, key=lambda pair: pair[0])}
    if isinstance(value, (list, tuple)):
        return [_with_typed_keys(item, depth) for item in value]
    return value


# Built once: json.dumps with options would build an encoder on every call (keys are derived for
# every run).
_CANONICAL_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_encode_special
)


def canonical_json(value: Any) -> str:
    """One stable JSON text per value: equal calls give equal texts, whatever their key order."""
    return _CANONICAL_ENCODER.encode(_with_typed_keys(value))


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def as_delivered(
    args: Sequence[Any], kwargs: Mapping[str, Any], serializer: str
) -> tuple[list[Any], dict[str, Any]]:
    """The arguments as a worker receives them: through ``serializer`` and back."""
    content_type, encoding, body = serialization.dumps([list(args), dict(kwargs)], serializer)
    delivered_args, delivered_kwargs = serialization.loads(
        body, content_type, encoding, accept=[content_type]
    )
    return list(delivered_args), dict(delivered_kwargs)


def run_signature(task_class: type) -> inspect.Signature:
    """The signature callers use: without ``self`` for ``bind=True`` tasks."""
    run = inspect.getattr_static(task_class, "run")
    if isinstance(run, staticmethod):
        return inspect.signature(run.__func__)
    signature = inspect.signature(run)
    parameters = list(signature.parameters.values())[1:]
    return signature.replace(parameters=parameters)


def check_key_options(
    signature: inspect.Signature | None,
    lock_args: Sequence[str] | None,
    lock_key: LockKey,
    task_name: str,
) -> None:
    """Raise `ConfigurationError` unless the options can key every call of the task (the
    signature is checked when known)."""
    if lock_args is not None and lock_key is not None:
        raise ConfigurationError(
            f"task {task_name!r} sets both lock_args and lock_key; lock_key replaces lock_args, "
            "so give only one of them"
        )
    if signature is None:
        return
    parameters = signature.parameters
    takes_any_keyword = any(
        parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()
    )
    if lock_args is not None:
        unknown = [name for name in lock_args if name not in parameters]
        if unknown:
            raise ConfigurationError(
                f"lock_args of task {task_name!r} names {unknown}, which are not parameters of "
                f"{task_name}{signature}; list parameter names, or use lock_args=() to lock on "
                "the task name alone"
            )
    if isinstance(lock_key, str):
        parsed = string.Formatter().parse(lock_key)  # "{a.b}" refers to the argument a
        fields = [
            name.split(".", 1)[0].split("[", 1)[0] for _, name, _, _ in parsed if name is not None
        ]
        unknown = [name for name in fields if name not in parameters or name.isdigit()]
        if unknown and not takes_any_keyword:
            raise ConfigurationError(
                f"lock_key {lock_key!r} of task {task_name!r} refers to {unknown}, which are not "
                f"parameters of {task_name}{signature}; use parameter names in braces, e.g. "
                "lock_key='account:{account_id}'"
            )


_PLAIN_PARAMETER = inspect.Parameter.POSITIONAL_OR_KEYWORD


@dataclass(frozen=True)
class KeyRecipe:
    """How one task turns a call into its lock resource (the key prefix is added by `Redlock`).

    - ``lock_key`` set: ``"key:" + sha256(rendered key)``, shared by every task rendering the same
      key (a template is formatted with the bound arguments; a callable gets the raw call);
    - ``lock_args == ()``: the task name alone;
    - otherwise: ``task name + ":" + sha256(canonical JSON of the chosen arguments)``.
    """

    task_name: str
    signature: inspect.Signature
    lock_args: tuple[str, ...] | None
    lock_key: LockKey
    # For signatures of plain parameters only, binding needs no inspect.Signature.bind.
    _names: tuple[str, ...] | None = field(init=False, repr=False, compare=False)
    _name_set: frozenset[str] = field(init=False, repr=False, compare=False)
    _defaults: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parameters = list(self.signature.parameters.values())
        plain = all(parameter.kind is _PLAIN_PARAMETER for parameter in parameters)
        names = tuple(parameter.name for parameter in parameters) if plain else None
        defaults = {
            parameter.name: parameter.default
            for parameter in parameters
            if parameter.default is not inspect.Parameter.empty
        }
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_name_set", frozenset(names or ()))
        object.__setattr__(self, "_defaults", defaults)

    def resource(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The lock resource of one call; `LockKeyError` when it cannot be derived."""
        lock_key = self.lock_key
        if lock_key is None and self.lock_args is not None and not self.lock_args:
            return self.task_name
        if callable(lock_key):
            rendered = lock_key(*args, **kwargs)
            if not isinstance(rendered, str):
                raise LockKeyError(
                    f"lock_key callable of task {self.task_name!r} returned "
                    f"{type(rendered).__name__}; it must return a str"
                )
            return "key:" + digest(rendered)
        arguments = self._bind(args, kwargs)
        if isinstance(lock_key, str):
            try:
                rendered = lock_key.format(**arguments)
            except (KeyError, IndexError, AttributeError, ValueError) as error:
                raise LockKeyError(
                    f"lock_key {lock_key!r} of task {self.task_name!r} cannot be formatted with "
                    f"the arguments {sorted(arguments)} ({error!r}); use only parameter names in "
                    "braces"
                ) from error
            return "key:" + digest(rendered)
        if self.lock_args is not None:
            arguments = {name: arguments[name] for name in self.lock_args}
        try:
            text = canonical_json(arguments)
        except (TypeError, ValueError, RecursionError) as error:
            # RecursionError: sets and tagged values nest canonical_json calls of their own.
            culprit = _first_unencodable(arguments)
            raise LockKeyError(
                f"argument {culprit!r} of task {self.task_name!r} cannot be encoded into a lock "
                f"key ({error}); name the arguments that identify the work with "
                "lock_args=(...), or give lock_key='template {argument}' or a callable returning "
                "a str"
            ) from error
        return f"{self.task_name}:{digest(text)}"

    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        names = self._names
        if names is not None and len(args) <= len(names) and kwargs.keys() <= self._name_set:
            arguments = dict(zip(names, args, strict=False))  # args may be fewer: defaults
            if not kwargs.keys() & arguments.keys():
                arguments.update(kwargs)
                for name, default in self._defaults.items():
                    arguments.setdefault(name, default)
                if len(arguments) == len(names):  # every parameter, and nothing else
                    return arguments
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as error:
            raise LockKeyError(
                f"cannot derive the lock key of task {self.task_name!r}: the call does not match "
                f"its signature{self.signature} ({error})"
            ) from error
        bound.apply_defaults()
        return dict(bound.arguments)


def _first_unencodable(arguments: Mapping[str, Any]) -> str:
    for name, value in arguments.items():
        try:
            canonical_json(value)
        except (TypeError, ValueError, RecursionError):
            return name
    return "?"
