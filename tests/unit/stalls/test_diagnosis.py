"""The stall judgement on hand-made evidence, one case per hop: the message names the hop and quotes the
evidence. No Redis: the evidence is what asyncrlhf.stalls.evidence would have read."""

import pytest

from asyncrlhf.stalls import Cause, Evidence, Flow, Hop, Replica, Wait, diagnose
from asyncrlhf.stalls.diagnosis import Expected

pytestmark = pytest.mark.unit
TWO_EACH = Expected(generators=2, rewards=2, silent_after_s=6.0)
HEALTHY_GENERATORS = (Replica("gen-a", 1.0), Replica("gen-b", 0.5))
HEALTHY_REWARDS = (Replica("reward-1", 0.2), Replica("reward-2", 0.4))


def waiting_for_groups(flow: Flow | None, **kw) -> Evidence:
    return Evidence(stepless_s=75.0, expected=TWO_EACH, wait_on=Wait.SCORED_GROUPS, waited_s=75.0, flow=flow,
                    **kw)


def test_no_stall_before_stall_after_s():
    e = waiting_for_groups(Flow(12, 0, 0, (Replica("gen-b", 75.0),)))
    assert diagnose(e, stall_after_s=76.0) is None
    assert diagnose(e, stall_after_s=75.0) is not None  # the bound itself is a stall


def test_the_issue_example_no_generator_alive():
    # gen-a left the registry long ago (forgotten), gen-b stopped heart-beating 75 s ago: 0 of 2 alive.
    flow = Flow(prompts=12, rollouts=0, scored=0, generators=(Replica("gen-b", 75.0, holding=4),),
                rewards=HEALTHY_REWARDS)
    stall = diagnose(waiting_for_groups(flow), 60.0)
    assert stall is not None and stall.hop is Hop.GENERATORS
    assert stall.message == (
        "no generator alive: waiting 75 s for scored groups: prompts queued 12, rollouts 0, scored 0; "
        "generators alive 0 of 2 (gen-b last heartbeat 75 s ago)")


def test_a_wait_that_began_after_the_last_step_says_both():
    # The push gave up after 10 s; the learner then began waiting for scored groups.
    flow = Flow(8, 0, 0, (Replica("gen-a", 12.0), Replica("gen-b", 12.0)))
    e = Evidence(stepless_s=12.0, expected=TWO_EACH, wait_on=Wait.SCORED_GROUPS, waited_s=0.4, flow=flow)
    stall = diagnose(e, 10.0)
    assert stall is not None and stall.message.startswith(
        "no generator alive: waiting 0 s (no step for 12 s) for scored groups: prompts queued 8, rollouts 0")
    assert "reward replicas" not in stall.message  # no rollouts: idle replicas say nothing (Redis < 7.2)


def test_redis_not_answering_comes_first_whatever_else_is_known():
    e = waiting_for_groups(None, redis_silent_s=40.0, learner_silent_s=40.0)
    stall = diagnose(e, 30.0)
    assert stall is not None and stall.hop is Hop.REDIS
    assert stall.message.startswith("Redis not answering for 40 s (learner's last step 75 s ago")


def test_a_frozen_learner_is_named_by_its_silent_metrics_endpoint():
    e = Evidence(stepless_s=40.0, expected=TWO_EACH, flow=Flow(0, 0, 8, HEALTHY_GENERATORS, HEALTHY_REWARDS),
                 learner_silent_s=38.0)
    stall = diagnose(e, 30.0)
    assert stall is not None and stall.hop is Hop.LEARNER
    assert stall.message == ("learner not stepping for 40 s: process alive but its metrics endpoint does "
                             "not answer for 38 s")


def test_a_push_to_a_frozen_generator_names_the_push_and_the_generator():
    flow = Flow(4, 0, 0, (Replica("gen-a", 1.0), Replica("gen-b", 12.0)), HEALTHY_REWARDS)
    e = Evidence(stepless_s=14.0, expected=TWO_EACH, wait_on=Wait.PUSH, waited_s=12.0,
                 wait_detail="gen-a, gen-b", flow=flow)
    stall = diagnose(e, 10.0)
    assert stall is not None and stall.hop is Hop.PUSH
    assert stall.message == ("weight push not finishing: waiting 12 s for the push to gen-a, gen-b; "
                             "generators alive 1 of 2 (gen-b last heartbeat 12 s ago)")


def test_one_silent_generator_holding_prompts_is_named_while_the_other_lives():
    flow = Flow(6, 0, 0, (Replica("gen-a", 1.0), Replica("gen-b", 20.0, holding=4)), HEALTHY_REWARDS)
    stall = diagnose(waiting_for_groups(flow), 10.0)
    assert stall is not None and stall.hop is Hop.GENERATORS
    assert stall.message.startswith("generator gen-b silent for 20 s holding 4 prompts: waiting 75 s")
    assert "generators alive 1 of 2 (gen-b last heartbeat 20 s ago)" in stall.message


def test_a_silent_reward_replica_holding_rollouts_is_named():
    rewards = (Replica("reward-1", 0.3), Replica("reward-2", 12.0, holding=3))
    flow = Flow(0, 3, 0, HEALTHY_GENERATORS, rewards)
    stall = diagnose(waiting_for_groups(flow), 10.0)
    assert stall is not None and stall.hop is Hop.REWARD
    assert stall.message.startswith("reward replica reward-2 silent for 12 s holding 3 rollouts: ")
    assert stall.message.endswith("reward replicas reading 1 of 2")


