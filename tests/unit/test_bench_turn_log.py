"""The durable floors' log (bench/harness/turn_log.py): one chunk a turn, one sync for all waiting, landing in order.

The floors it serves are only floors if nothing is released before its
chunk is on disk, and if chunks that queued behind a sync share the next
one. The writer thread is a ThreadedClock's, run when the test says.
"""

from __future__ import annotations

from bench.harness.turn_log import TurnLog
from tests.support.threaded_clock import ThreadedClock


class _Owner:
    """What a floor hands the log: a token per chunk to release, and what was released."""

    def __init__(self) -> None:
        self.next = 0
        self.landed: list[list[int]] = []

    def take(self) -> int:
        self.next += 1
        return self.next

    def land(self, taken: list) -> None:
        self.landed.append(taken)


def _log(tmp_path, clock) -> tuple[TurnLog, _Owner]:
    owner = _Owner()
    return TurnLog(clock, str(tmp_path / "floor.log"), 4096, owner.take, owner.land), owner


def test_chunks_cut_while_the_writer_is_busy_share_one_write_and_land_in_order(tmp_path):
    clock = ThreadedClock()
    log, owner = _log(tmp_path, clock)
    log.pieces.append(b"first")
    log.turn()
    log.turn()  # one cut a turn, however many records
    clock.advance(0)
    log.pieces.append(b"second")
    log.turn()
    clock.advance(0)
    assert len(clock.jobs) == 1  # the second chunk waits for the running writer
    assert clock.run_threads() == 1
    assert owner.landed == []  # synced, handed back on the reactor's next turn
    clock.advance(0)
    assert owner.landed == [[1, 2]]
    assert (tmp_path / "floor.log").read_bytes().startswith(b"firstsecond")


def test_close_with_a_write_queued_lets_it_land_and_closes_the_file_after_it(tmp_path):
    clock = ThreadedClock()
    log, owner = _log(tmp_path, clock)
    log.pieces.append(b"kept")
    log.turn()
    clock.advance(0)
    log.pieces.append(b"dropped")
    log.turn()
    log.close()
    fd = log.file._fd
    assert fd >= 0  # the writer still has a chunk to write
    clock.run_threads()
    clock.advance(0)
    assert owner.landed == [[1]]
    assert log.file._fd == -1
    data = (tmp_path / "floor.log").read_bytes()
    assert data.startswith(b"kept") and b"dropped" not in data
    log.turn()
    clock.advance(0)
    assert clock.jobs == []  # nothing is cut after close


def test_close_with_nothing_written_closes_the_file_at_once(tmp_path):
    clock = ThreadedClock()
    log, _ = _log(tmp_path, clock)
    log.close()
    assert log.file._fd == -1
