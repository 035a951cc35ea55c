"""The registration database of mqlookupd: which broker produces which topic and channel.

It mirrors nsqlookupd's RegistrationDB (`nsqlookupd/registration_db.go`)
because what clients see depends on its details:

* A registration is `(category, key, subkey)`: `("client", "", "")` for
  every identified broker, `("topic", t, "")`, `("channel", t, c)`. Each
  maps broker ids (the TCP peer `ip:port`) to a `Producer`.
* A registration can exist with no producers (`/topic/create`, or a
  non-ephemeral topic whose brokers all unregistered); it still shows in
  /topics and /channels.
* A `Producer` is one broker in one registration; brokers' `PeerInfo`
  (and so `last_update`) is shared by all of its producers, while a
  tombstone belongs to one producer, i.e. to one (topic, broker).

Nothing is deleted by time: a broker silent for longer than
inactive-producer-timeout, or a tombstone younger than tombstone-lifetime,
only hides producers when they are read (`live`, `active`), as nsqlookupd
does. Time comes from the injected clock, so tests move it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["GO_ZERO_TIME_NS", "PeerInfo", "Producer", "Registration", "RegistrationDB"]

# Go's `time.Time{}.UnixNano()`: what /debug shows as `tombstoned_at` for a
# producer never tombstoned.
GO_ZERO_TIME_NS = -6795364578871345152


class Registration(NamedTuple):
    category: str
    key: str
    subkey: str

    def __str__(self) -> str:
        return f"{self.category}:{self.key}:{self.subkey}"


@dataclass(eq=False)
class PeerInfo:
    """What a broker told us in IDENTIFY, and when we last heard from it (clock seconds)."""

    id: str
    remote_address: str
    broadcast_address: str
    tcp_port: int
    http_port: int
    version: str
    hostname: str = ""
    topology_zone: str = ""
    topology_region: str = ""
    last_update: float = 0.0

    def as_json(self) -> dict[str, Any]:
        """nsqlookupd's PeerInfo JSON, in its field order (the `/lookup` producers)."""
        return {
            "remote_address": self.remote_address,
            "hostname": self.hostname,
            "broadcast_address": self.broadcast_address,
            "tcp_port": self.tcp_port,
            "http_port": self.http_port,
            "version": self.version,
            "topology_zone": self.topology_zone,
            "topology_region": self.topology_region,
        }


@dataclass(eq=False)
class Producer:
    """One broker in one registration; a tombstone hides it from /lookup for a while."""

    peer: PeerInfo
    tombstoned: bool = False
    tombstoned_at: float | None = None

    def tombstone(self, now: float) -> None:
        self.tombstoned = True
        self.tombstoned_at = now

    def is_tombstoned(self, lifetime: float, now: float) -> bool:
        return self.tombstoned and self.tombstoned_at is not None and now - self.tombstoned_at < lifetime


def _matches(pattern: str, value: str) -> bool:
    return pattern == "*" or pattern == value


class RegistrationDB:
    """Registrations → {broker id: Producer}, kept in insertion order (stable answers)."""

    def __init__(self, clock, inactive_producer_timeout: float = 300.0,
                 tombstone_lifetime: float = 45.0) -> None:
        self.clock = clock
        self.inactive_producer_timeout = inactive_producer_timeout
        self.tombstone_lifetime = tombstone_lifetime
        self._map: dict[Registration, dict[str, Producer]] = {}

    def now(self) -> float:
        return self.clock.seconds()

    # -- changes ------------------------------------------------------------------

    def add_registration(self, reg: Registration) -> None:
        """Make sure `reg` exists (producer-less if new)."""
        self._map.setdefault(reg, {})

    def add_producer(self, reg: Registration, producer: Producer) -> bool:
        """Add the producer to `reg` (creating it); False if that broker was already there."""
        producers = self._map.setdefault(reg, {})
        if producer.peer.id in producers:
            return False
        producers[producer.peer.id] = producer
        return True

    def remove_producer(self, reg: Registration, peer_id: str) -> tuple[bool, int]:
        """Take broker `peer_id` out of `reg`: (whether it was there, producers left)."""
        producers = self._map.get(reg)
        if producers is None:
            return False, 0
        removed = producers.pop(peer_id, None) is not None
        return removed, len(producers)

    def remove_registration(self, reg: Registration) -> None:
        self._map.pop(reg, None)

    # -- queries --------------------------------------------------------------------

    def find_registrations(self, category: str, key: str, subkey: str) -> list[Registration]:
        """Registrations matching the pattern; `*` as key or subkey matches anything."""
        if key != "*" and subkey != "*":
            reg = Registration(category, key, subkey)
            return [reg] if reg in self._map else []
        return [reg for reg in self._map
                if reg.category == category and _matches(key, reg.key) and _matches(subkey, reg.subkey)]

    def find_producers(self, category: str, key: str, subkey: str) -> list[Producer]:
        """Producers of the matching registrations, one per broker."""
        seen: dict[str, Producer] = {}
        for reg in self.find_registrations(category, key, subkey):
            for peer_id, producer in self._map[reg].items():
                seen.setdefault(peer_id, producer)
        return list(seen.values())

    def lookup_registrations(self, peer_id: str) -> list[Registration]:
        """Every registration broker `peer_id` is a producer in."""
        return [reg for reg, producers in self._map.items() if peer_id in producers]

    def items(self) -> Iterable[tuple[Registration, list[Producer]]]:
        """Every registration and its producers (for /debug)."""
        return [(reg, list(producers.values())) for reg, producers in self._map.items()]

    # -- what readers may see ----------------------------------------------------------

    def is_inactive(self, producer: Producer) -> bool:
        return self.now() - producer.peer.last_update > self.inactive_producer_timeout

    def is_tombstoned(self, producer: Producer) -> bool:
        return producer.is_tombstoned(self.tombstone_lifetime, self.now())

    def active(self, producers: Iterable[Producer]) -> list[Producer]:
        """Producers heard from recently enough (/nodes: tombstones do not hide)."""
        return [p for p in producers if not self.is_inactive(p)]

    def live(self, producers: Iterable[Producer]) -> list[Producer]:
        """Active producers that are not tombstoned (/lookup)."""
        return [p for p in self.active(producers) if not self.is_tombstoned(p)]
