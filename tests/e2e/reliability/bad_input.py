"""Bad stream entries for a live run: malformed, truncated, missing the payload, oversized garbage, and
well-formed but oversized messages, for each of the prompts, rollouts and scored streams; and the check
that each is dead-lettered with its reason while training goes on."""

from __future__ import annotations

import redis
from google.protobuf.message import DecodeError

from asyncrlhf._proto.rollout_pb2 import FINISH_REASON_STOP, PromptGroup, RolloutGroup, Sample
from asyncrlhf.streams import FLOW, PROMPTS, RunStreams
from tests.e2e.reliability.cluster import Cluster

OVERSIZED_BYTES = 4 << 20


def truncated(message) -> bytes:
    """The longest prefix of `message`'s bytes that does not parse (cut inside a field)."""
    raw = message.SerializeToString()
    for n in range(len(raw) - 1, 0, -1):
        try:
            type(message).FromString(raw[:n])
        except DecodeError:
            return raw[:n]
    raise AssertionError("every prefix parses")


def rollout(group_id: str, samples: int, text: str = "fine") -> RolloutGroup:
    prompt = PromptGroup(group_id=group_id, prompt="hello", prompt_token_ids=[5, 6, 7], k=samples)
    return RolloutGroup(
        group_id=group_id,
        prompt=prompt,
        policy_version=1,
        samples=[
            Sample(
                completion_token_ids=[8, 9],
                logprobs=[-1.0, -1.0],
                finish_reason=FINISH_REASON_STOP,
                text=text,
                reward=0.5,
            )
            for _ in range(samples)
        ],
    )


def bad_entries(stream: str) -> dict[str, dict[str, bytes]]:
    """id -> entry fields, for one stream."""
    valid = (
        PromptGroup(group_id="x", prompt="hello " * 20, prompt_token_ids=list(range(3, 40)), k=2)
        if stream == PROMPTS.name
        else rollout("x", 2, "a long enough completion text " * 4)
    )
    entries = {
        "malformed": {"pb": b"\xff\xfe\x00garbage" * 8},
        "truncated": {"pb": truncated(valid)},
        "no-payload": {"note": b"no pb field"},
        "oversized-garbage": {"pb": b"\xff" * OVERSIZED_BYTES},  # a varint that never ends
    }
    if stream == PROMPTS.name:  # well-formed, but more prompt tokens than any model here takes, or absurd k
        entries["oversized-prompt"] = {
            "pb": PromptGroup(group_id="x", prompt_token_ids=[5] * 100_000, k=2).SerializeToString()
        }
        entries["oversized-k"] = {
            "pb": PromptGroup(group_id="x", prompt_token_ids=[5, 6], k=1_000_000).SerializeToString()
        }
    else:  # well-formed, but 2000 samples where the run samples 2 per prompt
        entries["oversized-group"] = {"pb": rollout("x", 2000).SerializeToString()}
    out = {}
    for name, fields in entries.items():
        ident = f"bad-{stream}-{name}"
        if "pb" in fields and fields["pb"] and not name.endswith("garbage") and name != "malformed":
            parsed = (PromptGroup if stream == PROMPTS.name else RolloutGroup)()
            try:  # give well-formed payloads their own id, so the reason names them
                parsed.ParseFromString(fields["pb"])
                parsed.group_id = ident
                fields = {"pb": parsed.SerializeToString()}
            except DecodeError:
                pass
        out[ident] = {"id": ident.encode(), **fields}
    return out


def inject_bad_entries(c: Cluster) -> None:
    """XADD every bad entry into the three streams of the live run `c`; wait until each is dead-lettered
    with its reason and training has gone on; every service is still up."""
    client = redis.Redis.from_url(c.redis.url)
    streams = RunStreams(client, c.run)
    sent: dict[str, str] = {}
    for spec, _ in FLOW:
        for ident, fields in bad_entries(spec.name).items():
            client.xadd(streams.key(spec.name), fields)
            sent[ident] = spec.name

    def dead_lettered() -> dict[str, str]:
        return {d.identity: d.reason for d in streams.dead_letters(count=None) if d.identity in sent}

    c.wait(lambda: len(dead_lettered()) == len(sent), "every bad entry to be dead-lettered", timeout_s=180)
    c.wait_steps(3, "after the bad entries")
    reasons = dead_lettered()
    assert all(reasons.values()), reasons
    for ident, reason in reasons.items():
        if "truncated" in ident or "malformed" in ident or "garbage" in ident:
            assert "cannot decode" in reason, (ident, reason)
        elif "no-payload" in ident:
            assert "lacks the `id` or `pb` field" in reason, (ident, reason)
    assert "max_prompt_tokens" in reasons["bad-prompts-oversized-prompt"]
    assert "k=1000000" in reasons["bad-prompts-oversized-k"]
    assert "expected 2 samples, got 2000" in reasons["bad-scored-oversized-group"]
    # the oversized rollouts group is scored (the reward service scores any well-formed group) and then
    # refused by the learner
    assert "expected 2 samples, got 2000" in reasons["bad-rollouts-oversized-group"]
    c.check_alive()
    report = c.audit()
    assert report["ok"] and report["foreign_dead_letters"] >= len(sent), report
    client.close()


BAD_ENTRIES = sum(len(bad_entries(spec.name)) for spec, _ in FLOW)
