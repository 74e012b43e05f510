"""`ClosingResource`: the one ``with``-block behaviour of the harness's processes and server
groups. Leaving the block calls the resource's :meth:`~ClosingResource.close`, whatever happened in
the block; each kind of resource says what closing it means (a process is killed, a server
stopped, a group stopped).
"""

from __future__ import annotations

from types import TracebackType
from typing import TypeVar

__all__ = ["ClosingResource"]

_ResourceT = TypeVar("_ResourceT", bound="ClosingResource")


class ClosingResource:
    """Something a ``with`` block closes: entering the block returns it (kinds that start
    something override ``__enter__`` to start it first), leaving the block calls :meth:`close`.
    """

    def close(self) -> None:
        """Give back what the resource holds; what leaving a ``with`` block does. Each kind of
        resource says what it does; calling it again is harmless."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it closes")

    def __enter__(self: _ResourceT) -> _ResourceT:
        """Return the resource."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close the resource (:meth:`close`)."""
        self.close()