def test_a_silent_replica_that_holds_nothing_is_not_blamed():
    # A dead consumer of an earlier process keeps growing idle in XINFO CONSUMERS, holding nothing.
    rewards = (Replica("reward-old", 900.0), Replica("reward-1", 0.3))
    flow = Flow(5, 0, 0, HEALTHY_GENERATORS, rewards)
    stall = diagnose(waiting_for_groups(flow), 10.0)
    assert stall is not None and stall.hop is Hop.GENERATORS
    assert stall.message.startswith("generators not keeping up: ")


def test_rollouts_waiting_and_no_reward_replica_reading():
    flow = Flow(0, 8, 0, HEALTHY_GENERATORS, (Replica("reward-1", 40.0),))
    stall = diagnose(waiting_for_groups(flow), 10.0)
    assert stall is not None and stall.hop is Hop.REWARD
    assert stall.message.startswith("no reward replica reading: ")
    assert "reward replicas reading 0 of 2" in stall.message


def test_nothing_in_flight_names_the_prompts():
    stall = diagnose(waiting_for_groups(Flow(0, 0, 0, HEALTHY_GENERATORS, HEALTHY_REWARDS)), 10.0)
    assert stall is not None and stall.hop is Hop.PROMPTS
    assert "learner.data_epochs" in stall.message


def test_a_learner_that_waits_on_nothing_is_busy_in_its_own_work():
    e = Evidence(stepless_s=400.0, expected=TWO_EACH, flow=Flow(8, 0, 4, HEALTHY_GENERATORS))
    stall = diagnose(e, 300.0)
    assert stall is not None and stall.hop is Hop.LEARNER
    assert stall.message.startswith("learner busy for 400 s in its own work")


def test_processes_not_answering_are_appended_as_evidence():
    flow = Flow(3, 0, 0, (Replica("gen-a", 1.0), Replica("gen-b", 9.0, holding=3)), HEALTHY_REWARDS)
    e = waiting_for_groups(flow, silent_services=(("generator-1", 8.4),))
    stall = diagnose(e, 10.0)
    assert stall is not None and stall.message.endswith("; not answering /metrics: generator-1 for 8 s")


REDIS_CAUSE = Cause(Hop.REDIS, "Redis not answering for 20 s (learner's last step 20 s ago; every service "
                               "waits on it)", learner_read="1700000000000-3")
# Redis answers again: a step's worth of groups scored and queued, every replica healthy, the learner not yet
# back to reading (its client still in its reconnect back-off): on this evidence alone, reward is "slow"
DRAINING = Flow(prompts=0, rollouts=0, scored=4, generators=HEALTHY_GENERATORS, rewards=HEALTHY_REWARDS,
                learner_read="1700000000000-3")


def test_a_cleared_cause_stays_named_while_the_backlog_drains():
    alone = diagnose(waiting_for_groups(DRAINING), 5.0)
    assert alone is not None and alone.hop is Hop.REWARD  # what the issue saw after SIGCONT
    stall = diagnose(waiting_for_groups(DRAINING, cause=REDIS_CAUSE), 5.0)
    assert stall is not None and (stall.hop, stall.recovering) == (Hop.REDIS, True)
    assert stall.message == (
        "recovering from: Redis not answering for 20 s (learner's last step 20 s ago; every service waits on "
        "it); the pipeline has not moved since (the learner has read no scored group): waiting 75 s for "
        "scored groups: prompts queued 0, rollouts 0, scored 4; generators alive 2 of 2")
    # the cause was judged while Redis was silent (no read position known): the first one read counts
    unknown = Cause(Hop.REDIS, REDIS_CAUSE.message, learner_read=None)
    assert diagnose(waiting_for_groups(DRAINING, cause=unknown), 5.0).hop is Hop.REDIS  # type: ignore[union-attr]


def test_a_cleared_cause_gives_way_once_the_learner_reads_again():
    moved = Flow(0, 0, 2, HEALTHY_GENERATORS, HEALTHY_REWARDS, learner_read="1700000000000-5")
    stall = diagnose(waiting_for_groups(moved, cause=REDIS_CAUSE), 5.0)
    assert stall is not None and (stall.hop, stall.recovering) == (Hop.REWARD, False)
    assert stall.message.startswith("reward replicas not keeping up: ")


def test_a_cause_upstream_of_the_earlier_one_is_named_at_once():
    earlier = Cause(Hop.REWARD, "reward replicas not keeping up: ...", learner_read="1700000000000-3")
    stall = diagnose(waiting_for_groups(None, redis_silent_s=9.0, cause=earlier), 5.0)
    assert stall is not None and (stall.hop, stall.recovering) == (Hop.REDIS, False)
    generators_died = Flow(12, 0, 0, (Replica("gen-a", 80.0, holding=4),), HEALTHY_REWARDS, "1700000000000-3")
    stall = diagnose(waiting_for_groups(generators_died, cause=earlier), 5.0)
    assert stall is not None and stall.hop is Hop.GENERATORS
