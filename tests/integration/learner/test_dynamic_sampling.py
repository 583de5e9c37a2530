"""Dynamic sampling with exact refill through the learner service (real Redis, real gRPC, real DeepSpeed):
groups without reward signal are filtered, logged and audited, every step still trains groups_per_step
informative groups, and the staleness bound holds with the refills."""

import pytest

from asyncrlhf.audit import audit_run
from asyncrlhf.consumed import Kind
from asyncrlhf.inbox.ids import group_index
from tests.integration.learner.test_loop import consumed, learner_config, run_learner

pytestmark = pytest.mark.integration


def every_other(group_id: str) -> bool:
    return group_index(group_id) % 2 == 0  # g0, g2, g4, ...: all rewards equal


def test_filtered_groups_are_refilled_audited_and_the_staleness_bound_holds(tmp_path, redis_url, run_name):
    cfg = learner_config(tmp_path, redis_url, run_name, "learner.algorithm=rloo", "learner.max_staleness=1",
                         "learner.dynamic_sampling.enabled=true")
    learner, actor = run_learner(cfg, redis_url, tied=every_other)
    rows = consumed(cfg)
    trained = [r for r in rows if r["kind"] == Kind.TRAINED]
    filtered = [r for r in rows if r["kind"] == Kind.FILTERED]
    assert len(trained) == 4
    assert all(len(r["group_ids"]) == 3 for r in trained)  # every step: groups_per_step informative groups
    assert not any(every_other(g) for r in trained for g in r["group_ids"])
    assert filtered and all(every_other(g) for r in filtered for g in r["group_ids"])
    assert {r["reason"] for r in filtered} == {"zero_variance"}
    # the bound holds with refills: trained groups at most max_staleness old, in flight within the credits
    assert max(s for r in trained for s in r["staleness"]) <= 1
    ended = sum(len(r["group_ids"]) for r in rows if r["kind"] in (Kind.TRAINED, Kind.FILTERED))
    assert learner.duties.inbox.feed.cursor - ended <= (1 + 1) * 3
    # every filtered group is accounted for by the audit
    audit = audit_run(cfg, learner.duties.client)
    assert audit.ok and audit.filtered == sum(len(r["group_ids"]) for r in filtered)
    assert audit.lost == [] and audit.trained == 12
    count = learner.metrics.filtered.labels("zero_variance")._value.get()
    assert count == audit.filtered


def test_a_task_with_no_signal_reaches_the_refill_cap_and_still_steps(tmp_path, redis_url, run_name):
    cfg = learner_config(tmp_path, redis_url, run_name, "learner.algorithm=grpo", "learner.total_steps=2",
                         "learner.dynamic_sampling.enabled=true", "learner.dynamic_sampling.refill_cap=1")
    learner, _ = run_learner(cfg, redis_url, tied=lambda group_id: True)
    rows = consumed(cfg)
    assert len([r for r in rows if r["kind"] == Kind.TRAINED]) == 2  # never stalls
    assert learner.metrics.refill_capped._value.get() == 2
    assert sum(len(r["group_ids"]) for r in rows if r["kind"] == Kind.FILTERED) == 2 * 3  # cap: 1 x 3
    assert audit_run(cfg, learner.duties.client).ok
