"""Storage backends, chosen by name from configuration.

The broker asks this registry for a store by the configured name; adding a
backend means adding one entry here, never a branch in the broker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backends.dummy import DummyStore
from backends.interface import BackendError, IBackendQueue, IBackendStore
from backends.lmdb import LmdbStore, StoreOpenError
from backends.memory import MemoryStore

__all__ = [
    "BackendError",
    "IBackendQueue",
    "IBackendStore",
    "available",
    "open_store",
    "register",
    "StoreOpenError",
]

_FACTORIES: dict[str, Callable[..., IBackendStore]] = {
    "lmdb": LmdbStore,
    "memory": MemoryStore,
    "dummy": DummyStore,
}


def register(name: str, factory: Callable[..., IBackendStore]) -> None:
    _FACTORIES[name] = factory


def available() -> list[str]:
    return sorted(_FACTORIES)


def open_store(name: str, options: Any = None, clock: Any = None) -> IBackendStore:
    """Open the store called `name` for a broker configured by `options`.

    `clock` is the broker's reactor: a store that commits in groups
    schedules its commits on it.
    """
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r} (choose from {', '.join(available())})"
        ) from None
    return factory(options, clock)
