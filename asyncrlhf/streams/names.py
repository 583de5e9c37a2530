"""Every Redis name of a run, defined once: the key layout `asyncrlhf:<run>:<name>` (docs/design.md,
"Contracts"), the streams and what they carry, the consumer group of each hop, and the records kept beside
the streams.

Services, the launcher, the audit and the benchmarks use these names; none spells a key or a group itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from google.protobuf.message import Message

from asyncrlhf._proto.events_pb2 import Event
from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup

M = TypeVar("M", bound=Message)

PREFIX = "asyncrlhf"

# An entry is two fields: the message's identity and the serialized protobuf (the ack script in
# `consumer.py` writes the same two).
ID_FIELD = b"id"
PAYLOAD_FIELD = b"pb"


@dataclass(frozen=True)
class StreamSpec(Generic[M]):
    """A stream of one message type. A work queue has a single consumer group, so acked entries are deleted
    (the stream's length is then its backlog); a broadcast stream keeps entries for every group."""

    name: str
    message_type: type[M]
    identity: Callable[[M], str]
    work_queue: bool = True


def prompt_identity(prompt: PromptGroup) -> str:
    """A prompt entry's identity: its group id; a group handed on by a stopping generator is a new entry of
    the same group (`handoffs` > 0), which the generators' de-duplication must not take for the one acked
    (its enqueue time tells a group requeued since apart)."""
    if not prompt.handoffs:
        return prompt.group_id
    return f"{prompt.group_id}+{prompt.handoffs}@{prompt.enqueued_at:.6f}"


def group_of_identity(identity: str) -> str:
    """The group id of an entry's identity (a handed-on prompt's identity carries its hand-offs)."""
    return identity.split("+", 1)[0]


PROMPTS = StreamSpec("prompts", PromptGroup, prompt_identity)
ROLLOUTS = StreamSpec("rollouts", RolloutGroup, lambda m: m.group_id)
SCORED = StreamSpec("scored", RolloutGroup, lambda m: m.group_id)
EVENTS = StreamSpec("events", Event, lambda m: m.event_id, work_queue=False)
STREAMS: dict[str, StreamSpec] = {s.name: s for s in (PROMPTS, ROLLOUTS, SCORED, EVENTS)}

# The consumer group of each hop.
GENERATOR_GROUP = "generators"  # generator replicas share the prompts
REWARD_GROUP = "reward"  # reward replicas share the rollouts
LEARNER_GROUP = "learner"  # the learner reads the scored groups
EVALUATOR_GROUP = "evaluator"  # the evaluator follows the (broadcast) events

# The work queues in flow order, each with the group that works it: a prompt group is in flight while it
# is an entry of one of them.
FLOW: tuple[tuple[StreamSpec, str], ...] = (
    (PROMPTS, GENERATOR_GROUP),
    (ROLLOUTS, REWARD_GROUP),
    (SCORED, LEARNER_GROUP),
)

# Records beside the streams.
DEAD_LETTER = "dead_letter"  # stream: entries that could not be processed, with the reason
CREDITS = "credits"  # the learner's prompt groups in flight (`PromptCredits`)
FEED_CURSOR = "feed_cursor"  # prompt groups the learner has enqueued: g00000000 .. g<cursor-1>
LEARNER_FINISHED = "learner_finished"  # prompt groups trained, dropped or dead-lettered
LEARNER_DEAD_LETTER_CURSOR = "learner_dead_letter_cursor"  # the last dead letter the learner counted
LEARNER_WAIT_MARK = "learner_wait_mark"  # what the learner last waited for replicas to hold (WAIT)
GENERATOR_REGISTRY = "generators"  # set of live generator ids; `generators:<id>` is each one's hash
PARTIALS = "partials"  # hash: group id -> its samples in flight as last saved by a generator (continuous)


def run_key(run: str, name: str) -> str:
    """Redis key of a stream or record of a run (`run_key(run, "*")` matches all of them)."""
    return f"{PREFIX}:{run}:{name}"


def seen_name(stream: str, group: str) -> str:
    """The record of identities `group` has acked on `stream` (its de-duplication set)."""
    return f"seen:{stream}:{group}"
