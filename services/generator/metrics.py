"""The generator's Prometheus metrics, in a registry of their own (several generators can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrlhf import metrics as names
from asyncrlhf.envs.base import EndKind
from asyncrlhf.stalls import WaitState

WAITING_HELP = "Unix time the wait began, by what it waits on (prompts, weights, redis); none while working."

_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GeneratorMetrics:
    """Tokens/s is `rate(asyncrlhf_generator_tokens_total[1m])`; the gauge gives the last batch's rate."""

    def __init__(self, generator_id: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.tokens = Counter(names.GENERATOR_TOKENS_TOTAL, "Completion tokens generated.", registry=r)
        self.groups = Counter(names.GENERATOR_GROUPS_TOTAL, "Rollout groups written.", registry=r)
        self.failed_groups = Counter(names.GENERATOR_FAILED_GROUPS_TOTAL,
                                     "Prompt groups whose batch failed (retried, then dead-lettered).",
                                     registry=r)
        self.tokens_per_second = Gauge(names.GENERATOR_TOKENS_PER_SECOND, "Tokens/s of the last batch.",
                                       registry=r)
        self.batch_seconds = Histogram(names.GENERATOR_BATCH_SECONDS, "Seconds per generation batch.",
                                       buckets=_SECONDS_BUCKETS, registry=r)
        self.idle_seconds = Counter(names.GENERATOR_IDLE_SECONDS_TOTAL,
                                    "Seconds with nothing to generate (no prompts, or no weights yet).",
                                    registry=r)
        self.version = Gauge(names.GENERATOR_POLICY_VERSION, "Policy version served.", ["generator"],
                             registry=r).labels(generator=generator_id)
        self.weight_apply_seconds = Histogram(
            names.GENERATOR_WEIGHT_APPLY_SECONDS,
            "Seconds to swap a pushed version in (waiting for the batch included).",
            buckets=_SECONDS_BUCKETS, registry=r)
        self.weight_updates = Counter(names.GENERATOR_WEIGHT_UPDATES_TOTAL, "Weight versions applied.",
                                      registry=r)
        self.prompts_pending = Gauge(names.GENERATOR_PROMPTS_PENDING,
                                     "Prompt groups waiting in the prompts stream.", registry=r)
        self.occupancy = Gauge(names.GENERATOR_ENGINE_OCCUPANCY,
                               "Continuous mode: samples running in the engine / its capacity, last step.",
                               registry=r)
        self.continued_samples = Counter(names.GENERATOR_CONTINUED_SAMPLES_TOTAL,
                                         "Samples continued from tokens sampled elsewhere (hand-on, save).",
                                         registry=r)
        self.written_tokens = Counter(names.GENERATOR_WRITTEN_TOKENS_TOTAL,
                                      "Completion tokens of the groups written (continued samples' earlier "
                                      "tokens included): tokens generated less these are in flight or lost.",
                                      registry=r)
        self.handed_on_samples = Counter(names.GENERATOR_HANDED_ON_SAMPLES_TOTAL,
                                         "Samples handed back to the prompts stream at a stop.", registry=r)
        self.version_waits = Counter(names.GENERATOR_VERSION_WAITS_TOTAL,
                                     "Groups that waited for this generator to serve the newest version "
                                     "their handed-on samples were sampled by.", registry=r)
        self.episodes = EpisodeMetrics(r)
        self.waiting = WaitState(Gauge(names.GENERATOR_WAITING_SINCE_SECONDS, WAITING_HELP, ["on"],
                                       registry=r))


class EpisodeMetrics:
    """Multi-turn episodes (task.env): turns, how episodes ended, tool calls and failures by tool, and the
    environment's step latency."""

    def __init__(self, r: CollectorRegistry):
        self.turns = Histogram(names.GENERATOR_EPISODE_TURNS, "Model turns per episode.",
                               buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.ended = Counter(names.GENERATOR_EPISODES_TOTAL, "Episodes ended, by why: done, max_turns, "
                             "length, or the environment's error, timeout or malformed output.", ["end"],
                             registry=r)
        self.tool_calls = Counter(names.GENERATOR_TOOL_CALLS_TOTAL, "Tool calls the model made, by tool.",
                                  ["tool"], registry=r)
        self.tool_errors = Counter(names.GENERATOR_TOOL_ERRORS_TOTAL, "Tool calls that failed (the tool "
                                   "raised, no such tool, or a malformed call: `<malformed>`), by tool.",
                                   ["tool"], registry=r)
        self.step_seconds = Histogram(names.GENERATOR_ENV_STEP_SECONDS, "Seconds per environment step.",
                                      buckets=_SECONDS_BUCKETS, registry=r)
        for end in EndKind:  # exported from the start: the dashboard's panels have data before any ends
            self.ended.labels(end=end)
