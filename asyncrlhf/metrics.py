"""Metric names (their one owner) and the HTTP app every service shares (`/healthz`, `/readyz`, `/metrics`).

Names follow `asyncrlhf_<service>_<what>_<unit>`, `_total` for counters, `_seconds` / `_bytes` units. Every
name a service exports is a constant below, named after the metric (`GENERATOR_TOKENS_TOTAL` is
`asyncrlhf_generator_tokens_total`); the services declare their metrics with these names (help, labels and
buckets stay with them, in `services/<name>/metrics.py`, each in a `CollectorRegistry` of its own: no
process-global state, so tests can run several services in one process), and every reader (the launcher's
progress, the benchmarks, the tests) uses the same constants. A histogram's samples add `_bucket`, `_count`
and `_sum` to its name. The Grafana dashboard and the alert rules cannot import them: a test checks that
every name they use is here (tests/unit/deploy/test_monitoring.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

PREFIX = "asyncrlhf"
SERVICES = ("generator", "reward", "learner", "evaluator", "launcher")
_PART = re.compile(r"^[a-z][a-z0-9_]*$")


def metric_name(service: str, what: str, unit: str | None = None) -> str:
    """`metric_name("generator", "tokens", "total")` -> `asyncrlhf_generator_tokens_total`."""
    if service not in SERVICES:
        raise ValueError(f"unknown service `{service}`; one of {SERVICES}")
    parts = [PREFIX, service, what] + ([unit] if unit else [])
    for part in parts[2:]:
        if not _PART.match(part):
            raise ValueError(f"metric name part `{part}` must be lower_snake_case")
    return "_".join(parts)


_named: list[str] = []


def _metric(service: str, what: str, unit: str | None = None) -> str:
    name = metric_name(service, what, unit)
    _named.append(name)
    return name


GENERATOR_TOKENS_TOTAL = _metric("generator", "tokens", "total")
GENERATOR_GROUPS_TOTAL = _metric("generator", "groups", "total")
GENERATOR_FAILED_GROUPS_TOTAL = _metric("generator", "failed_groups", "total")
GENERATOR_TOKENS_PER_SECOND = _metric("generator", "tokens_per_second")
GENERATOR_BATCH_SECONDS = _metric("generator", "batch", "seconds")  # histogram
GENERATOR_IDLE_SECONDS_TOTAL = _metric("generator", "idle_seconds", "total")
GENERATOR_POLICY_VERSION = _metric("generator", "policy_version")  # label: generator
GENERATOR_WEIGHT_APPLY_SECONDS = _metric("generator", "weight_apply", "seconds")  # histogram
GENERATOR_WEIGHT_UPDATES_TOTAL = _metric("generator", "weight_updates", "total")
GENERATOR_PROMPTS_PENDING = _metric("generator", "prompts_pending")
GENERATOR_ENGINE_OCCUPANCY = _metric("generator", "engine_occupancy")  # continuous: running / capacity
GENERATOR_CONTINUED_SAMPLES_TOTAL = _metric("generator", "continued_samples", "total")
GENERATOR_HANDED_ON_SAMPLES_TOTAL = _metric("generator", "handed_on_samples", "total")
GENERATOR_VERSION_WAITS_TOTAL = _metric("generator", "version_waits", "total")  # hand-ons of a newer version
GENERATOR_WRITTEN_TOKENS_TOTAL = _metric("generator", "written_tokens", "total")  # in groups written
GENERATOR_EPISODE_TURNS = _metric("generator", "episode_turns")  # histogram: model turns per episode
GENERATOR_EPISODES_TOTAL = _metric("generator", "episodes", "total")  # label: end (done, timeout, error, ...)
GENERATOR_TOOL_CALLS_TOTAL = _metric("generator", "tool_calls", "total")  # label: tool
GENERATOR_TOOL_ERRORS_TOTAL = _metric("generator", "tool_errors", "total")  # label: tool
GENERATOR_ENV_STEP_SECONDS = _metric("generator", "env_step", "seconds")  # histogram
# Each service's wait (asyncrlhf.stalls.waiting): the Unix time it began, label `on`; none while it works.
GENERATOR_WAITING_SINCE_SECONDS = _metric("generator", "waiting_since", "seconds")

REWARD_GROUPS_SCORED_TOTAL = _metric("reward", "groups_scored", "total")
REWARD_SAMPLES_SCORED_TOTAL = _metric("reward", "samples_scored", "total")  # label: source
REWARD_SCORING_SECONDS = _metric("reward", "scoring", "seconds")  # histogram, label: source
REWARD_REWARD = _metric("reward", "reward")  # histogram of total rewards
REWARD_REWARD_MEAN = _metric("reward", "reward_mean")
REWARD_COMPONENT_MEAN = _metric("reward", "component_mean")  # label: component
REWARD_TRUNCATED_INPUTS_TOTAL = _metric("reward", "truncated_inputs", "total")
REWARD_SCORING_ERRORS_TOTAL = _metric("reward", "scoring_errors", "total")
REWARD_DEAD_LETTERED_GROUPS_TOTAL = _metric("reward", "dead_lettered_groups", "total")
REWARD_DUPLICATE_GROUPS_TOTAL = _metric("reward", "duplicate_groups", "total")
REWARD_WAITING_SINCE_SECONDS = _metric("reward", "waiting_since", "seconds")  # label: on
# A language model as the judge (asyncrlhf.rewards.judge), each labelled by scorer (its component label).
REWARD_JUDGE_CALLS_TOTAL = _metric("reward", "judge_calls", "total")  # labels: scorer, outcome
REWARD_JUDGE_CALL_SECONDS = _metric("reward", "judge_call", "seconds")  # histogram, label: scorer
REWARD_JUDGE_CALLS_IN_FLIGHT = _metric("reward", "judge_calls_in_flight")  # label: scorer
REWARD_JUDGE_PARSE_FAILURES_TOTAL = _metric("reward", "judge_parse_failures", "total")  # label: scorer
REWARD_JUDGE_CACHE_HITS_TOTAL = _metric("reward", "judge_cache_hits", "total")  # label: scorer

LEARNER_VERSION = _metric("learner", "version")
LEARNER_STEPS_TOTAL = _metric("learner", "steps", "total")
LEARNER_SKIPPED_STEPS_TOTAL = _metric("learner", "skipped_steps", "total")  # label: reason
LEARNER_SAMPLES_TOTAL = _metric("learner", "samples", "total")
LEARNER_TOKENS_TOTAL = _metric("learner", "tokens", "total")
LEARNER_GROUPS_TOTAL = _metric("learner", "groups", "total")  # label: outcome
LEARNER_LOSS = _metric("learner", "loss")
LEARNER_KL = _metric("learner", "kl")
LEARNER_REWARD_MEAN = _metric("learner", "reward_mean")
LEARNER_STEP_STAT = _metric("learner", "step_stat")  # label: stat
LEARNER_STALENESS_VERSIONS = _metric("learner", "staleness_versions")  # histogram
LEARNER_STALE_GROUPS_TOTAL = _metric("learner", "stale_groups", "total")  # label: action
LEARNER_TOKEN_STALENESS_VERSIONS = _metric("learner", "token_staleness_versions")  # histogram, per token
LEARNER_SAMPLE_TOKENS = _metric("learner", "sample_tokens")  # histogram, label: stage (generated, trained)
LEARNER_WAIT_SECONDS_TOTAL = _metric("learner", "wait_seconds", "total")  # waiting on data (autoscalers)
LEARNER_PUSH_WAIT_SECONDS_TOTAL = _metric("learner", "push_wait_seconds", "total")  # waiting on a push
LEARNER_WAITING_FRACTION = _metric("learner", "waiting_fraction")  # label: on (data, push); last steps
LEARNER_STEP_SECONDS = _metric("learner", "step_seconds")  # histogram
LEARNER_PUSH_SECONDS = _metric("learner", "push_seconds")  # label: target
LEARNER_PUSH_BYTES_TOTAL = _metric("learner", "push_bytes", "total")  # label: target
LEARNER_PUSH_FAILURES_TOTAL = _metric("learner", "push_failures", "total")  # labels: target, status
LEARNER_PUSHES_TOTAL = _metric("learner", "pushes", "total")  # label: path (shm, data, stream, relay)
LEARNER_PUSHED_VERSIONS_TOTAL = _metric("learner", "pushed_versions", "total")  # label: encoding
LEARNER_PUSHED_BYTES_TOTAL = _metric("learner", "pushed_bytes", "total")  # label: encoding (delta, full)
LEARNER_STEP_TO_SERVE_SECONDS = _metric("learner", "step_to_serve_seconds")  # step done -> all serve it
LEARNER_PUBLISH_SECONDS = _metric("learner", "publish", "seconds")  # histogram: gather + push, per version
LEARNER_IN_FLIGHT_GROUPS = _metric("learner", "in_flight_groups")
LEARNER_QUEUE_DEPTH = _metric("learner", "queue_depth")  # label: stream
LEARNER_CONSUMER_LAG = _metric("learner", "consumer_lag")  # label: stream
LEARNER_DEAD_LETTER_ENTRIES = _metric("learner", "dead_letter_entries")
LEARNER_LINEAGE = _metric("learner", "lineage")
LEARNER_OLD_LINEAGE_GROUPS_TOTAL = _metric("learner", "old_lineage_groups", "total")  # label: action
LEARNER_REQUEUED_GROUPS_TOTAL = _metric("learner", "requeued_groups", "total")  # label: reason
LEARNER_WAITING_SINCE_SECONDS = _metric("learner", "waiting_since", "seconds")  # label: on
# Seconds without a step once that exceeds launch.stall_after_s, else 0; label: hop (asyncrlhf.stalls.Hop).
LEARNER_STALLED_SECONDS = _metric("learner", "stalled", "seconds")
LEARNER_PADDING_SHARE = _metric("learner", "padding_share")  # of the token positions the last step computed
LEARNER_UNPACKED_PADDING_SHARE = _metric("learner", "unpacked_padding_share")  # of its padded layout
LEARNER_FILTERED_GROUPS_TOTAL = _metric("learner", "filtered_groups", "total")  # label: reason
LEARNER_REFILL_GROUPS = _metric("learner", "refill_groups")  # groups filtered and refilled, last step
LEARNER_REFILL_CAPPED_STEPS_TOTAL = _metric("learner", "refill_capped_steps", "total")
# The training-inference mismatch on the last step's fresh tokens (asyncrlhf.algorithms.mismatch)
LEARNER_MISMATCH_ABS_LOG_RATIO = _metric("learner", "mismatch_abs_log_ratio")  # label: stat (mean, max)
LEARNER_MISMATCH_KL = _metric("learner", "mismatch_kl")  # k3 KL(mu || pi_old) per token
LEARNER_MISMATCH_OUTSIDE_SHARE = _metric("learner", "mismatch_outside_share")  # ratio outside [1/c, c]
LEARNER_MISMATCH_TOKENS_TOTAL = _metric("learner", "mismatch_tokens", "total")  # fresh tokens measured

EVALUATOR_GOLD_REWARD = _metric("evaluator", "gold_reward")
EVALUATOR_WIN_RATE = _metric("evaluator", "win_rate")
EVALUATOR_KL = _metric("evaluator", "kl")
EVALUATOR_PERPLEXITY = _metric("evaluator", "perplexity")
EVALUATOR_VERSION = _metric("evaluator", "version")
EVALUATOR_EVALUATIONS_TOTAL = _metric("evaluator", "evaluations", "total")
EVALUATOR_EVAL_SECONDS = _metric("evaluator", "eval", "seconds")  # histogram
EVALUATOR_SKIPPED_CHECKPOINTS_TOTAL = _metric("evaluator", "skipped_checkpoints", "total")  # label: reason
EVALUATOR_WAITING_SINCE_SECONDS = _metric("evaluator", "waiting_since", "seconds")  # label: on
EVALUATOR_JUDGED_WIN_RATE = _metric("evaluator", "judged_win_rate")  # label: bound (estimate, low, high)

NAMES: frozenset[str] = frozenset(_named)  # every metric a service exports


def final_metrics_path(run_dir: Path, service: str) -> Path:
    """Where a service that finished its work leaves its last /metrics text: the launcher's summary reads it,
    since a short run's learner can train its last steps and exit between two scrapes."""
    return run_dir / "metrics" / f"{service}.prom"


def write_final_metrics(registry: CollectorRegistry, run_dir: Path, service: str) -> Path:
    path = final_metrics_path(run_dir, service)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(generate_latest(registry))
    tmp.replace(path)  # a reader never sees half of it
    return path


def make_app(
    service: str,
    registry: CollectorRegistry,
    ready: Callable[[], tuple[bool, str]] = lambda: (True, "ok"),
    **fastapi_kwargs,
) -> FastAPI:
    """A FastAPI app with the three routes every service has; the service adds its own routes to it.

    `ready()` returns (ready, reason): `/readyz` answers 200 or 503 with the reason.
    """
    app = FastAPI(title=f"asyncrlhf {service}", **fastapi_kwargs)

    @app.get("/healthz", summary="The process is alive.")
    def healthz() -> dict:
        return {"status": "ok", "service": service}

    @app.get("/readyz", summary="The service can do its work (model loaded, Redis reachable).")
    def readyz() -> JSONResponse:
        try:
            ok, reason = ready()
        except Exception as err:  # a readiness probe must answer, not crash
            ok, reason = False, f"{type(err).__name__}: {err}"
        body = {"ready": ok, "reason": reason, "service": service}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", summary="Prometheus metrics.")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
