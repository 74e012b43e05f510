"""Fenced writes with the Django ORM: a `FenceField` on the model (added by a migration, as any
field) and `FencedQuerySet`'s methods (``objects = FencedQuerySet.as_manager()``).

One row is one resource; its fence holds the token of the last write accepted for it. A fenced
update is one ``UPDATE ... WHERE fence < token`` (no ``select_for_update`` needed); inside
``transaction.atomic()`` a `StaleFence` rolls the block's writes back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import IntegrityError, models, transaction  # type: ignore[import-untyped]

from ..errors import ConfigurationError
from . import Fence, StaleFence, fencing_token

__all__ = ["FenceField", "FencedQuerySet"]


class FenceField(models.BigIntegerField):  # type: ignore[misc]
    """The fence of a row: the token of the last fenced write accepted for it (0 before)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        super().__init__(*args, **kwargs)


class FencedQuerySet(models.QuerySet):  # type: ignore[misc]
    """A queryset of a model with a `FenceField`, with fenced writes."""

    def fenced_update(self, fence: Fence, **values: Any) -> int:
        """``UPDATE ... SET values`` on the rows of this queryset (one resource: filter it to
        its row first) whose fence is smaller than ``fence``'s token, which it then replaces:
        one statement. Returns the number of rows updated, 0 when none matches; raises
        `StaleFence` when a row matches but its fence is not smaller."""
        token = fencing_token(fence)
        name = self.fence_name()
        updated: int = self.filter(**{f"{name}__lt": token}).update(**values, **{name: token})
        if updated == 0:
            rows = list(self.values_list("pk", name)[:10])
            stored = max((row_fence for _, row_fence in rows), default=None)
            if stored is not None and stored >= token:
                keys = ", ".join(str(key) for key, _ in rows)
                raise StaleFence(f"{self.model._meta.label} pk {keys}", token, stored)
        return updated

    def fenced_update_or_create(
        self, fence: Fence, defaults: Mapping[str, Any] | None = None, **lookup: Any
    ) -> bool:
        """Update the row matching ``lookup`` with ``defaults`` (`fenced_update`), or create it
        when there is none; returns whether it was created. Raises `StaleFence` as
        `fenced_update` does, also when the row appears meanwhile with a fence not smaller."""
        token = fencing_token(fence)
        values = dict(defaults or {})
        if self.filter(**lookup).fenced_update(token, **values):
            return False
        try:
            with transaction.atomic(using=self.db):
                self.create(**lookup, **values, **{self.fence_name(): token})
        except IntegrityError:
            # Created meanwhile by another writer: compare with its fence. No such row: the
            # insert broke another constraint, which is the caller's to see.
            if not self.filter(**lookup).fenced_update(token, **values):
                raise
            return False
        return True

    def fence_name(self) -> str:
        for field in self.model._meta.get_fields():
            if isinstance(field, FenceField):
                return str(field.name)
        raise ConfigurationError(
            f"{self.model._meta.label} has no FenceField: add fence = FenceField() to the "
            "model (and a migration) to write it with fenced_update"
        )
