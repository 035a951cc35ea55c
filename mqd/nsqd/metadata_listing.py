"""nsqd.dat's content kept encoded topic by topic: a change costs its own topic, not the whole list.

The file lists every non-ephemeral topic, and it is rewritten after each
change; building and encoding the whole list for each one cost a
`POST /channel/create` 17-23 ms with 10,000 topics against 0.9 ms with
one. `Listing` keeps each listed topic's encoded entry and encodes again
only the topics it is told changed (`stale(name)`), so the file's bytes
are joined from what is kept: the same bytes as
`encode_json(describe(topics))`, in the same order, at a cost that no
longer depends on the other topics. New topics are appended when they
are the broker's newest (its dict keeps creation order); otherwise (a name
deleted and created again) and after a change said without a name
(`stale(None)`: start-up, shutdown, anything not told by name) every
topic is gone through again, reusing the entries of those unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Reversible
from itertools import islice
from typing import Any, Protocol

from mqd import NSQ_VERSION
from mqd.wire.json_encoding import encode_json

__all__ = ["ListedTopic", "Listing", "topic_entry"]


class _Listed(Protocol):
    """What the file records of a channel: its name, its paused flag; ephemeral ones are left out."""

    @property
    def name(self) -> str: ...

    @property
    def paused(self) -> bool: ...

    @property
    def ephemeral(self) -> bool: ...


class ListedTopic(_Listed, Protocol):
    """What the file records of a topic: as a channel, and its channels."""

    @property
    def channels(self) -> Mapping[str, _Listed]: ...


def topic_entry(topic: ListedTopic) -> dict[str, Any]:
    """A non-ephemeral topic's entry in the file: nsqd's JSON, ephemeral channels left out.

    A topic whose retention was set for it alone (`POST /topic/retention`)
    has one key more, `"retention": {"time_ms", "bytes"}`; nsqd reading
    the file ignores it, as Go's JSON decoder skips unknown keys. Without
    an override the entry is nsqd's exactly.
    """
    channels = [{"name": c.name, "paused": c.paused} for c in topic.channels.values() if not c.ephemeral]
    entry: dict[str, Any] = {"name": topic.name, "paused": topic.paused, "channels": channels or None}
    # A record without retention settings (a plain listing) has no override.
    retention = getattr(topic, "retention", None)
    if retention is not None and retention.overridden:
        entry["retention"] = {"time_ms": round(retention.time * 1000), "bytes": retention.bytes}
    return entry


def _is_new(topic: ListedTopic | None, kept: ListedTopic | None) -> bool:
    """A listed topic the entries do not have (or have as the one deleted under its name)."""
    return topic is not None and not topic.ephemeral and kept is not topic


_TAIL = b',"version":' + encode_json(NSQ_VERSION) + b"}"


class Listing:
    """`encode_json(describe(topics))`, kept up to date from the names of the topics that changed."""

    def __init__(self, topics: Mapping[str, ListedTopic]) -> None:
        self._topics = topics
        # Each listed topic's entry, encoded, in the order of `topics` (joined as they are);
        # and the topic each was encoded from, as a name deleted and created again is another.
        self._entries: dict[str, bytes] = {}
        self._sources: dict[str, ListedTopic] = {}
        self._stale: set[str] = set()
        self._all = True

    def stale(self, name: str | None) -> None:
        """The entry of topic `name` (created, deleted, changed) may differ now; None: any may."""
        if name is None:
            self._all = True
        else:
            self._stale.add(name)

    def encoded(self) -> bytes:
        """The file's content for the topics as they are now."""
        entries, sources = self._entries, self._sources
        stale, self._stale = self._stale, set()
        every, self._all = self._all, False
        topics = self._topics
        new = [] if every else [name for name in stale if _is_new(topics.get(name), sources.get(name))]
        # New topics are the broker's last ones (its dict keeps creation order) unless a
        # name was deleted and created again, or an ephemeral topic came after them.
        names = topics.keys()
        last = list(islice(reversed(names), len(new))) if isinstance(names, Reversible) else None
        if every or last is None or set(last) != set(new) or any(name in entries for name in new):
            self._in_order(stale, every)
            entries = self._entries
        else:
            for name in stale:
                topic = topics.get(name)
                if topic is None or topic.ephemeral:
                    entries.pop(name, None)  # deleted: the others keep their order
                    sources.pop(name, None)
                elif name not in new:
                    entries[name] = encode_json(topic_entry(topic))
            for name in reversed(last):
                topic = sources[name] = topics[name]
                entries[name] = encode_json(topic_entry(topic))
        if not entries:
            return b'{"topics":null' + _TAIL
        return b"".join((b'{"topics":[', b",".join(entries.values()), b"]", _TAIL))

    def _in_order(self, stale: set[str], every: bool) -> None:
        """Every listed topic in the broker's order, encoding only the new, stale or (`every`) all."""
        kept, was = self._entries, self._sources
        entries: dict[str, bytes] = {}
        sources: dict[str, ListedTopic] = {}
        for name, topic in self._topics.items():
            if topic.ephemeral:
                continue
            entry = None if every or name in stale or was.get(name) is not topic else kept.get(name)
            entries[name] = entry if entry is not None else encode_json(topic_entry(topic))
            sources[name] = topic
        self._entries, self._sources = entries, sources
