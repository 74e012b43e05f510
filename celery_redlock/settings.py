"""All celery_redlock settings (``app.conf.redlock_*``, ``CELERY_REDLOCK_*`` under Django), read
once per Celery app into one validated object: a wrong value raises `ConfigurationError` naming
the setting and the fix; an unknown ``redlock_*`` name is logged naming the closest known one.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit

from .errors import ConfigurationError

DUPLICATE_POLICIES = ("skip", "retry", "raise", "wait", "coalesce")
UNAVAILABLE_POLICIES = ("retry", "raise", "run")
URL_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
_UNSET = object()
SETTING_PREFIX = "redlock_"

logger = logging.getLogger(__name__)

Value = TypeVar("Value")


@dataclass(frozen=True, repr=False)
class RedlockSettings:
    """The validated ``redlock_*`` settings of one Celery app (defaults beside the names):
    constructing one validates every field; `from_conf` reads them from a Celery ``app.conf``."""

    urls: tuple[str, ...] = ()  # redlock_urls; default: the broker URL when it is Redis
    ttl: float = 60.0  # redlock_ttl
    auto_extend: bool = True  # redlock_auto_extend
    on_duplicate: str = "skip"  # redlock_on_duplicate
    on_unavailable: str = "retry"  # redlock_on_unavailable
    unavailable_timeout: float | None = 3600.0  # redlock_unavailable_timeout; None: for ever
    completed_ttl: float = 3600.0  # redlock_completed_ttl; default: the visibility_timeout
    retry_count: int = 3  # redlock_retry_count
    retry_delay: float = 0.2  # redlock_retry_delay
    clock_drift_factor: float = 0.01  # redlock_clock_drift_factor
    node_timeout: float = 0.05  # redlock_node_timeout
    key_prefix: str = "redlock:"  # redlock_key_prefix
    username: str | None = None  # redlock_username, for nodes whose URL names no user
    password: str | None = None  # redlock_password, for nodes whose URL has no password
    wait_replicas: int = 0  # redlock_wait_replicas (Cluster and Sentinel nodes)
    compat_0_2: bool = True  # redlock_compat_0_2: locks held at their 0.2-layout keys too
    beat_lease_ttl: float = 30.0  # redlock_beat_lease_ttl (celery_redlock.beat)
    beat_lease_name: str = "celery-beat-leader"  # redlock_beat_lease_name
    reap_interval: float | None = None  # redlock_reap_interval; None: workers do not reap
    reap_grace: float = 30.0  # redlock_reap_grace; 0: silence is never taken as proof
    strict_settings: bool = False  # redlock_strict_settings: unknown redlock_* names are errors

    def __post_init__(self) -> None:
        if not isinstance(self.urls, (list, tuple)):
            raise ConfigurationError(
                f"redlock_urls must be a list of Redis URLs, got a {type(self.urls).__name__}; "
                "e.g. ['redis://r1:6379/0', 'redis://r2:6379/0', 'redis://r3:6379/0']"
            )
        if not self.urls:
            raise ConfigurationError(
                "redlock_urls is empty; list the independent Redis servers that hold the locks, "
                "e.g. ['redis://r1:6379/0', 'redis://r2:6379/0', 'redis://r3:6379/0']"
            )
        object.__setattr__(self, "urls", tuple(self.urls))
        for url in self.urls:
            check_url(url)
        check_seconds("redlock_ttl", self.ttl)
        for name in ("auto_extend", "strict_settings", "compat_0_2"):
            check_boolean(f"redlock_{name}", getattr(self, name))
        check_policy("redlock_on_duplicate", self.on_duplicate, DUPLICATE_POLICIES)
        check_policy("redlock_on_unavailable", self.on_unavailable, UNAVAILABLE_POLICIES)
        if self.unavailable_timeout is not None:
            check_seconds("redlock_unavailable_timeout", self.unavailable_timeout)
        check_seconds("redlock_completed_ttl", self.completed_ttl, allow_zero=True)
        check_number(
            "redlock_retry_count (Redlock retry_count)",
            self.retry_count,
            "a whole number of at least 1 (acquisition attempts per acquire)",
            lambda count: isinstance(count, int) and count >= 1,
        )
        check_seconds("redlock_retry_delay", self.retry_delay, allow_zero=True)
        check_number(
            "redlock_clock_drift_factor",
            self.clock_drift_factor,
            "a fraction of the ttl from 0 to 0.5 (0.01 is usual)",
            lambda value: 0 <= value < 0.5,
        )
        check_seconds("redlock_node_timeout", self.node_timeout)
        if not isinstance(self.key_prefix, str) or not self.key_prefix:
            raise ConfigurationError(
                "redlock_key_prefix must be a non-empty string such as 'redlock:' (every key "
                "celery_redlock writes starts with it, and the operators' tools tell locks from "
                f"other keys by it), got {self.key_prefix!r}"
            )
        check_number(
            "redlock_wait_replicas",
            self.wait_replicas,
            "a whole number, 0 or more (how many replicas of a Cluster or Sentinel lock node "
            "must acknowledge a grant before it counts)",
            lambda count: isinstance(count, int) and count >= 0,
        )
        for name in ("username", "password"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigurationError(
                    f"redlock_{name} must be a non-empty string or None, got a "
                    f"{type(value).__name__}"
                )
        check_number(
            "redlock_beat_lease_ttl",
            self.beat_lease_ttl,
            "a positive number of seconds (how long the beat leader's lease lasts without "
            "being extended, and so the longest a dead leader holds up the other beats; e.g. 30)",
            lambda seconds: seconds > 0,
        )
        if not isinstance(self.beat_lease_name, str) or not self.beat_lease_name.strip():
            raise ConfigurationError(
                "redlock_beat_lease_name must be a non-empty string naming the lease that beats "
                f"sharing one schedule compete for (e.g. 'celery-beat-leader'), got "
                f"{self.beat_lease_name!r}"
            )
        if self.reap_interval is not None:
            check_number(
                "redlock_reap_interval",
                self.reap_interval,
                "a positive number of seconds between two reaps of locks whose holder is gone "
                "(celery_redlock.admin.reap, run by every worker), or None to turn it off",
                lambda seconds: seconds > 0,
            )
        check_number(
            "redlock_reap_grace",
            self.reap_grace,
            "a number of seconds, 0 or more: how long a reap watches a lock whose worker does "
            "not answer before it counts the holder as gone (0: silence is never proof; 30 is "
            "usual, and it must exceed a third of a lock's ttl to prove anything)",
            lambda seconds: seconds >= 0,
        )

    def __repr__(self) -> str:
        shown = {field.name: getattr(self, field.name) for field in fields(self)}
        shown["urls"] = tuple(redact_url(url) for url in self.urls)
        if self.password is not None:
            shown["password"] = "***"
        return f"RedlockSettings({', '.join(f'{name}={value!r}' for name, value in shown.items())})"

    @classmethod
    def from_conf(cls, conf: Any) -> RedlockSettings:
        """Read and validate the settings from a Celery ``app.conf``; log a warning per unknown
        ``redlock_*`` name (a `ConfigurationError` with ``redlock_strict_settings``) and per
        deprecated name (`DEPRECATED_SETTINGS`), which counts as its new name."""
        values: dict[str, Any] = {}
        for field in fields(cls):
            value = conf.get(f"{SETTING_PREFIX}{field.name}", _UNSET)
            # None means "not set", except for the one setting where it means "for ever".
            if value is not _UNSET and (value is not None or field.name == "unavailable_timeout"):
                values[field.name] = value
        namespace = getattr(conf, "prefix", None) or ""
        for old, new in DEPRECATED_SETTINGS:
            old_value = conf.get(f"{SETTING_PREFIX}{old}")
            if old_value is None:
                continue
            old_name, new_name = (
                as_written(f"{SETTING_PREFIX}{name}", namespace) for name in (old, new)
            )
            check_boolean(old_name, old_value)
            logger.warning(
                "%s is deprecated: name it %s (the same setting); the old name will go",
                old_name,
                new_name,
            )
            values[new] = renamed_value(new_name, values.get(new), old_name, old_value)
        values["urls"] = _lock_urls(values.get("urls"), conf.get("broker_url"))
        values.setdefault("completed_ttl", redelivery_window(conf.get("broker_transport_options")))
        settings = cls(**values)
        unknown = unknown_setting_messages(conf.keys(), namespace)
        if unknown and settings.strict_settings:
            raise ConfigurationError(
                "; ".join(unknown) + " (redlock_strict_settings is on: fix or remove the name)"
            )
        for message in unknown:
            logger.warning("%s; it is ignored", message)
        return settings


def redelivery_window(transport_options: Any) -> float:
    """How long after delivery a broker may deliver an unacknowledged message again: the
    transport's ``visibility_timeout`` (Redis, SQS) when set, else 3600 s (their default; RabbitMQ
    redelivers when the consumer's connection ends, or after its 30-minute ``consumer_timeout``)."""
    timeout = (transport_options or {}).get("visibility_timeout")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return float(timeout)
    return 3600.0


