"""`ClosingResource`: a ``with`` block over any of the harness's processes and server groups
calls its :meth:`~ClosingResource.close` on leaving, whatever happened in the block."""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

_ResourceT = TypeVar("_ResourceT", bound="ClosingResource")


class ClosingResource:
    """Something a ``with`` block closes on leaving; entering returns it (kinds that start
    something override ``__enter__`` to start it first)."""

    def close(self) -> None:
        """Give back what the resource holds (each kind says how); repeating is harmless."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it closes")

    def __enter__(self: _ResourceT) -> _ResourceT:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
