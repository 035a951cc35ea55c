"""Publishing from a V2 connection: nsqd's checks of a topic parameter and of an MPUB body.

The checks nsqd makes of a publishing command's topic name, the bound on
an MPUB body mqd keeps in memory, and the error nsqd sends for an MPUB
body that failed a check (mqd.nsqd.batches's reasons). The publishing
itself, its answer and big MPUBs over several turns are the protocol's
(mqd.nsqd.protocol.v2).
"""

from __future__ import annotations

from collections.abc import Sequence

from mqd.nsqd.batches import BAD_SIZE, NO_SIZE, TOO_BIG, TRAILING, BatchError
from mqd.nsqd.protocol.params import valid_name
from mqd.wire.errors import ProtocolError, fatal, go_quote

__all__ = ["mpub_error", "mpub_limit", "publish_topic"]


def publish_topic(verb: str, params: Sequence[bytes], min_params: int, code_prefix: str = "") -> str:
    """The topic a PUB, MPUB or DPUB names, or nsqd's fatal error for its parameters."""
    if len(params) < min_params:
        raise fatal("E_INVALID", f"{verb} insufficient number of parameters")
    topic_name = valid_name(params[1])
    if topic_name is None:
        raise fatal("E_BAD_TOPIC", f"{code_prefix}{verb} topic name {go_quote(params[1])} is not valid")
    return topic_name


def mpub_limit(max_body_size: int, count: int) -> int:
    """The most bytes an MPUB body of `count` messages may take after its declared size.

    nsqd reads up to count x (4 + max-msg-size) bytes whatever the declared
    size; mqd keeps a pending MPUB in memory, so it bounds the messages'
    own bytes by max-body-size: the count, the sizes, and max-body-size.
    That takes both forms clients send (declared = the whole body, or the
    messages' bytes only) up to max-body-size.
    """
    return 4 + 4 * count + max_body_size


def mpub_error(err: BatchError, max_msg: int, size: int) -> ProtocolError:
    """nsqd's error for an MPUB body that failed a check (mqd.nsqd.batches's reasons)."""
    reason = err.reason
    if reason == NO_SIZE:
        return fatal("E_BAD_MESSAGE", f"MPUB failed to read message({err.index}) body size")
    if reason == BAD_SIZE:
        return fatal("E_BAD_MESSAGE", f"MPUB invalid message({err.index}) body size {err.size}")
    if reason == TOO_BIG:
        return fatal("E_BAD_MESSAGE", f"MPUB message too big {err.size} > {max_msg}")
    if reason == TRAILING:
        return fatal("E_BAD_BODY", f"MPUB invalid body size {size}")
    return fatal("E_BAD_MESSAGE", "MPUB failed to read message body")