SETTING_NAMES = tuple(f"{SETTING_PREFIX}{field.name}" for field in fields(RedlockSettings))
"""Every setting celery_redlock reads, as spelled in ``app.conf`` (deprecated names aside)."""

DEPRECATED_SETTINGS = (("legacy_layout", "compat_0_2"),)
"""Old names (without ``redlock_``) of boolean settings, still read, each with the field that
replaced it."""


def renamed_value(new_name: str, new_value: Value | None, old_name: str, old_value: Value) -> Value:
    """The value of a setting given under its deprecated name ``old_name`` (``old_value``) and
    perhaps under ``new_name`` too (``new_value``, None when not given); raises
    `ConfigurationError` when both are given and differ."""
    if new_value is not None and new_value != old_value:
        raise ConfigurationError(
            f"{old_name} (deprecated) and {new_name} are one setting, set to {old_value!r} and "
            f"{new_value!r}: remove {old_name}"
        )
    return old_value


def as_written(setting: str, namespace: str = "") -> str:
    """``setting`` as a user writes it: ``CELERY_REDLOCK_URLS`` under Django's ``CELERY_``
    namespace, ``redlock_urls`` without one."""
    return namespace + setting.upper() if namespace else setting


def closest_name(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def unknown_setting_messages(names: Iterable[str], namespace: str = "") -> list[str]:
    """What to say about each of ``names`` (the keys of an ``app.conf``) that looks like a
    celery_redlock setting but is none, each naming the closest known setting as written there.
    ``namespace`` is Celery's (``CELERY_`` for Django's ``CELERY_REDLOCK_URLS``); outside it,
    only lower-case names count: Django's other settings belong to other libraries."""
    messages = []
    for name in sorted(names):
        namespaced = bool(namespace) and name.upper().startswith(namespace.upper())
        if namespace and not namespaced and not name.islower():
            continue
        setting = (name[len(namespace) :] if namespaced else name).lower()
        known = setting in SETTING_NAMES or any(
            setting == SETTING_PREFIX + old for old, _ in DEPRECATED_SETTINGS
        )
        if not setting.startswith(SETTING_PREFIX) or (known and (namespaced or name == setting)):
            continue
        match = closest_name(setting, SETTING_NAMES)
        if match is None:
            hint = "README's Settings lists the known ones"
        else:
            hint = f"did you mean {as_written(match, namespace if namespaced else '')}?"
        messages.append(f"celery_redlock knows no setting {name} ({hint})")
    return messages


@dataclass(frozen=True)
class MultiHostURL:
    """The parts of a cluster or sentinel URL: ``scheme`` of each server (``redis`` or
    ``rediss``), the credentials as written (``user:password@`` or ''), the servers, the path
    after them and the query options."""

    scheme: str
    credentials: str
    hosts: tuple[tuple[str, int], ...]
    path: str
    options: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, url: str) -> MultiHostURL:
        """Split ``url``; raises `ValueError` saying what is wrong."""
        scheme, separator, rest = url.partition("://")
        if not separator:
            raise ValueError("no scheme")
        rest, _, query = rest.partition("?")
        netloc, slash, path = rest.partition("/")
        credentials, at, hosts_text = netloc.rpartition("@")
        hosts = []
        for host_text in hosts_text.split(","):
            host, colon, port_text = host_text.strip().rpartition(":")
            if not colon or not host or not port_text.isdigit():
                raise ValueError(f"{host_text!r} is not host:port")
            hosts.append((host.strip("[]"), int(port_text)))
        return cls(
            scheme=scheme.partition("+")[0],
            credentials=credentials + at,
            hosts=tuple(hosts),
            path=slash + path,
            options=tuple(parse_qsl(query, keep_blank_values=True)),
        )

    def server_url(self, host: str, port: int, path: str = "", sentinel: bool = False) -> str:
        """A plain URL of one server of this member, with its credentials and options (a
        sentinel's: the sentinel options instead of the member's credentials)."""
        options = [(name, value) for name, value in self.options if name not in SENTINEL_OPTIONS]
        credentials = self.credentials
        if sentinel:
            given = dict(self.options)
            user = given.get("sentinel_username", "")
            password = given.get("sentinel_password")
            credentials = f"{user}:{password}@" if password is not None else ""
        query = f"?{urlencode(options)}" if options else ""
        return f"{self.scheme}://{credentials}{host}:{port}{path}{query}"


