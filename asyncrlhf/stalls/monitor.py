"""The stall monitor that the learner (a thread beside its loop) and `asyncrlhf up` (its progress loop)
both run: asked about once a second how long the learner has gone without a step, it gathers the evidence
(Redis, and what the caller knows), judges it (`diagnose`) and says so: once when a stall begins, moves to
another hop or starts recovering, again every `launch.stall_after_s` while it lasts, and once when the
learner steps again. It keeps the stall's `Cause` between checks, so a cleared cause stays named while the
pipeline recovers (`diagnosis`).

`asyncrlhf up` also tells it which running processes do not answer /metrics: one silent for
`launch.stall_after_s` is named at once, stall or not (a frozen replica among several may only slow the run
down, until its entries are re-claimed), and named again when it answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import redis

from asyncrlhf.config import Config
from asyncrlhf.stalls.diagnosis import Cause, Evidence, Expected, Flow, Stall, diagnose
from asyncrlhf.stalls.evidence import FlowProbe
from asyncrlhf.stalls.waiting import Waiting
from asyncrlhf.streams import connect

PROBE_TIMEOUT_S = 1.0  # a Redis command the monitor sends gives up after this long


def silent_after_s(cfg: Config) -> float:
    """How long a live replica can go without a sign of life: three missed generator heartbeats, or three
    reward reads (a replica blocks at most `redis.block_ms` per read, then reads again)."""
    return max(3 * cfg.generator.heartbeat_s, 3 * cfg.redis.block_ms / 1000)


class StallMonitor:
    def __init__(self, cfg: Config, probe: FlowProbe, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.stall_after_s = cfg.launch.stall_after_s
        self.expected = Expected(cfg.generator.replicas, cfg.reward.replicas, silent_after_s(cfg))
        self.probe, self.say, self.clock = probe, say, clock
        self.stall: Stall | None = None
        self.cause: Cause | None = None
        self._said_at = 0.0
        self._silent: set[str] = set()  # processes said not to answer

    @classmethod
    def from_config(cls, cfg: Config, say: Callable[[str], None], url: str | None = None) -> StallMonitor:
        """With its own client, one that gives up fast (`url`: the embedded Redis of `asyncrlhf up`)."""
        client = connect(cfg.redis, url, retries=0, timeout_s=PROBE_TIMEOUT_S)
        return cls(cfg, FlowProbe(client, cfg.run.name), say)

    def check(self, stepless_s: float, waiting: Waiting | None, learner_silent_s: float | None = None,
              silent_services: Sequence[tuple[str, float]] = (), not_starting: Sequence[str] = ()
              ) -> Stall | None:
        """The stall now, if any. `waiting`: the learner's wait; `learner_silent_s`, `silent_services`,
        `not_starting`: what only `asyncrlhf up` sees (the learner's metrics endpoint, or others', not
        answering; processes that exited before they answered, each with why)."""
        self._notice(silent_services)
        redis_silent = self.probe.redis_silent_s()
        if stepless_s < self.stall_after_s:
            self._over()
            return None
        flow = None
        if redis_silent is None:
            try:
                flow = self.probe.flow()
            except redis.RedisError:
                redis_silent = self.probe.clock() - self.probe.answered_at
        now = time.time()
        evidence = Evidence(stepless_s, self.expected,
                            waiting.on if waiting else None, waiting.seconds(now) if waiting else 0.0,
                            waiting.detail if waiting else "", redis_silent, flow, learner_silent_s,
                            tuple(silent_services), tuple(not_starting), self.cause)
        stall = diagnose(evidence, self.stall_after_s)
        if stall is not None:
            self._follow(stall, flow)
            self._announce(stall)
        return stall

    def _follow(self, stall: Stall, flow: Flow | None) -> None:
        """Keep the stall's cause: the hop it was last judged at on its own evidence, with the learner's read
        position then; while recovering, the first position known after the cause cleared."""
        read = flow.learner_read if flow is not None else None
        if not stall.recovering:
            self.cause = Cause(stall.hop, stall.message, read)
        elif self.cause is not None and self.cause.learner_read is None:
            self.cause = Cause(self.cause.hop, self.cause.message, read)

    def _notice(self, silent_services: Sequence[tuple[str, float]]) -> None:
        silent = {name: s for name, s in silent_services if s >= self.stall_after_s}
        for name in sorted(silent.keys() - self._silent):
            self.say(f"{name} alive but not answering /metrics for {silent[name]:.0f} s (frozen or hung?)")
        for name in sorted(self._silent - silent.keys()):
            self.say(f"{name} answers /metrics again")
        self._silent = set(silent)

    def _announce(self, stall: Stall) -> None:
        last = self.stall
        moved = last is None or stall.hop is not last.hop or stall.recovering != last.recovering
        if moved or self.clock() - self._said_at >= self.stall_after_s:
            self.say(f"stalled at {stall.hop}: {stall.message}")
            self._said_at = self.clock()
        self.stall = stall

    def _over(self) -> None:
        if self.stall is not None:
            self.say(f"stall over: the learner steps again (stalled at {self.stall.hop} for at least "
                     f"{self.stall.stepless_s:.0f} s)")
            self.stall = None
        self.cause = None
