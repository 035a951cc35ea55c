"""Messages, their ids, and the bytes a message frame puts on the wire.

A message is created once per publish and, for a topic with several
channels, copied once per extra channel: the copies share id, body and
timestamp but count their own attempts, as nsqd's do. A publish held in
memory only waits as a `Run` instead, and each channel makes its
Messages as it takes them.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import zlib
from typing import Any, Protocol

__all__ = ["Message", "IdFactory", "IdTimeLease", "Run", "channel_copies", "new_messages", "new_run",
           "run_messages", "default_node_id", "frame_message", "id_time", "id_time_span", "FRAME_HEAD",
           "ID_SIZE"]

# [size][frame type 2][timestamp ns][attempts]: a message frame up to its id,
# packed in one call on the delivery path; the id and body follow as they
# are held (Message.data).
FRAME_HEAD = struct.Struct(">iiqH")
FRAME_TYPE_MESSAGE = 2
ID_SIZE = 16
_HEADER_OVERHEAD = FRAME_HEAD.size - 4  # what the size field counts besides id and body


class Message:
    """One message in one queue.

    Held as compactly as a backlog of millions needs: the id and body are
    one bytes object (`data`, the frame's tail as it goes on the wire), and
    one slot (`state`) holds whichever of the message's states applies:
    None while it waits to be delivered, the time it is due (a float) while
    deferred, and its delivery `(client, delivered_at)` while in flight (one
    tuple shared by the messages of one delivery). `id`, `body`,
    `deferred_until`, `client` and `delivered_at` read them. The delivery
    lives on the message itself so that FIN/REQ/TOUCH are one dict lookup
    and the in-flight heap can drop entries lazily without a second index
    (an entry is live for the messages whose state is still its own).

    `id_key` is the id as a bytes object of its own, made once for a
    message that a topic copies to further channels and shared by all its
    copies, or None: the in-flight tables of the channels then key their
    deliveries by that one object, hashed once, instead of each cutting and
    hashing an id of its own on every delivery. A message of a single
    channel leaves it None and costs nothing more (the sixth slot fits the
    same 80-byte allocation as five).
    """

    __slots__ = ("data", "timestamp", "attempts", "state", "key", "id_key")

    data: bytes
    timestamp: int
    attempts: int
    # The due time (float), (client, delivered_at) in flight, or None: typed Any
    # because the hot paths index it without a check (its owner knows which).
    state: Any
    key: bytes | None
    id_key: bytes | None

    def __init__(
        self,
        id: bytes,
        body: bytes,
        timestamp: int,
        attempts: int = 0,
        deferred_until: float = 0.0,
    ) -> None:
        self.fill(id + body, timestamp, attempts, deferred_until)

    @classmethod
    def of(cls, data: bytes, timestamp: int, attempts: int = 0, deferred_until: float = 0.0) -> Message:
        """A message from its `data` (id then body), as a store's record holds them."""
        msg = _new(cls)
        msg.fill(data, timestamp, attempts, deferred_until)
        return msg

    def fill(self, data: bytes, timestamp: int, attempts: int, deferred_until: float) -> None:
        """Set every field: what a new message starts with (no store key, no shared id)."""
        self.data = data
        self.timestamp = timestamp
        self.attempts = attempts
        # Absolute reactor time at which a deferred message becomes due; none
        # means "deliverable now". Absolute rather than a duration so that a
        # DPUB held at a topic without channels keeps its original due time.
        self.state = float(deferred_until) if deferred_until else None
        # Where a store keeps this message until it is FINished; None for
        # messages only held in memory.
        self.key = None
        self.id_key = None

    @property
    def id(self) -> bytes:
        """The id: the object the channel copies share, else cut from `data`."""
        return self.id_key or self.data[:ID_SIZE]

    @property
    def body(self) -> bytes:
        return self.data[ID_SIZE:]

    @property
    def body_size(self) -> int:
        return len(self.data) - ID_SIZE

    @property
    def deferred_until(self) -> float:
        """When a deferred message is due (reactor seconds); 0.0 for one due now or in flight."""
        # Any: mypy does not narrow on `__class__ is tuple`, kept as the fastest test.
        state: Any = self.state
        return 0.0 if state is None or state.__class__ is tuple else state

    @deferred_until.setter
    def deferred_until(self, due: float) -> None:
        self.state = float(due) if due else None

    @property
    def client(self):
        """The client the message is in flight to, or None."""
        state = self.state
        return state[0] if state.__class__ is tuple else None

    @property
    def delivered_at(self) -> float:
        """When the message was delivered (reactor seconds), while it is in flight; else 0.0."""
        state = self.state
        return state[1] if state.__class__ is tuple else 0.0

    def copy(self) -> Message:
        """A fresh copy for another channel: same id/body/timestamp, own attempts."""
        return Message.of(self.data, self.timestamp, self.attempts, self.deferred_until)

    def __repr__(self) -> str:
        body = self.body
        return (
            f"Message(id={self.id!r}, attempts={self.attempts}, "
            f"body={body[:32]!r}{'...' if len(body) > 32 else ''})"
        )


_new = object.__new__


def new_messages(ids: list[bytes], bodies: list[bytes], timestamp: int) -> list[Message]:
    """`[Message(i, b, timestamp) for ...]` for a publish: built in one loop, as `channel_copies`."""
    out: list[Message] = []
    append = out.append
    for msg_id, body in zip(ids, bodies, strict=True):
        m = _new(Message)
        m.data = msg_id + body
        m.timestamp = timestamp
        m.attempts = 0
        m.state = None
        m.key = None
        m.id_key = None
        append(m)
    return out


def channel_copies(msgs: list[Message]) -> list[Message]:
    """`[m.copy() for m in msgs]`, for the fan-out of a topic to its channels.

    A topic with N channels makes N-1 copies of every message it is given,
    which is most of a many-channel broker's work: here each copy is built
    in one loop without a call per message (about 30% less time than
    `copy()`). The fields are `of`'s, for a copy that no channel has seen
    yet: a delivery's state is not the copy's. The original and every copy
    share one `id_key`, made here on the first copy.
    """
    out: list[Message] = []
    append = out.append
    for m in msgs:
        key = m.id_key
        if key is None:
            key = m.id_key = m.data[:ID_SIZE]
        c = _new(Message)
        c.id_key = key
        c.data = m.data
        c.timestamp = m.timestamp
        c.attempts = m.attempts
        state = m.state
        c.state = None if state.__class__ is tuple else state
        c.key = None
        append(c)
    return out


class Run:
    """The messages of one publish, held in memory compactly until a queue takes them.

    A publish that no store keeps and that is not deferred makes a run
    instead of a `Message` per message and channel: one list of `data`
    (each message's id then body, as a Message holds it) and the
    publish's timestamp. Every queue the topic puts it in holds the same
    run and knows how far it has taken it (mqd.nsqd.overflow.MemQueue),
    so a queued message costs its bytes and one list slot however many
    channels hold it. A queue makes the `Message` objects when it hands
    messages out (`run_messages`): each starts as a new message does, no
    attempts, no deferral, no store key.

    `keys` is None for a run held by one queue. A run fanned out to
    several channels (`share`) gets the ids cut out of `data`, made by
    whichever channel takes a message first and given to every channel's
    Message of it (`id_key`, as `channel_copies` shares one): the
    in-flight tables then hash one object per message, not one per channel.
    """

    __slots__ = ("datas", "timestamp", "keys")

    datas: list[bytes]
    timestamp: int
    keys: list[bytes] | None

    def __init__(self, datas: list[bytes], timestamp: int) -> None:
        self.datas = datas
        self.timestamp = timestamp
        self.keys = None

    def __len__(self) -> int:
        return len(self.datas)

    def share(self) -> None:
        """The run goes to several channels: their copies of a message will share one id object."""
        if self.keys is None:
            self.keys = []

    def __repr__(self) -> str:
        return f"Run({len(self.datas)} messages, timestamp={self.timestamp})"


def new_run(ids: list[bytes], bodies: list[bytes], timestamp: int) -> Run:
    """The run of a publish: `new_messages` without a Message per message."""
    return Run([i + b for i, b in zip(ids, bodies, strict=True)], timestamp)


def run_messages(run: Run, start: int, stop: int, keyed: bool = True) -> list[Message]:
    """Messages `start` to `stop` of `run`, made now: what a queue hands out of a run.

    As `new_messages` builds them; a shared run's copies get its id objects
    (made here for the messages no channel has taken yet), unless not
    `keyed`: Messages only to be read (a peek, a snapshot's capture) leave
    the run's ids as they are.
    """
    datas = run.datas
    ts = run.timestamp
    keys = run.keys if keyed else None
    out: list[Message] = []
    append = out.append
    if keys is None:
        for data in datas[start:stop]:
            m = _new(Message)
            m.data = data
            m.timestamp = ts
            m.attempts = 0
            m.state = None
            m.key = None
            m.id_key = None
            append(m)
        return out
    made = len(keys)
    if made < stop:
        keys += [d[:ID_SIZE] for d in datas[made:stop]]
    for data, key in zip(datas[start:stop], keys[start:stop], strict=True):
        m = _new(Message)
        m.data = data
        m.timestamp = ts
        m.attempts = 0
        m.state = None
        m.key = None
        m.id_key = key
        append(m)
    return out


def frame_message(msg: Message) -> bytes:
    """The complete message frame, for callers off the hot path (tests, tools)."""
    return (
        FRAME_HEAD.pack(_HEADER_OVERHEAD + len(msg.data), FRAME_TYPE_MESSAGE, msg.timestamp, msg.attempts)
        + msg.data
    )


def default_node_id() -> int:
    """nsqd's default --node-id: crc32(md5(hostname)) mod 1024."""
    digest = hashlib.md5(socket.gethostname().encode()).digest()
    return zlib.crc32(digest) % 1024


# nsqd's snowflake layout: (pseudo-ms since twepoch) << 22 | node << 12 | seq,
# where a "pseudo-ms" is UnixNano >> 20 (about 1.05 ms).
_TWEPOCH = 1288834974657
_SEQ_BITS = 12
_NODE_BITS = 10
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_SEQ_HEX = [b"%03x" % seq for seq in range(_SEQ_MASK + 1)]
# A limit no id time reaches: a factory without a lease is never stopped by one.
_NO_LIMIT = 1 << 64


def id_time(now_ns: int) -> int:
    """The time field of an id made at `now_ns` (ns since the Unix epoch): pseudo-ms since twepoch."""
    return (now_ns >> 20) - _TWEPOCH


def id_time_span(seconds: float) -> int:
    """How many id time units (pseudo-ms, 2**20 ns) make `seconds`."""
    return int(seconds * 1e9) >> 20


class IdTimeLease(Protocol):
    """What keeps an IdFactory's times persisted ahead of the ids it issues (the broker's id lease)."""

    def extend(self, ids: IdFactory, end: int) -> None:
        """Ids up to time `end` are about to be issued: have a limit above it granted (`ids.grant`).

        When `end` is below the factory's limit this may happen later, in
        the background; otherwise it must be done (persisted and granted)
        before returning, or raise: the factory issues nothing at or past
        a limit not granted.
        """


class IdFactory:
    """Unique 16-character hex message ids, laid out as nsqd lays them out.

    nsqd refuses to publish when a pseudo-millisecond's 4096 sequence numbers
    run out and retries later; here the factory borrows the next
    pseudo-millisecond instead, so ids stay unique and increasing without
    ever failing a publish.

    An id's time is the clock's or, when the clock is behind the last id
    issued (stepped back, or its pseudo-ms used up), the last id's: ids
    never go backwards within a run, whatever the clock does. Across runs
    a lease (`IdTimeLease`) keeps that true: the factory issues ids only
    below the limit the lease has granted (persisted), asks for more
    before reaching it, and the next run starts at or above the limit
    (`start_at`). Without a lease (a topic built alone, in tests) there is
    no limit.
    """

    __slots__ = ("_node", "_last_ts", "_seq", "_renew_at", "_limit", "_lease")

    def __init__(self, node_id: int, lease: IdTimeLease | None = None) -> None:
        if not 0 <= node_id < (1 << _NODE_BITS):
            raise ValueError(f"node-id must be in [0,1024), got {node_id}")
        self._node = node_id << _SEQ_BITS
        self._last_ts = 0
        self._seq = 0
        self._lease = lease
        # Ids are issued only below _limit; from _renew_at on each batch asks
        # the lease for more (in the background until _limit is reached).
        self._limit = self._renew_at = _NO_LIMIT if lease is None else 0

    def held_by(self, lease: IdTimeLease) -> None:
        """From now on ids are issued only below what `lease` grants (nothing yet)."""
        self._lease = lease
        self._limit = self._renew_at = 0

    def start_at(self, floor: int) -> None:
        """No id from now on has a time below `floor` (a restart: the last run's bound)."""
        if floor > self._last_ts:
            self._last_ts = floor
            self._seq = 0

    def grant(self, limit: int, renew_at: int) -> None:
        """Ids may have times below `limit` (persisted); from `renew_at` on, the lease is asked for more.

        It may lower the limit too: at shutdown nothing more is issued.
        """
        self._limit = limit
        self._renew_at = min(renew_at, limit)

    @property
    def limit(self) -> int:
        """Every id issued so far, and until the next grant, has a time below this."""
        return self._limit

    @property
    def issued_below(self) -> int:
        """A time above every id issued so far: what the next run must start at (at least)."""
        return self._last_ts + 1

    def new_ids(self, count: int, now_ns: int) -> list[bytes]:
        """`count` fresh ids: one call per publish batch, not per message.

        Raises what the lease raises when it cannot extend a limit the
        batch would reach (nothing is issued then).
        """
        ts = (now_ns >> 20) - _TWEPOCH
        if ts > self._last_ts:
            self._last_ts = ts
            self._seq = 0
        seq = self._seq
        if count == 1 and seq <= _SEQ_MASK and self._last_ts < self._renew_at:
            # A PUB's one id, without the batch machinery.
            self._seq = seq + 1
            return [b"%016x" % ((self._last_ts << (_SEQ_BITS + _NODE_BITS)) | self._node | seq)]
        # The time of the batch's last id: a sequence run out borrows the next pseudo-ms.
        end = self._last_ts + ((seq + count - 1) >> _SEQ_BITS)
        if end >= self._renew_at:
            self._extend(end)
        ids: list[bytes] = []
        while count:
            room = _SEQ_MASK + 1 - self._seq
            if room <= 0:
                self._last_ts += 1
                self._seq = 0
                room = _SEQ_MASK + 1
            take = count if count < room else room
            # The sequence is the id's last three hex digits (_SEQ_BITS = 12):
            # the other thirteen are the same for the whole run, so each id
            # is a concatenation, not a formatting of a 64-bit number.
            prefix = b"%013x" % ((self._last_ts << _NODE_BITS) | (self._node >> _SEQ_BITS))
            seq = self._seq
            ids.extend([prefix + suffix for suffix in _SEQ_HEX[seq:seq + take]])
            self._seq = seq + take
            count -= take
        return ids

    def _extend(self, end: int) -> None:
        """The batch reaches `end`: ask the lease for more; past the limit, only once it is granted."""
        lease = self._lease
        if lease is None:
            raise RuntimeError("id factory without a lease has a limit")
        lease.extend(self, end)
        if end >= self._limit:
            raise RuntimeError(f"id lease not extended past {end} (limit {self._limit})")
