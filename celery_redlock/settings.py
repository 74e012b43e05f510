"""All celery_redlock settings, read once per Celery app into one validated object.

Settings live in ``app.conf`` in lower case (``redlock_urls``); under Django's ``CELERY``
namespace they are spelled ``CELERY_REDLOCK_URLS`` and so on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigurationError

DUPLICATE_POLICIES = ("skip", "retry", "raise", "wait")
UNAVAILABLE_POLICIES = ("retry", "raise", "run")


@dataclass(frozen=True)
class RedlockSettings:
    """The validated ``redlock_*`` settings of one Celery app (defaults beside the names)."""

    urls: tuple[str, ...] = ()  # redlock_urls; default: the broker URL when it is Redis
    ttl: float = 60.0  # redlock_ttl
    auto_extend: bool = True  # redlock_auto_extend
    on_duplicate: str = "skip"  # redlock_on_duplicate
    on_unavailable: str = "retry"  # redlock_on_unavailable
    retry_count: int = 3  # redlock_retry_count
    retry_delay: float = 0.2  # redlock_retry_delay
    clock_drift_factor: float = 0.01  # redlock_clock_drift_factor
    node_timeout: float = 0.05  # redlock_node_timeout
    key_prefix: str = "redlock:"  # redlock_key_prefix

    def __post_init__(self) -> None:
        check_positive("redlock_ttl", self.ttl)
        check_policy("redlock_on_duplicate", self.on_duplicate, DUPLICATE_POLICIES)
        check_policy("redlock_on_unavailable", self.on_unavailable, UNAVAILABLE_POLICIES)
        if not isinstance(self.auto_extend, bool):
            raise ConfigurationError(
                f"redlock_auto_extend must be True or False, got {self.auto_extend!r}"
            )

    @classmethod
    def from_conf(cls, conf: Any) -> RedlockSettings:
        """Read and validate the settings from a Celery ``app.conf``."""
        values: dict[str, Any] = {}
        for field in fields(cls):
            value = conf.get(f"redlock_{field.name}")
            if value is not None:
                values[field.name] = value
        values["urls"] = _lock_urls(values.get("urls"), conf.get("broker_url"))
        return cls(**values)


def check_positive(name: str, value: object) -> None:
    """Raise `ConfigurationError` unless ``value`` is a positive number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")


def check_policy(name: str, value: object, allowed: Sequence[str]) -> None:
    """Raise `ConfigurationError` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        choices = ", ".join(repr(choice) for choice in allowed)
        raise ConfigurationError(f"{name} must be one of {choices}, got {value!r}")


def _lock_urls(configured: object, broker_url: object) -> tuple[str, ...]:
    if configured is None:
        broker = broker_url.split(";")[0] if isinstance(broker_url, str) else ""
        if broker.startswith(("redis://", "rediss://", "unix://")):
            return (broker,)
        raise ConfigurationError(
            "redlock_urls is not set and the broker is not Redis "
            f"({broker or 'no broker_url'}); set app.conf.redlock_urls to a list of "
            "independent Redis servers, e.g. ['redis://r1:6379/0', 'redis://r2:6379/0', "
            "'redis://r3:6379/0'] (CELERY_REDLOCK_URLS under Django)"
        )
    if isinstance(configured, str):
        configured = [url.strip() for url in configured.split(",") if url.strip()]
    if not isinstance(configured, (list, tuple)) or not configured:
        raise ConfigurationError(
            f"redlock_urls must be a non-empty list of Redis URLs, got {configured!r}"
        )
    return tuple(configured)
