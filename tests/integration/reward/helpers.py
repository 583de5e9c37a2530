"""Rollout groups to feed the reward service, and readers of what it wrote."""

from __future__ import annotations

import time
from collections.abc import Callable

from asyncrlhf._proto.rollout_pb2 import (
    FINISH_REASON_LENGTH,
    FINISH_REASON_STOP,
    PromptGroup,
    RolloutGroup,
    Sample,
)
from asyncrlhf.streams import PAYLOAD_FIELD, SCORED, RunStreams

COMPLETIONS = [" I love it, wonderful!", " This is awful.", " The sky is blue.", " Great, thanks!"]


def rollout(
    group_id: str, prompt: str = "Say something:", texts=COMPLETIONS[:2], stopped=(True, False)
) -> RolloutGroup:
    samples = [
        Sample(
            completion_token_ids=list(range(len(t))),
            logprobs=[-1.0] * len(t),
            text=t,
            finish_reason=FINISH_REASON_STOP if stop else FINISH_REASON_LENGTH,
        )
        for t, stop in zip(texts, stopped, strict=True)
    ]
    return RolloutGroup(
        group_id=group_id,
        prompt=PromptGroup(group_id=group_id, prompt=prompt, k=len(samples)),
        samples=samples,
        policy_version=3,
        generator_id="gen-0",
    )


def scored_groups(streams: RunStreams) -> list[RolloutGroup]:
    out = []
    for _, fields in streams.client.xrange(streams.key(SCORED.name)):
        group = RolloutGroup()
        group.ParseFromString(fields[PAYLOAD_FIELD])
        out.append(group)
    return out


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
