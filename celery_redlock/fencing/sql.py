"""Fenced writes through SQLAlchemy 2 (Core and ORM), on PostgreSQL and SQLite.

One row is one resource; its fence column (`fence_column`) holds the token of the last write
accepted for it. `fenced_upsert` and `fenced_update` each compare and write in one statement
(``... WHERE fence < :token``), so concurrent writers need no ``SELECT ... FOR UPDATE``. They run
on a `Connection` or ORM `Session` in the caller's transaction, which a `StaleFence` rolls back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import BigInteger, Column, ColumnElement, Connection, Table, func, select, update
from sqlalchemy import inspect as inspect_object
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ..errors import ConfigurationError
from . import Fence, StaleFence, fencing_token

__all__ = ["FENCE_COLUMN", "fence_column", "fenced_update", "fenced_upsert"]

FENCE_COLUMN = "fence"
"""The default name of the fence column."""

INSERTS: dict[str, Any] = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


def fence_column(name: str = FENCE_COLUMN) -> Column[int]:
    """The fence column of a `Table` (a ``BIGINT``, 0 until the first fenced write). In an ORM
    model: ``fence: Mapped[int] = mapped_column(BigInteger, default=0)``."""
    return Column(name, BigInteger, nullable=False, default=0, server_default="0")


def fenced_upsert(
    connection: Connection | Session,
    table: Table | type[Any],
    values: Mapping[str, Any],
    fence: Fence,
    *,
    key: Sequence[str] = (),
    fence_name: str = FENCE_COLUMN,
) -> None:
    """Insert the row ``values`` into ``table`` (a `Table` or an ORM model), or update the row
    with the same ``key`` (its primary key unless named), only if ``fence``'s token is larger
    than the row's fence, which it then replaces: one statement. Raises `StaleFence` when the
    row's fence is not smaller."""
    target = table_of(table)
    token = fencing_token(fence)
    key_names = list(key) or [column.name for column in target.primary_key.columns]
    if missing := [name for name in key_names if name not in values]:
        raise ConfigurationError(
            f"fenced_upsert into {target.name} needs the key columns in values: {missing} "
            "missing (the row's key names the resource; pass key=... to use other columns)"
        )
    bind = connection.get_bind() if isinstance(connection, Session) else connection
    if bind.dialect.name not in INSERTS:
        raise ConfigurationError(
            f"fenced_upsert runs on {' and '.join(sorted(INSERTS))}, not on {bind.dialect.name}: "
            "use fenced_update, in a transaction that inserts the row first when it is missing"
        )
    insert = INSERTS[bind.dialect.name](target).values({**values, fence_name: token})
    statement = insert.on_conflict_do_update(
        index_elements=key_names,
        set_={
            name: insert.excluded[name] for name in [*values, fence_name] if name not in key_names
        },
        where=target.c[fence_name] < insert.excluded[fence_name],
    )
    # An INSERT's row count is read only when asked for (SQLAlchemy 2.0.28).
    statement = statement.execution_options(preserve_rowcount=True)
    if connection.execute(statement).rowcount == 0:  # type: ignore[attr-defined]
        where = [target.c[name] == values[name] for name in key_names]
        refuse(connection, target, where, token, fence_name)


def fenced_update(
    connection: Connection | Session,
    table: Table | type[Any],
    where: ColumnElement[bool],
    values: Mapping[str, Any],
    fence: Fence,
    *,
    fence_name: str = FENCE_COLUMN,
) -> int:
    """``UPDATE table SET values WHERE where``, only on a row whose fence is smaller than
    ``fence``'s token, which it then replaces: one statement. ``where`` picks the resource's
    row; ``values`` may hold expressions (``{"balance": accounts.c.balance + 5}``). Returns the
    number of rows updated: 0 when no row matches. Raises `StaleFence` when a row matches but
    its fence is not smaller."""
    target = table_of(table)
    token = fencing_token(fence)
    statement = (
        update(target)
        .where(where, target.c[fence_name] < token)
        .values({**values, fence_name: token})
    )
    updated: int = connection.execute(statement).rowcount  # type: ignore[attr-defined]
    if updated == 0:
        refuse(connection, target, [where], token, fence_name)
    return updated


def table_of(table: Table | type[Any]) -> Table:
    if isinstance(table, Table):
        return table
    mapped = inspect_object(table).local_table
    if not isinstance(mapped, Table):
        raise ConfigurationError(f"{table!r} is mapped to {mapped!r}, not to one table")
    return mapped


def refuse(
    connection: Connection | Session,
    table: Table,
    where: Sequence[ColumnElement[bool]],
    token: int,
    fence_name: str,
) -> None:
    """After a write that changed no row: `StaleFence` if a row matches (a missing one is fine)."""
    stored = connection.execute(select(func.max(table.c[fence_name])).where(*where)).scalar()
    if stored is not None and stored >= token:
        clauses = " and ".join(readable(clause) for clause in where)
        raise StaleFence(f"{table.name} where {clauses}", token, int(stored))


def readable(clause: ColumnElement[bool]) -> str:
    try:
        return str(clause.compile(compile_kwargs={"literal_binds": True}))
    except Exception:  # a value without a literal form: its parameter's name will do
        return str(clause)
