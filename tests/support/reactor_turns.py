"""A task.Clock reactor run turn by turn, as a real reactor runs it; small publish chunks.

The broker publishes a big batch a chunk per reactor turn; with chunks of
`CHUNK` messages (the `small_chunks` fixture) a batch of a few thousand
spans many turns, and a test can look at the order of events turn by turn.
"""

from __future__ import annotations

# Small chunks, so a batch of a few thousand messages spans many turns.
CHUNK = 64


def turn(clock) -> int:
    """One reactor turn: run the calls due now that were scheduled before it began.

    What they schedule for "now" waits for the next turn, as in a real
    reactor (task.Clock.advance would run those too, i.e. all turns at once).
    """
    due = [c for c in clock.getDelayedCalls() if c.getTime() <= clock.seconds()]
    for call in due:
        if call.active():
            clock.calls.remove(call)
            call.called = 1
            call.func(*call.args, **call.kw)
    return len(due)


def run_turns(clock, until, limit: int = 100_000) -> int:
    """Turns until `until()` holds; how many it took."""
    for n in range(limit):
        if until():
            return n
        assert turn(clock), "nothing left to run"
    raise AssertionError("too many turns")
