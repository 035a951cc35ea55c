"""One delivery pass per read: the channels a connection's commands gave work.

While a connection's read is handled (a pipeline of PUBs, FINs, RDYs), the
channels that get messages or room are collected here and delivered once
at the end of it, not once per command. Outside a read there is no batch
and a channel delivers at once.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeliveryBatch"]


class DeliveryBatch:
    """The set of channels to deliver when the read being handled ends; None outside a read.

    The broker owns one; the V2 protocol opens and closes it around each
    read (`pending` is read on the hot path, hence a bare slot).
    """

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: set[Any] | None = None