def check_url(url: object) -> None:
    """Raise `ConfigurationError` unless ``url`` is one usable lock node URL."""
    example = (
        "redis://[user:password@]host:6379/0, rediss://... (TLS), unix:///path/redis.sock, "
        "redis+cluster://host:port[,host:port...] or "
        "redis+sentinel://host:26379[,host:26379...]/<service>[/<db>]"
    )
    if not isinstance(url, str):
        raise ConfigurationError(f"redlock_urls holds {url!r}, which is not a URL; use {example}")
    if any(character.isspace() for character in url) or ";" in url:
        raise ConfigurationError(
            f"redlock_urls holds {redact_url(url)!r}, which looks like several URLs in one "
            "string; give a list of URLs, or one string with the URLs separated by commas"
        )
    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        cluster = parts.scheme in CLUSTER_SCHEMES
        cluster_form = "redis+cluster://host:port[,host:port...]"
        sentinel_form = "redis+sentinel://host:26379[,host:26379...]/<service name>[/<db>]"
        form = cluster_form if cluster else sentinel_form
        try:
            path = MultiHostURL.parse(url).path.strip("/")
        except ValueError as error:
            raise _url_error(url, f"cannot be read ({error}); use {form}") from None
        if cluster and path not in ("", "0"):
            raise _url_error(
                url, f"names a database; a Redis Cluster has only database 0: use {form}"
            )
        service, _, database = path.partition("/")
        if not (service or cluster):  # a cluster's path is "" or "0" by now
            raise _url_error(url, f"names no service; use {form}")
        database = database or "0"
    elif parts.scheme not in URL_SCHEMES:
        raise _url_error(url, f"is not a Redis URL (scheme {parts.scheme!r}); use {example}")
    elif parts.scheme == "unix":
        if not parts.path:
            raise _url_error(url, "names no socket path; use unix:///path/redis.sock")
        database = (parse_qs(parts.query).get("db") or ["0"])[0]
    else:
        if not parts.hostname:
            raise _url_error(url, "names no host; use redis://host:6379/0")
        try:
            parts.port  # noqa: B018 - parsing the port is the check
        except ValueError:
            raise _url_error(url, "has an invalid port; use redis://host:6379/0") from None
        database = parts.path.lstrip("/") or "0"
    if not database.isdigit():
        raise _url_error(
            url,
            f"names database {database!r}, which is not a number; end the URL with the "
            "database number, e.g. redis://host:6379/0",
        )


