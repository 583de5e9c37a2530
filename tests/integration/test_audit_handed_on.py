"""`asyncrlhf audit` on a run whose generators handed groups on at a stop (continuous mode): a handed-on
prompt entry's identity carries its hand-offs, and the group is in flight, not lost (a chaos run's audit
called the four groups handed on at its end lost before this)."""

import pytest

from asyncrlhf._proto.rollout_pb2 import PromptGroup, Sample
from asyncrlhf.audit import audit_run
from asyncrlhf.config import load_config
from asyncrlhf.streams import FEED_CURSOR, PROMPTS, RunStreams

pytestmark = pytest.mark.integration


def test_a_handed_on_group_is_in_flight_not_lost(redis_client, run_name, tmp_path):
    cfg = load_config(["configs/tiny.yaml"], [f"run.name={run_name}", f"run.dir={tmp_path}"])
    streams = RunStreams(redis_client, run_name)
    redis_client.set(streams.key(FEED_CURSOR), 2)
    prompts = streams.producer(PROMPTS)
    prompts.add(PromptGroup(group_id="g00000000"))
    prompts.add(PromptGroup(group_id="g00000001", handoffs=1, enqueued_at=1.0,
                            partial_samples=[Sample(completion_token_ids=[5, 6])]))
    audit = audit_run(cfg, redis_client)
    assert audit.ok and not audit.lost, audit.summary()
    assert audit.in_flight_total == 2
