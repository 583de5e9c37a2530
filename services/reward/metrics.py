"""The reward service's Prometheus metrics, in a registry of their own (see asyncrlhf.metrics)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrlhf import metrics as names
from asyncrlhf.stalls import WaitState

REWARD_BUCKETS = (-10, -5, -2, -1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1, 2, 5, 10)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
JUDGE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RUNNING_WINDOW = 1000  # the running means are over this many most recent samples


class RewardMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.groups = Counter(
            names.REWARD_GROUPS_SCORED_TOTAL, "Rollout groups scored and written.", registry=r
        )
        self.samples = Counter(
            names.REWARD_SAMPLES_SCORED_TOTAL, "Completions scored (stream and HTTP).", ["source"], registry=r
        )
        self.latency = Histogram(
            names.REWARD_SCORING_SECONDS,
            "Time of one scoring call (a batch of items).",
            ["source"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.reward = Histogram(
            names.REWARD_REWARD, "Distribution of total rewards.", buckets=REWARD_BUCKETS, registry=r
        )
        self.reward_mean = Gauge(
            names.REWARD_REWARD_MEAN, f"Mean total reward of the last {RUNNING_WINDOW} samples.", registry=r
        )
        self.component_mean = Gauge(
            names.REWARD_COMPONENT_MEAN,
            f"Mean of each reward component over its last {RUNNING_WINDOW} samples.",
            ["component"],
            registry=r,
        )
        self.truncated = Counter(
            names.REWARD_TRUNCATED_INPUTS_TOTAL, "Reward-model inputs cut to reward.max_length.", registry=r
        )
        self.errors = Counter(names.REWARD_SCORING_ERRORS_TOTAL, "Scoring calls that raised.", registry=r)
        self.dead_lettered = Counter(
            names.REWARD_DEAD_LETTERED_GROUPS_TOTAL,
            "Rollout groups sent to the dead-letter stream.",
            registry=r,
        )
        self.duplicates = Counter(
            names.REWARD_DUPLICATE_GROUPS_TOTAL,
            "Re-delivered groups skipped because they were already scored.",
            registry=r,
        )
        self.waiting = WaitState(Gauge(
            names.REWARD_WAITING_SINCE_SECONDS,
            "Unix time the wait began, by what it waits on (rollouts, redis); none while scoring.",
            ["on"],
            registry=r,
        ))
        self.judge_calls = Counter(
            names.REWARD_JUDGE_CALLS_TOTAL,
            "Judge calls ended, by outcome (answered, timeout, failed; a retry is a call).",
            ["scorer", "outcome"],
            registry=r,
        )
        self.judge_seconds = Histogram(
            names.REWARD_JUDGE_CALL_SECONDS,
            "Time of one judge call: an endpoint request, or one batch of the engine in this process.",
            ["scorer"],
            buckets=JUDGE_BUCKETS,
            registry=r,
        )
        self.judge_in_flight = Gauge(
            names.REWARD_JUDGE_CALLS_IN_FLIGHT, "Judge requests in flight.", ["scorer"], registry=r
        )
        self.judge_parse_failures = Counter(
            names.REWARD_JUDGE_PARSE_FAILURES_TOTAL,
            "Judge replies that held no value (each scored the judge's parse_fail_reward).",
            ["scorer"],
            registry=r,
        )
        self.judge_cache_hits = Counter(
            names.REWARD_JUDGE_CACHE_HITS_TOTAL, "Judge requests answered from the cache.", ["scorer"],
            registry=r,
        )
        self._recent: deque[float] = deque(maxlen=RUNNING_WINDOW)
        self._recent_components: dict[str, deque[float]] = {}

    def observe(
        self,
        source: str,
        seconds: float,
        rewards: Sequence[float],
        components: Mapping[str, Sequence[float]],
        truncated: int,
    ) -> None:
        """Record one successful scoring call of `len(rewards)` items."""
        self.latency.labels(source).observe(seconds)
        self.samples.labels(source).inc(len(rewards))
        self.truncated.inc(truncated)
        for value in rewards:
            self.reward.observe(value)
        self._recent.extend(rewards)
        if self._recent:
            self.reward_mean.set(sum(self._recent) / len(self._recent))
        for name, values in components.items():
            recent = self._recent_components.setdefault(name, deque(maxlen=RUNNING_WINDOW))
            recent.extend(values)
            if recent:
                self.component_mean.labels(name).set(sum(recent) / len(recent))

    def judge(self, scorer: str) -> JudgeMetrics:
        """Where the judge scorer labelled `scorer` reports (a `asyncrlhf.rewards.judge.JudgeMeter`)."""
        return JudgeMetrics(self, scorer)


class JudgeMetrics:
    """One judge scorer's view of the reward metrics: the `JudgeMeter` it reports to."""

    def __init__(self, metrics: RewardMetrics, scorer: str):
        self.scorer = scorer
        self.in_flight = metrics.judge_in_flight.labels(scorer)
        self.seconds = metrics.judge_seconds.labels(scorer)
        self.calls = metrics.judge_calls
        self.parse_failures = metrics.judge_parse_failures.labels(scorer)
        self.hits = metrics.judge_cache_hits.labels(scorer)
        self.in_flight.set(0)
        self.parse_failures.inc(0)
        self.hits.inc(0)

    def started(self, calls: int) -> None:
        self.in_flight.inc(calls)

    def ended(self, calls: int, seconds: float, outcome: str) -> None:
        self.in_flight.dec(calls)
        self.seconds.observe(seconds)
        self.calls.labels(self.scorer, outcome).inc(calls)

    def parse_failed(self, replies: int) -> None:
        self.parse_failures.inc(replies)

    def cache_hits(self, hits: int) -> None:
        self.hits.inc(hits)