def _url_error(url: str, problem: str) -> ConfigurationError:
    return ConfigurationError(f"redlock_urls: lock node URL {redact_url(url)!r} {problem}")


def redact_url(url: str) -> str:
    """The URL with every password replaced by ``***`` — the one after ``user:`` and any query
    option whose name holds "pass" (``?password=``, ``ssl_password=``) — safe to log or print."""
    parts = urlsplit(url)
    netloc, query = parts.netloc, parts.query
    if parts.password is not None:
        user = parts.username or ""
        netloc = f"{user}:***@{netloc.rpartition('@')[2]}"  # as written: .port may not parse
    pairs = parse_qsl(query, keep_blank_values=True)
    if any("pass" in name.lower() for name, _ in pairs):
        hidden = [(name, "***" if "pass" in name.lower() else value) for name, value in pairs]
        query = urlencode(hidden, safe="*/:")
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    # Built by hand: urlunsplit drops the "//" of unix:///path URLs.
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def has_password(url: str) -> bool:
    return redact_url(url) != url


def has_credentials(url: str) -> bool:
    return bool(urlsplit(url).username) or has_password(url)


def check_number(name: str, value: object, meaning: str, valid: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not valid(value)
    ):
        raise ConfigurationError(f"{name} must be {meaning}, got {value!r}")


def check_seconds(name: str, value: object, allow_zero: bool = False) -> None:
    meaning = "a number of seconds, 0 or more" if allow_zero else "a positive number of seconds"
    check_number(name, value, meaning, lambda seconds: seconds >= 0 if allow_zero else seconds > 0)


def check_boolean(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")


def check_policy(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        choices = ", ".join(repr(choice) for choice in allowed)
        raise ConfigurationError(f"{name} must be one of {choices}, got {value!r}")


def split_urls(urls: object) -> object:
    """A comma-separated string of URLs as a tuple; anything else unchanged (checked later).
    Only a comma followed by a scheme (``,redis://``) separates URLs: the host lists of cluster
    and sentinel URLs hold commas of their own."""
    if isinstance(urls, str):
        parts = re.split(r",\s*(?=[a-z][a-z0-9+.-]*://)", urls.strip())
        return tuple(part.strip() for part in parts if part.strip())
    return urls


def _lock_urls(configured: object, broker_url: object) -> object:
    if configured is None:
        broker = broker_url.split(";")[0] if isinstance(broker_url, str) else ""
        if broker.startswith(tuple(f"{scheme}://" for scheme in URL_SCHEMES)):
            return (broker,)
        raise ConfigurationError(
            "redlock_urls is not set and the broker is not Redis "
            f"({redact_url(broker) if broker else 'no broker_url'}); set app.conf.redlock_urls "
            "to a list of independent Redis servers, e.g. ['redis://r1:6379/0', "
            "'redis://r2:6379/0', 'redis://r3:6379/0'] (CELERY_REDLOCK_URLS under Django)"
        )
    return split_urls(configured)


def even_node_warning(count: int) -> str | None:
    if count % 2:
        return None
    return (
        f"{count} lock nodes configured: an even number tolerates no more failed nodes than "
        f"{count - 1} would ({count // 2 + 1} of {count} must agree), while adding a node that "
        "can fail; use an odd number such as 3 or 5"
    )
