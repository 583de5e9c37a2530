"""Why the learner has not stepped: evidence in, one message naming the hop out. Pure, so every case is a
unit test with hand-made evidence; the learner and `asyncrlhf up` gather the evidence (asyncrlhf.stalls.
monitor) and both say what this returns.

The judgement goes upstream from the learner, and stops at the first hop that explains the wait:

    Redis (every hop goes through it) -> the learner itself (frozen: only `up` can tell) -> the weight push
    -> the generators (prompts -> rollouts) -> the reward replicas (rollouts -> scored) -> the prompts

A replica is alive while its last sign of life (a generator's registry heartbeat, a reward replica's last
read) is younger than `Expected.silent_after_s`; a silent one that holds entries is the one to name.

A stall's cause stays with the hop that caused it until the pipeline moves again. Once it clears (Redis
answers again, a generator is back), the services recover and the backlog drains: for a while the evidence
shows a hop further down as the slow one (scored groups queued, the learner not yet reconnected), which is
the recovery, not a new cause. So a hop downstream of the stall's `Cause` is not named until the learner has
read a scored group since the cause was last seen (the learner group's read position on the scored stream
moved); a hop upstream of it is a new cause and is named at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from asyncrlhf.stalls.waiting import Wait


class Hop(StrEnum):
    """Where a stall is: the label `hop` of `asyncrlhf_learner_stalled_seconds`."""

    NONE = "none"  # not stalled
    REDIS = "redis"
    LEARNER = "learner"
    PUSH = "push"
    GENERATORS = "generators"
    REWARD = "reward"
    PROMPTS = "prompts"


# the order the judgement goes in, from the learner upstream
UPSTREAM_FIRST = (Hop.REDIS, Hop.LEARNER, Hop.PUSH, Hop.GENERATORS, Hop.REWARD, Hop.PROMPTS)


@dataclass(frozen=True)
class Replica:
    """A generator or reward replica as Redis shows it."""

    name: str
    silent_s: float  # since its last sign of life
    holding: int = 0  # entries delivered to it and not acked


@dataclass(frozen=True)
class Flow:
    """What Redis shows of the pipeline: entries waiting in each stream, and the replicas working them."""

    prompts: int
    rollouts: int
    scored: int
    generators: tuple[Replica, ...] = ()
    rewards: tuple[Replica, ...] = ()
    learner_read: str | None = None  # the learner group's last read entry id on the scored stream


@dataclass(frozen=True)
class Expected:
    """What a healthy run has: replicas per stage, and how long a live replica stays silent at most."""

    generators: int
    rewards: int
    silent_after_s: float


@dataclass(frozen=True)
class Cause:
    """The hop a stall was last judged at on its own evidence, what it said, and where the learner's reads of
    the scored stream were then (None: not known, Redis was silent; the first position read after it
    counts)."""

    hop: Hop
    message: str
    learner_read: str | None = None


@dataclass(frozen=True)
class Evidence:
    """All that is known when the learner has gone `stepless_s` without a step. None: not known or fine."""

    stepless_s: float
    expected: Expected
    wait_on: Wait | None = None  # what the learner waits on (None: it works, or does not say)
    waited_s: float = 0.0
    wait_detail: str = ""  # e.g. the push's targets
    redis_silent_s: float | None = None  # Redis has not answered for this long
    flow: Flow | None = None  # None when Redis did not answer
    learner_silent_s: float | None = None  # its metrics endpoint has not answered for this long (`up` only)
    silent_services: tuple[tuple[str, float], ...] = ()  # other processes not answering (`up` only)
    not_starting: tuple[str, ...] = ()  # processes that exited before they answered, and why (`up` only)
    cause: Cause | None = None  # this stall's cause so far (the monitor keeps it)


@dataclass(frozen=True)
class Stall:
    hop: Hop
    message: str
    stepless_s: float
    recovering: bool = False  # the hop is the cause's, cleared; the pipeline has not moved since


def _s(seconds: float) -> str:
    return f"{seconds:.0f} s"


def diagnose(e: Evidence, stall_after_s: float) -> Stall | None:
    """The stall `e` shows once the learner has gone `stall_after_s` without a step; None before."""
    if e.stepless_s < stall_after_s:
        return None
    hop, message = _judge(e)
    recovering = _recovering(e, hop)
    if recovering and e.cause is not None:
        now = _evidence(e, e.flow or Flow(0, 0, 0))
        hop, message = e.cause.hop, (f"recovering from: {e.cause.message}; the pipeline has not moved since "
                                     f"(the learner has read no scored group): {now}")
    if e.not_starting:
        message += "; cannot start: " + "; ".join(e.not_starting)
    if e.silent_services:
        message += "; not answering /metrics: " + ", ".join(f"{n} for {_s(s)}" for n, s in e.silent_services)
    return Stall(hop, message, e.stepless_s, recovering)


def _recovering(e: Evidence, hop: Hop) -> bool:
    """Whether `hop`, judged while the learner waits for scored groups, is downstream of the stall's cause
    while the learner has read nothing since it (the backlog draining, not a new cause)."""
    cause = e.cause
    if cause is None or e.flow is None or e.wait_on is not Wait.SCORED_GROUPS:
        return False
    if UPSTREAM_FIRST.index(hop) <= UPSTREAM_FIRST.index(cause.hop):
        return False
    return cause.learner_read is None or e.flow.learner_read == cause.learner_read


def _judge(e: Evidence) -> tuple[Hop, str]:
    last = f"last step {_s(e.stepless_s)} ago"
    if e.redis_silent_s is not None:
        return Hop.REDIS, (f"Redis not answering for {_s(e.redis_silent_s)} (learner's {last}; every "
                           "service waits on it)")
    if e.learner_silent_s is not None:
        return Hop.LEARNER, (f"learner not stepping for {_s(e.stepless_s)}: process alive but its metrics "
                             f"endpoint does not answer for {_s(e.learner_silent_s)}")
    flow = e.flow or Flow(0, 0, 0)
    if e.wait_on is Wait.PUSH:
        to = f" to {e.wait_detail}" if e.wait_detail else ""
        return Hop.PUSH, (f"weight push not finishing: waiting {_s(e.waited_s)} for the push{to}; "
                          f"{_generators(flow, e.expected)}")
    if e.wait_on is None:
        return Hop.LEARNER, (f"learner busy for {_s(e.stepless_s)} in its own work (a step, a checkpoint), "
                             f"waiting on no other service; {last}")
    return _upstream(e, flow)


def _upstream(e: Evidence, flow: Flow) -> tuple[Hop, str]:
    """The learner waits for scored groups: which hop holds them."""
    x = e.expected
    evidence = _evidence(e, flow)
    if e.flow is None:
        return Hop.REDIS, f"no evidence from Redis: {evidence}"
    alive = [g for g in flow.generators if g.silent_s < x.silent_after_s]
    stuck_rewards = _stuck(flow.rewards, x.silent_after_s)
    stuck_generators = _stuck(flow.generators, x.silent_after_s)
    reading = [r for r in flow.rewards if r.silent_s < x.silent_after_s]
    if not alive:
        return Hop.GENERATORS, f"no generator alive: {evidence}"
    if stuck_rewards:
        return Hop.REWARD, f"reward replica {_holders(stuck_rewards, 'rollouts')}: {evidence}"
    if stuck_generators:
        return Hop.GENERATORS, f"generator {_holders(stuck_generators, 'prompts')}: {evidence}"
    if flow.prompts == flow.rollouts == flow.scored == 0:
        return Hop.PROMPTS, (f"no prompt in flight (the learner enqueues none: its credits are held, or "
                             f"learner.data_epochs ran out): {evidence}")
    if flow.rollouts and not reading:
        return Hop.REWARD, f"no reward replica reading: {evidence}"
    if flow.prompts:
        return Hop.GENERATORS, f"generators not keeping up: {evidence}"
    return Hop.REWARD, f"reward replicas not keeping up: {evidence}"


def _evidence(e: Evidence, flow: Flow) -> str:
    x = e.expected
    waited = _s(e.waited_s) if e.waited_s >= e.stepless_s - 1 else \
        f"{_s(e.waited_s)} (no step for {_s(e.stepless_s)})"
    return (f"waiting {waited} for scored groups: prompts queued {flow.prompts}, rollouts {flow.rollouts}, "
            f"scored {flow.scored}; {_generators(flow, x)}{_rewards(flow, x)}")


def _stuck(replicas: Sequence[Replica], silent_after_s: float) -> list[Replica]:
    return [r for r in replicas if r.holding and r.silent_s >= silent_after_s]


def _holders(replicas: Sequence[Replica], what: str) -> str:
    return ", ".join(f"{r.name} silent for {_s(r.silent_s)} holding {r.holding} {what}" for r in replicas)


def _generators(flow: Flow, x: Expected) -> str:
    alive = sum(g.silent_s < x.silent_after_s for g in flow.generators)
    silent = [f"{g.name} last heartbeat {_s(g.silent_s)} ago" for g in flow.generators
              if g.silent_s >= x.silent_after_s]
    named = f" ({', '.join(silent)})" if silent else ""
    return f"generators alive {alive} of {max(x.generators, alive)}{named}"


def _rewards(flow: Flow, x: Expected) -> str:
    """Said only when rollouts wait or a replica holds some: before Redis 7.2, a consumer's idle time grows
    while its reads find nothing, so with no rollouts an idle replica looks silent."""
    if not flow.rollouts and not any(r.holding for r in flow.rewards):
        return ""
    reading = sum(r.silent_s < x.silent_after_s for r in flow.rewards)
    return f"; reward replicas reading {reading} of {max(x.rewards, reading)}"
