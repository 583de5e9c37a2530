"""The two ways a step is collected, behind one interface, against a stand-in inbox (no Redis): `Bounded`
takes admitted groups as they come; `Windowed` holds them until the step their version is due."""

from __future__ import annotations

import threading

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.inbox.admission import Action, Known, Rules, admit
from asyncrlhf.inbox.bounded import Bounded
from asyncrlhf.inbox.strategy import Strategy
from asyncrlhf.inbox.windowed import HeldGroups, Windowed
from asyncrlhf.streams import Delivery
from asyncrlhf.version import PolicyVersion
from tests.unit.inbox.test_admission import K, group

pytestmark = pytest.mark.unit


def delivery(index: int, version: int) -> Delivery:
    g = group(version, lineage=1, gid=f"g0000000{index}")
    return Delivery(f"{index}-0".encode(), g.group_id, g, 1)


class Desk:
    """The inbox as a strategy sees it: arrivals in order, a credit count, every tick recorded."""

    def __init__(self, strategy: Strategy, arriving: list[Delivery], in_flight: int):
        self.strategy, self.arriving, self.in_flight, self.exhausted = strategy, arriving, in_flight, False
        self.stop = threading.Event()
        self.ticks: list[set[str]] = []  # what the strategy held at each tick
        self.filter_reason: str | None = None  # dynamic sampling on: the reason groups are filtered for

    def tick(self, version, while_waiting) -> None:
        self.ticks.append(set(self.strategy.holding()))
        while_waiting()
        if len(self.ticks) > 20:  # a strategy waiting for what never comes
            self.stop.set()

    def read(self, n: int) -> list[Delivery]:
        out, self.arriving = self.arriving[:n], self.arriving[n:]
        return out

    def keep(self, deliveries) -> None:
        self.kept = [d.identity for d in deliveries]

    def receive(self, d: Delivery, version: int, window=None, held=frozenset(), filtering=True):
        reason = self.filter_reason if filtering else None
        rules = Rules(K, max_staleness=1, stale_policy="drop", window=window, filter_reason=reason)
        known = Known(frozenset(), held=held)
        verdict = admit(d.identity, d.message, PolicyVersion(1, version), rules, known)
        if verdict.action in (Action.DROP, Action.FILTER):  # it ends: its credit is freed
            self.in_flight -= 1
        return verdict


def learner(mode: str, *overrides: str):
    return load_config(["configs/tiny.yaml"], [f"learner.staleness_mode={mode}", "learner.max_staleness=1",
                                               "learner.groups_per_step=2", *overrides]).learner


def collect(desk: Desk, version: int):
    return desk.strategy.collect(desk, version, desk.stop, lambda: None)


def test_bounded_takes_the_first_admitted_groups_in_id_order_and_skips_dropped_ones():
    strategy = Bounded(learner("bound"))
    # at version 3 with max_staleness 1: g2 (version 1) is 2 old, dropped; g3 and g1 are fresh
    desk = Desk(strategy, [delivery(3, 3), delivery(2, 1), delivery(1, 2)], in_flight=3)  # g2 ends: 2 left
    batch = collect(desk, 3)
    assert batch is not None and batch.ids() == ["g00000001", "g00000003"]
    assert [d.staleness for d in batch.decisions] == [1, 0]  # 3 - 2, 3 - 3
    assert desk.ticks == [set(), {"g00000003"}]  # a restart mid-collection counts them as present
    assert strategy.holding() == set()


def test_bounded_never_takes_a_group_twice_into_one_step():
    """A collect longer than redis.claim_idle_ms re-claims the learner's own pending entries: the same group
    read again (same entry, or another entry of it) is held, not trained twice in one step (a chaos run
    under load trained g00000085 twice in one step before this)."""
    again = delivery(3, 3)
    desk = Desk(Bounded(learner("bound")), [delivery(3, 3), again, delivery(1, 3)], in_flight=3)
    batch = collect(desk, 3)
    assert batch is not None and batch.ids() == ["g00000001", "g00000003"]
    assert desk.kept == ["g00000003", "g00000001"]  # the batch's entries are kept from re-claim meanwhile


def test_bounded_stops_when_the_prompt_set_is_exhausted_and_nothing_is_in_flight():
    desk = Desk(Bounded(learner("bound")), [], in_flight=0)
    desk.exhausted = True
    assert collect(desk, 1) is None


