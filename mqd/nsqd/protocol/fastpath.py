"""The V2 parser's fast paths: runs of plain FINs, and a publisher's PUBs gathered per read.

A reader acks every message and a publisher pipelines PUBs, so most reads
are runs of one command. These take a run in one pass instead of one
command at a time, and answer exactly as the general loop would: a
command they cannot take ends the run and is read again by the general
loop (V2Protocol._parse), for its error or to wait for more input.

FastPathMixin is a mixin of V2Protocol; plain_fins is the pure scan its
parser loop runs over a read for a run of FINs.
"""

from __future__ import annotations

from mqd.nsqd.protocol.params import valid_name
from mqd.wire.errors import ProtocolError
from mqd.wire.framing import INT32

__all__ = ["FastPathMixin", "plain_fins"]

_unpack_int32 = INT32.unpack_from

_FIN_LINE = 21  # b"FIN " + a 16-byte id + b"\n"
# What each line of a run of plain FINs has at these offsets.
_FIN_MARKS = ((0, b"F"), (1, b"I"), (2, b"N"), (3, b" "), (20, b"\n"))


def plain_fins(data: bytes, pos: int, end: int, ids: list[bytes]) -> int:
    """Append the ids of the plain FIN lines starting at `pos` to `ids`; where they stop.

    A reader acks every message, so a read is mostly lines of exactly
    b"FIN <16-byte id>\n": their ids are found with a few strided compares
    and sliced in one comprehension instead of a find and a split each.
    A line the general loop would read differently (a space or a newline
    inside the id, CRLF) ends the run here, and the caller reads it.
    """
    n = (end - pos) // _FIN_LINE
    if n < 2:
        return pos
    last = pos + n * _FIN_LINE
    for offset, mark in _FIN_MARKS:
        marks = data[pos + offset:last:_FIN_LINE]
        run = n - len(marks.lstrip(mark))
        if run < n:
            n = run
            last = pos + n * _FIN_LINE
    cr = data.find(b"\r", pos + 19, last)
    if cr >= 0:
        n = (cr - pos) // _FIN_LINE
        last = pos + n * _FIN_LINE
    if n < 1 or data.count(b" ", pos, last) != n or data.count(b"\n", pos, last) != n:
        return pos
    ids += [data[p:p + 16] for p in range(pos + 4, last, _FIN_LINE)]
    return last


class FastPathMixin:
    """Runs of FINs and PUBs in one pass, for V2Protocol."""

    def _pub_run(self, data: bytes, pos: int, eol: int, params: list[bytes]) -> int:
        """Gather a publisher's run of whole, valid PUBs from `pos`; where the first other command starts.

        What _cmd_pub does for each (go-nsq pipelines PUBs, many per read),
        without its calls and lookups per message. A PUB this cannot take
        (a bad name or size, a body still arriving, another command) ends
        the run and is parsed again by the caller, through _cmd_pub when
        it is a PUB, for its error or to wait for more.
        """
        end = len(data)
        max_msg = self.broker.options.max_msg_size
        bodies = self._pub_bodies
        topic_name = self._pub_topic
        while len(params) >= 2:
            name = valid_name(params[1])
            if name is None:
                break
            # The same command line again (a publisher pipelining to one
            # topic) needs no find, split or name check: only its body's.
            line = data[pos:eol + 1]
            line_len = len(line)
            while True:
                start = pos + line_len
                if start + 4 > end:
                    return pos
                size = _unpack_int32(data, start)[0]
                body_end = start + 4 + size
                if size <= 0 or size > max_msg or body_end > end:
                    return pos
                if name != topic_name:
                    self._flush_pubs()
                    self._pub_topic = topic_name = name
                    bodies = self._pub_bodies
                bodies.append(data[start + 4:body_end])
                pos = body_end
                if not data.startswith(line, pos):
                    break
            if data[pos:pos + 4] != b"PUB ":
                break
            eol = data.find(b"\n", pos)
            if eol < 0:
                break
            line_end = eol - 1 if data[eol - 1] == 13 else eol
            params = data[pos:line_end].split(b" ")
        return pos

    def _finish_run(self, ids: list[bytes], pending: set) -> None:
        """FIN the gathered ids in order, as many _cmd_fin calls would, in one pass per failure."""
        channel = self.channel
        count = len(ids)
        done = 0
        while done < count:
            n = channel.finish_run(self, ids, done)
            if n:
                channel.deliver_soon()
                done += n
            if done < count:
                try:
                    self._cmd_fin((b"FIN", ids[done]), b"", 0)
                except ProtocolError as err:
                    self._answer_error(err, pending)
                done += 1

    def _flush_pubs(self) -> None:
        """Publish the PUBs gathered from this read as one batch, then one OK each, in order.

        One pass through topic, channels and store instead of one per
        message. Only a connection that is not subscribed gathers, so a
        consumer that also publishes sees the same frames however its
        reads are split.
        """
        bodies = self._pub_bodies
        if not bodies:
            return
        self._pub_bodies = []
        topic_name, self._pub_topic = self._pub_topic, None
        self._publish("PUB", topic_name, bodies, replies=len(bodies))
