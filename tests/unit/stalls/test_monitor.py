"""The monitor says a stall once when it begins, again every stall_after_s while it lasts (or at once when
it moves to another hop), and once when the learner steps again; Redis that stops answering is the hop."""

import pytest
import redis

from asyncrlhf.config import load_config
from asyncrlhf.stalls import Flow, Hop, Replica, Wait, Waiting
from asyncrlhf.stalls.monitor import StallMonitor, silent_after_s

pytestmark = pytest.mark.unit


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


class Probe:
    """What FlowProbe reads, scripted."""

    def __init__(self, clock):
        self.clock, self.answered_at, self.answers = clock, 0.0, True
        self.flow_now = Flow(4, 0, 0, (Replica("gen-a", 30.0),))

    def redis_silent_s(self):
        if self.answers:
            self.answered_at = self.clock()
            return None
        return self.clock() - self.answered_at

    def flow(self):
        if not self.answers:
            raise redis.TimeoutError("no answer")
        return self.flow_now


def monitor(stall_after_s=10.0):
    cfg = load_config(["configs/tiny.yaml"], [f"launch.stall_after_s={stall_after_s}"])
    clock, said = Clock(), []
    return StallMonitor(cfg, Probe(clock), said.append, clock), clock, said


def test_a_stall_is_said_when_it_begins_again_each_stall_after_s_and_when_it_ends():
    m, clock, said = monitor()
    waiting = Waiting(Wait.SCORED_GROUPS, 0.0)
    assert m.check(9.0, waiting) is None and said == []
    for t in (10.0, 11.0, 15.0):
        clock.now = t
        stall = m.check(t, waiting)
        assert stall is not None and stall.hop is Hop.GENERATORS
    assert len(said) == 1 and said[0].startswith("stalled at generators: no generator alive: ")
    clock.now = 20.0
    m.check(20.0, waiting)
    assert len(said) == 2
    clock.now = 21.0
    assert m.check(0.5, waiting) is None
    assert said[-1] == "stall over: the learner steps again (stalled at generators for at least 20 s)"


def test_redis_that_stops_answering_moves_the_stall_to_redis_at_once():
    m, clock, said = monitor()
    clock.now = 10.0
    m.check(10.0, Waiting(Wait.SCORED_GROUPS, 0.0))
    m.probe.answers = False
    clock.now = 12.0
    stall = m.check(12.0, None)
    assert stall is not None and stall.hop is Hop.REDIS
    assert said[-1].startswith("stalled at redis: Redis not answering for 2 s")


def test_a_replica_is_silent_after_three_missed_heartbeats_or_reads():
    cfg = load_config(["configs/tiny.yaml"], ["generator.heartbeat_s=2", "redis.block_ms=1000"])
    assert silent_after_s(cfg) == 6.0
    cfg = load_config(["configs/tiny.yaml"], ["generator.heartbeat_s=0.5", "redis.block_ms=3000"])
    assert silent_after_s(cfg) == 9.0


def test_a_process_that_stops_answering_is_named_stall_or_not_and_again_when_it_answers():
    m, clock, said = monitor()
    m.check(1.0, None, silent_services=[("reward-1", 9.0)])
    assert said == []
    m.check(2.0, None, silent_services=[("reward-1", 10.0)])
    m.check(3.0, None, silent_services=[("reward-1", 11.0)])
    assert said == ["reward-1 alive but not answering /metrics for 10 s (frozen or hung?)"]
    m.check(4.0, None)
    assert said[-1] == "reward-1 answers /metrics again"


def test_redis_frozen_then_resumed_is_not_blamed_on_reward_while_the_backlog_drains():
    """The issue's run: Redis frozen past stall_after_s, then resumed with a step's worth of groups scored
    and queued while the learner's client is still in its back-off: the stall stays at Redis, said at once
    as recovering, until the learner reads again; only then is the evidence judged afresh."""
    m, clock, said = monitor(stall_after_s=5.0)
    waiting = Waiting(Wait.SCORED_GROUPS, 0.0)
    healthy = (Replica("gen-a", 1.0), Replica("gen-b", 1.0))
    m.probe.flow_now = Flow(0, 0, 4, healthy, (Replica("reward-1", 0.2),), learner_read="9-0")
    m.probe.answers = False
    for t in (5.0, 8.0, 20.0):  # frozen: named at once, repeated every stall_after_s
        clock.now = t
        assert m.check(t, waiting).hop is Hop.REDIS  # type: ignore[union-attr]
    m.probe.answers = True  # SIGCONT
    for t in (21.0, 25.0, 38.0):
        clock.now = t
        stall = m.check(t, waiting)
        assert stall is not None and (stall.hop, stall.recovering) == (Hop.REDIS, True)
    assert [line.split(":")[0] for line in said] == ["stalled at redis"] * len(said)
    assert said[-1].startswith("stalled at redis: recovering from: Redis not answering for 20 s")
    assert not any("reward" in line for line in said)
    m.probe.flow_now = Flow(0, 0, 0, healthy, (Replica("reward-1", 0.2),), learner_read="9-4")  # read
    clock.now = 39.0
    assert m.check(39.0, waiting).hop is Hop.PROMPTS  # type: ignore[union-attr]  # judged afresh
    clock.now = 40.0
    m.check(1.0, waiting)
    assert said[-1].startswith("stall over: the learner steps again (stalled at prompts") and m.cause is None