def test_windowed_waits_for_the_whole_window_when_a_step_trains_its_own_groups():
    strategy = Windowed(learner("exact"), HeldGroups(consumer=None, claim_idle_ms=10**9))
    # exact, N = 1, version 1: the initial policy's groups train step 1, and its window is the one open
    arriving = [delivery(4, 1), delivery(1, 1), delivery(2, 0), delivery(3, 1)]
    desk = Desk(strategy, arriving, in_flight=4)
    batch = collect(desk, 1)
    assert batch is not None and batch.ids() == ["g00000001", "g00000003"]  # the lowest ids of version 1
    assert strategy.holding() == {"g00000004"}  # g2 (version 0) was off-schedule: dropped, not held
    assert desk.arriving == []  # every enqueued group arrived before the step


def test_windowed_trains_an_earlier_window_while_the_current_one_generates():
    strategy = Windowed(learner("exact"), HeldGroups(consumer=None, claim_idle_ms=10**9))
    desk = Desk(strategy, [delivery(1, 1), delivery(2, 1)], in_flight=4)
    assert collect(desk, 1) is None  # 2 of 4 arrived, none more comes: stopped (the desk's bound)
    later = Desk(strategy, [], in_flight=2)
    batch = collect(later, 2)  # version 2 trains version 1's groups at once
    assert batch is not None and batch.ids() == ["g00000001", "g00000002"]
    assert [d.staleness for d in batch.decisions] == [1, 1]


def test_windowed_refuses_a_step_that_nothing_in_flight_can_fill():
    strategy = Windowed(learner("exact"), HeldGroups(consumer=None, claim_idle_ms=10**9))
    with pytest.raises(RuntimeError, match="needs 2 groups of version 1, 1 are left and none is in flight"):
        collect(Desk(strategy, [delivery(1, 1)], in_flight=1), 1)


def test_windowed_settles_once_every_group_of_the_window_arrived():
    strategy = Windowed(learner("exact"), HeldGroups(consumer=None, claim_idle_ms=10**9))
    desk = Desk(strategy, [delivery(5, 2), delivery(6, 2)], in_flight=4)  # 2 trained, 2 still coming
    strategy.settle(desk, 2, 2, desk.stop, lambda: None)
    assert strategy.holding() == {"g00000005", "g00000006"} and not desk.stop.is_set()


def informative(index: int, version: int, tied: bool) -> Delivery:
    d = delivery(index, version)
    for j, sample in enumerate(d.message.samples):
        sample.reward = 1.0 if tied else float(j)
    return d


def test_bounded_with_dynamic_sampling_reads_past_filtered_groups_until_the_step_is_full():
    strategy = Bounded(learner("bound", "learner.dynamic_sampling.enabled=true"))
    arriving = [informative(1, 3, tied=True), informative(2, 3, tied=False), informative(3, 3, tied=True),
                informative(4, 3, tied=False), informative(5, 3, tied=False)]
    desk = Desk(strategy, arriving, in_flight=5)
    desk.filter_reason = "zero_variance"
    batch = collect(desk, 3)
    assert batch is not None and batch.ids() == ["g00000002", "g00000004"]
    assert (batch.filtered, batch.capped) == (2, False)
    assert desk.in_flight == 3  # the two filtered groups ended: their credits are free for refills


def test_bounded_at_the_refill_cap_trains_what_it_has():
    # cap 0.5 x 2 groups = 1 filtered group: after g2 the step trains g1 alone
    strategy = Bounded(learner("bound", "learner.dynamic_sampling.enabled=true",
                               "learner.dynamic_sampling.refill_cap=0.5"))
    desk = Desk(strategy, [informative(1, 3, tied=False), informative(2, 3, tied=True),
                           informative(3, 3, tied=False)], in_flight=3)
    desk.filter_reason = "zero_variance"
    batch = collect(desk, 3)
    assert batch is not None and batch.ids() == ["g00000001"] and (batch.filtered, batch.capped) == (1, True)


def test_bounded_at_the_refill_cap_with_nothing_informative_fills_up_unfiltered():
    strategy = Bounded(learner("bound", "learner.dynamic_sampling.enabled=true",
                               "learner.dynamic_sampling.refill_cap=0.5"))
    desk = Desk(strategy, [informative(i, 3, tied=True) for i in (1, 2, 3)], in_flight=3)
    desk.filter_reason = "zero_variance"
    batch = collect(desk, 3)
    assert batch is not None and batch.ids() == ["g00000002", "g00000003"]  # g1 filtered, then no more
    assert (batch.filtered, batch.capped) == (1, True)
