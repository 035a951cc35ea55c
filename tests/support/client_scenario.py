"""The scenario every third-party client runs against the broker, and its check.

PUB, MPUB and DPUB, then a consumer that requeues one message at once and
one with a delay, sees both again with attempts 2, and FINs everything
(tests/integration/node/scenario.js is the Node clients' copy of it).
"""

from __future__ import annotations

DEFER_MS = 500
REQUEUE_DELAY_MS = 300


def check_scenario(result: dict) -> None:
    """Every message finished; the requeues came back with attempts 2, after their delays."""
    deliveries = result["deliveries"]
    first = {}
    for body, attempts, at in deliveries:
        first.setdefault((body, attempts), at)
    assert set(first) == {("pub-1", 1), ("pub-1", 2), ("mpub-1", 1), ("mpub-1", 2),
                          ("mpub-2", 1), ("dpub-1", 1)}, deliveries
    assert len(deliveries) == 6, deliveries
    assert first[("mpub-1", 2)] - first[("mpub-1", 1)] >= REQUEUE_DELAY_MS / 1000 - 0.02
    assert first[("dpub-1", 1)] - result["deferred_at"] >= DEFER_MS / 1000 - 0.02
