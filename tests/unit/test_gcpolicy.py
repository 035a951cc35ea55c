"""The broker's GC policy: freeze long-lived survivors, thaw on a schedule, restore on stop."""

from __future__ import annotations

import gc
import weakref

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock

from mqd.nsqd.gcpolicy import YOUNG_THRESHOLD, GCPolicy
from mqd.options import MQD_OPTIONS, resolve

INTERVAL = 300.0


class Node:
    """A GC-tracked object that can be part of a cycle and weakly referenced."""

    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def policy():
    """A started policy on a task.Clock, stopped (and the process's GC state checked) after."""
    callbacks = list(gc.callbacks)
    threshold = gc.get_threshold()
    enabled = gc.isenabled()
    # Only the tests' explicit collections run, so what is frozen when is exact.
    gc.disable()
    clock = Clock()
    svc = GCPolicy(clock, thaw_interval=INTERVAL)
    svc.startService()
    yield svc
    if svc.running:
        svc.stopService()
    gc.unfreeze()
    if enabled:
        gc.enable()
    assert gc.callbacks == callbacks
    assert gc.get_threshold() == threshold


def test_start_freezes_what_start_up_built_and_hooks_the_collector(policy):
    assert gc.get_freeze_count() > 0
    assert policy._collected in gc.callbacks
    assert [call.getTime() for call in policy.clock.getDelayedCalls()] == [INTERVAL]


def _frozen(objects) -> bool:
    """All of `objects` are in the permanent generation, which gc.get_objects() leaves out.

    By identity, not by gc.get_freeze_count(): that count also drops when a
    frozen object left by an earlier test dies meanwhile.
    """
    ids = {id(o) for o in objects}
    return not ids & {id(o) for o in gc.get_objects()}


@pytest.mark.parametrize("generation", [0, 1, 2])
def test_survivors_of_every_collection_are_frozen(policy, generation):
    kept = [Node() for _ in range(1000)]
    tracked = {id(o) for o in gc.get_objects()}
    assert all(id(n) in tracked for n in kept)  # young: the next collection traverses them
    gc.collect(generation)
    assert _frozen(kept)
    assert all(gc.is_tracked(n) for n in kept)


def test_a_burst_freed_soon_after_sets_off_no_collection_and_growth_does(policy):
    """A fan-out's copies, FINed a little later, cost no collection; a backlog building up still does."""
    started: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(count)
    gc.enable()
    try:
        for _ in range(20):
            burst = [Node() for _ in range(5_000)]  # CPython's own threshold (700) collects in each
            del burst
        assert started == []
        backlog = [Node() for _ in range(YOUNG_THRESHOLD + 1_000)]
        assert started == [0]
    finally:
        gc.disable()
        gc.callbacks.remove(count)
    assert _frozen(backlog[:1_000])  # alive at that collection: frozen, never traversed again


def test_frozen_object_is_still_freed_by_reference_counting(policy):
    node = Node()
    gc.collect(1)
    ref = weakref.ref(node)
    del node
    assert ref() is None


def test_frozen_cycle_waits_for_the_thaw_then_is_reclaimed(policy):
    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    gc.collect(2)  # alive: frozen with the other survivors
    del a, b
    gc.collect()
    assert ref() is not None  # frozen garbage is not traversed
    policy.clock.advance(INTERVAL - 1)
    assert ref() is not None and policy.thaws == 0
    policy.clock.advance(1)
    assert ref() is None and policy.thaws == 1
    assert gc.get_freeze_count() > 0  # the survivors are frozen again
    policy.clock.advance(INTERVAL)
    assert policy.thaws == 2


def test_stop_unhooks_unfreezes_and_cancels_the_thaw():
    callbacks = list(gc.callbacks)
    threshold = gc.get_threshold()
    clock = Clock()
    svc = GCPolicy(clock, thaw_interval=INTERVAL)
    svc.startService()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (YOUNG_THRESHOLD, *threshold[1:])
    svc.stopService()
    assert gc.callbacks == callbacks
    assert gc.get_threshold() == threshold
    assert gc.get_freeze_count() == 0
    assert clock.getDelayedCalls() == []
    gc.collect(2)
    assert gc.get_freeze_count() == 0  # no hook left to freeze


def test_broker_service_tree_has_the_policy_on_the_reactor(tmp_path):
    from mqd.nsqd.tap import build_service

    reactor = MemoryReactorClock()
    top = build_service(resolve(MQD_OPTIONS, {"data-path": str(tmp_path), "backend": "memory"}),
                        reactor)
    [svc] = [s for s in top if isinstance(s, GCPolicy)]
    assert svc.clock is reactor and svc.thaw_interval == INTERVAL
