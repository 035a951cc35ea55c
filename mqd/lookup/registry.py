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
only hides producers when they are read (`is_inactive`, `is_live`), as nsqlookupd
does. Time comes from the injected clock, so tests move it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

if TYPE_CHECKING:
    from twisted.internet.interfaces import IReactorTime

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


_Index = dict[tuple[str, str], dict[Registration, None]]
_K = TypeVar("_K")


class RegistrationDB:
    """Registrations → {broker id: Producer}, kept in insertion order (stable answers).

    Every query is answered from an index, in time proportional to its
    answer rather than to brokers × registrations: a lookup daemon with
    thousands of brokers is asked `/nodes` every few seconds by mqadmin and
    must still answer consumers and brokers meanwhile. The indexes, kept
    in step by every change:

    * `(category, key)` and `(category, subkey)` → registrations, and
      category → registrations, for the `*` patterns of `find_registrations`
      (a topic's channels, every topic);
    * broker id → {registration: its Producer}, for `lookup_registrations`
      and /nodes (a broker's topics and tombstones), and a stamp that
      changes with that set (`peer_stamp`), so /nodes re-encodes only the
      brokers that changed.

    Each is a dict in insertion order, so its registrations come in the
    order of the main map, which they are a part of. A broker's own dict
    is in the order it joined registrations, which can differ (it may join
    an older one later), so it is sorted by each registration's creation
    number when read.
    """

    def __init__(self, clock: IReactorTime, inactive_producer_timeout: float = 300.0,
                 tombstone_lifetime: float = 45.0) -> None:
        self.clock = clock
        self.inactive_producer_timeout = inactive_producer_timeout
        self.tombstone_lifetime = tombstone_lifetime
        self._map: dict[Registration, dict[str, Producer]] = {}
        # Creation numbers of registrations and change stamps of brokers: one counter, never repeating.
        self._sequence = itertools.count(1)
        self._order: dict[Registration, int] = {}
        self._by_key: _Index = {}
        self._by_subkey: _Index = {}
        self._by_category: dict[str, dict[Registration, None]] = {}
        self._by_peer: dict[str, dict[Registration, Producer]] = {}
        self._peer_stamp: dict[str, int] = {}

    def now(self) -> float:
        return self.clock.seconds()

    # -- changes ------------------------------------------------------------------

    def _create(self, reg: Registration) -> dict[str, Producer]:
        producers: dict[str, Producer] = {}
        self._map[reg] = producers
        self._order[reg] = next(self._sequence)
        self._by_key.setdefault((reg.category, reg.key), {})[reg] = None
        self._by_subkey.setdefault((reg.category, reg.subkey), {})[reg] = None
        self._by_category.setdefault(reg.category, {})[reg] = None
        return producers

    def add_registration(self, reg: Registration) -> None:
        """Make sure `reg` exists (producer-less if new)."""
        if reg not in self._map:
            self._create(reg)

    def add_producer(self, reg: Registration, producer: Producer) -> bool:
        """Add the producer to `reg` (creating it); False if that broker was already there."""
        producers = self._map.get(reg)
        if producers is None:
            producers = self._create(reg)
        peer_id = producer.peer.id
        if peer_id in producers:
            return False
        producers[peer_id] = producer
        self._by_peer.setdefault(peer_id, {})[reg] = producer
        self._peer_stamp[peer_id] = next(self._sequence)
        return True

    def remove_producer(self, reg: Registration, peer_id: str) -> tuple[bool, int]:
        """Take broker `peer_id` out of `reg`: (whether it was there, producers left)."""
        producers = self._map.get(reg)
        if producers is None:
            return False, 0
        removed = producers.pop(peer_id, None) is not None
        if removed:
            self._forget_peer_reg(peer_id, reg)
        return removed, len(producers)

    def remove_registration(self, reg: Registration) -> None:
        producers = self._map.pop(reg, None)
        if producers is None:
            return
        del self._order[reg]
        _discard(self._by_key, (reg.category, reg.key), reg)
        _discard(self._by_subkey, (reg.category, reg.subkey), reg)
        _discard(self._by_category, reg.category, reg)
        for peer_id in producers:
            self._forget_peer_reg(peer_id, reg)

    def _forget_peer_reg(self, peer_id: str, reg: Registration) -> None:
        regs = self._by_peer[peer_id]
        del regs[reg]
        if regs:
            self._peer_stamp[peer_id] = next(self._sequence)
        else:
            del self._by_peer[peer_id]
            del self._peer_stamp[peer_id]

    # -- queries --------------------------------------------------------------------

    def find_registrations(self, category: str, key: str, subkey: str) -> list[Registration]:
        """Registrations matching the pattern; `*` as key or subkey matches anything."""
        if key != "*" and subkey != "*":
            reg = Registration(category, key, subkey)
            return [reg] if reg in self._map else []
        if key != "*":
            found = self._by_key.get((category, key))
        elif subkey != "*":
            found = self._by_subkey.get((category, subkey))
        else:
            found = self._by_category.get(category)
        return list(found) if found else []

    def find_producers(self, category: str, key: str, subkey: str) -> list[Producer]:
        """Producers of the matching registrations, one per broker (the first registration's)."""
        regs = self.find_registrations(category, key, subkey)
        if len(regs) == 1:
            return list(self._map[regs[0]].values())
        seen: dict[str, Producer] = {}
        for reg in regs:
            for peer_id, producer in self._map[reg].items():
                seen.setdefault(peer_id, producer)
        return list(seen.values())

    def producers(self, reg: Registration) -> list[Producer]:
        """The producers of exactly `reg` ([] if it does not exist)."""
        producers = self._map.get(reg)
        return list(producers.values()) if producers else []

    def producer(self, reg: Registration, peer_id: str) -> Producer | None:
        """Broker `peer_id`'s producer in `reg`, if it is one."""
        producers = self._map.get(reg)
        return producers.get(peer_id) if producers else None

    def lookup_registrations(self, peer_id: str) -> list[Registration]:
        """Every registration broker `peer_id` is a producer in, in registration order."""
        return [reg for reg, _ in self.peer_producers(peer_id)]

    def peer_producers(self, peer_id: str, category: str | None = None
                       ) -> list[tuple[Registration, Producer]]:
        """Broker `peer_id`'s registrations (of `category`, or all) with its producer in each."""
        regs = self._by_peer.get(peer_id)
        if not regs:
            return []
        order = self._order
        entries = [item for item in regs.items() if category is None or item[0][0] == category]
        entries.sort(key=lambda item: order[item[0]])
        return entries

    def peer_stamp(self, peer_id: str) -> int:
        """A number that changes whenever broker `peer_id` joins or leaves a registration (0: in none).

        What /nodes shows of a broker depends only on its registrations (and
        its producers' tombstones), so an encoding of it stays valid while
        this number does.
        """
        return self._peer_stamp.get(peer_id, 0)

    def registrations(self) -> list[Registration]:
        """Every registration, with producers or not."""
        return list(self._map)

    def items(self) -> Iterable[tuple[Registration, list[Producer]]]:
        """Every registration and its producers."""
        return [(reg, list(producers.values())) for reg, producers in self._map.items()]

    # -- what readers may see ----------------------------------------------------------

    def is_inactive(self, producer: Producer, now: float | None = None) -> bool:
        now = self.now() if now is None else now
        return now - producer.peer.last_update > self.inactive_producer_timeout

    def is_tombstoned(self, producer: Producer, now: float | None = None) -> bool:
        return producer.is_tombstoned(self.tombstone_lifetime, self.now() if now is None else now)

    def is_live(self, producer: Producer, now: float | None = None) -> bool:
        """Active and not tombstoned: shown by /lookup (/nodes shows the active ones)."""
        now = self.now() if now is None else now
        return not self.is_inactive(producer, now) and not self.is_tombstoned(producer, now)


def _discard(index: dict[_K, dict[Registration, None]], bucket: _K, reg: Registration) -> None:
    """Take `reg` out of an index bucket, and the bucket out when it empties."""
    regs = index[bucket]
    del regs[reg]
    if not regs:
        del index[bucket]
