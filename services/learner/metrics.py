"""The learner's Prometheus metrics (names: `asyncrlhf_learner_<what>_<unit>`)."""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asyncrlhf import algorithms as A
from asyncrlhf import metrics as names
from asyncrlhf.stalls import Hop, WaitState
from asyncrlhf.training.batch import TrainGroup
from asyncrlhf.weights.pusher import Encoding

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
LENGTH_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
WAIT_WINDOW_STEPS = 10  # the waiting fraction is over this many last steps


def skip_reason(stats: dict[str, float]) -> str:
    """Why a step trained on nothing: every pair of online DPO tied, or no row was selected at all."""
    return "all_pairs_tied" if stats.get("ties_skipped") else "nothing_selected"


def step_summary(stats: dict[str, float]) -> str:
    """The loss part of the learner's step log line: a number, or why there is none (never `nan`)."""
    if stats.get("skipped_step"):
        if skip_reason(stats) == "all_pairs_tied":
            return f"skipped: all pairs tied (ties: {int(stats['ties_skipped'])})"
        return "skipped: nothing selected to train on"
    return f"loss {stats['loss']:.4f}"


class LearnerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.version = Gauge(names.LEARNER_VERSION, "Policy version the learner holds (steps + 1).",
                             registry=r)
        self.steps = Counter(names.LEARNER_STEPS_TOTAL, "Optimizer steps taken.", registry=r)
        self.skipped = Counter(names.LEARNER_SKIPPED_STEPS_TOTAL,
                               "Steps with nothing to train on (every pair tied), by reason.", ["reason"],
                               registry=r)
        self.samples = Counter(names.LEARNER_SAMPLES_TOTAL, "Sequences trained on.", registry=r)
        self.tokens = Counter(names.LEARNER_TOKENS_TOTAL, "Completion tokens trained on.", registry=r)
        self.groups = Counter(names.LEARNER_GROUPS_TOTAL, "Prompt groups consumed, by outcome.", ["outcome"],
                              registry=r)
        self.loss = Gauge(names.LEARNER_LOSS, "Loss of the last step.", registry=r)
        self.kl = Gauge(names.LEARNER_KL, "Mean sequence KL to the reference, last step.", registry=r)
        self.reward = Gauge(names.LEARNER_REWARD_MEAN, "Mean reward of the last step's samples.", registry=r)
        self.stat = Gauge(names.LEARNER_STEP_STAT, "Per-algorithm statistics of the last step.", ["stat"],
                          registry=r)
        self.staleness = Histogram(names.LEARNER_STALENESS_VERSIONS,
                                   "Staleness of trained samples, in versions.",
                                   buckets=STALENESS_BUCKETS, registry=r)
        self.stale = Counter(names.LEARNER_STALE_GROUPS_TOTAL, "Groups beyond max_staleness, by action.",
                             ["action"], registry=r)
        self.token_staleness = Histogram(names.LEARNER_TOKEN_STALENESS_VERSIONS,
                                         "Staleness of trained completion tokens, in versions (each token's "
                                         "own sampling version; continuous generation spans several).",
                                         buckets=STALENESS_BUCKETS, registry=r)
        self.sample_tokens = Histogram(names.LEARNER_SAMPLE_TOKENS,
                                       "Completion tokens per sample: of every group judged on staleness "
                                       "(stage=generated) and of those trained (stage=trained). Trained "
                                       "below generated: long answers are being dropped.", ["stage"],
                                       buckets=LENGTH_BUCKETS, registry=r)
        self.wait = Counter(names.LEARNER_WAIT_SECONDS_TOTAL, "Time spent waiting for scored groups.",
                            registry=r)
        self.push_wait = Counter(names.LEARNER_PUSH_WAIT_SECONDS_TOTAL,
                                 "Time the learner's step waited on a weight push (a synchronous publish, or "
                                 "the background push of the last version still in flight).", registry=r)
        self.waiting_fraction = Gauge(names.LEARNER_WAITING_FRACTION,
                                      "Share of wall time waiting, on data or on a push, over the last "
                                      f"{WAIT_WINDOW_STEPS} steps.", ["on"], registry=r)
        self._waits: deque[tuple[float, float, float]] = deque(maxlen=WAIT_WINDOW_STEPS)
        self.step_time = Histogram(names.LEARNER_STEP_SECONDS, "Time of one training step (no waiting).",
                                   registry=r)
        self.push_time = Gauge(names.LEARNER_PUSH_SECONDS, "Duration of the last weight push, per target.",
                               ["target"], registry=r)
        self.push_bytes = Counter(names.LEARNER_PUSH_BYTES_TOTAL, "Bytes pushed, per target.", ["target"],
                                  registry=r)
        self.pushes = Counter(names.LEARNER_PUSHES_TOTAL, "Versions that reached a generator, by the path "
                              "they took: shm, data (channel), stream (gRPC), relay.", ["path"], registry=r)
        self.pushed_versions = Counter(names.LEARNER_PUSHED_VERSIONS_TOTAL, "Versions the learner pushed to "
                                       "a generator itself, by encoding: delta (what changed since the "
                                       "version it kept, learner.push_delta) or full.", ["encoding"],
                                       registry=r)
        self.pushed_bytes = Counter(names.LEARNER_PUSHED_BYTES_TOTAL, "Tensor bytes of those pushes, by "
                                    "encoding (divided by pushed_versions: bytes per version).", ["encoding"],
                                    registry=r)
        for encoding in Encoding:  # both exported from the start
            self.pushed_versions.labels(encoding.value)
            self.pushed_bytes.labels(encoding.value)
        self.push_failures = Counter(names.LEARNER_PUSH_FAILURES_TOTAL,
                                     "Failed pushes, per target and status.", ["target", "status"],
                                     registry=r)
        self.step_to_serve = Gauge(names.LEARNER_STEP_TO_SERVE_SECONDS,
                                   "Last version: optimizer step done -> every live generator serving it.",
                                   registry=r)
        self.publish_time = Histogram(names.LEARNER_PUBLISH_SECONDS,
                                      "Time to publish a version: gather its weights and push them to "
                                      "every live generator.", registry=r)
        self.in_flight = Gauge(names.LEARNER_IN_FLIGHT_GROUPS, "Prompt groups enqueued, not yet finished.",
                               registry=r)
        self.queue_depth = Gauge(names.LEARNER_QUEUE_DEPTH, "Entries waiting in each stream.", ["stream"],
                                 registry=r)
        self.queue_lag = Gauge(names.LEARNER_CONSUMER_LAG,
                               "Entries not yet delivered to each stream's group.", ["stream"], registry=r)
        self.dead_letters = Gauge(names.LEARNER_DEAD_LETTER_ENTRIES,
                                  "Entries in the run's dead-letter stream.", registry=r)
        self.lineage = Gauge(names.LEARNER_LINEAGE, "Lineage of this learner start (one per start).",
                             registry=r)
        self.old_lineage = Counter(names.LEARNER_OLD_LINEAGE_GROUPS_TOTAL,
                                   "Groups sampled by an older lineage's weights, by stale-policy action.",
                                   ["action"], registry=r)
        self.requeued = Counter(names.LEARNER_REQUEUED_GROUPS_TOTAL,
                                "Groups enqueued again at a start: update lost, or entry lost by Redis.",
                                ["reason"], registry=r)
        self.waiting = WaitState(Gauge(names.LEARNER_WAITING_SINCE_SECONDS, "Unix time the wait began, by "
                                       "what it waits on (scored_groups, push); none while it trains.",
                                       ["on"], registry=r))
        self.stalled = Gauge(names.LEARNER_STALLED_SECONDS, "Seconds without a step, once that exceeds "
                             "launch.stall_after_s (else 0), by the hop that holds the learner up "
                             "(docs/stalls.md).", ["hop"], registry=r)
        self.stalled.labels(Hop.NONE.value).set(0)
        self._init_batching(r)
        self._init_mismatch(r)

    def _init_batching(self, r: CollectorRegistry) -> None:
        """Packing's padding shares and dynamic sampling's filtered and refilled groups."""
        self.padding_share = Gauge(names.LEARNER_PADDING_SHARE, "Share of the token positions the last step "
                                   "computed on that were padding (0 with learner.packing).", registry=r)
        self.unpacked_padding_share = Gauge(names.LEARNER_UNPACKED_PADDING_SHARE, "Share of padding in the "
                                            "last step's padded layout: what it computes on without "
                                            "packing.", registry=r)
        self.filtered = Counter(names.LEARNER_FILTERED_GROUPS_TOTAL, "Groups filtered by dynamic sampling "
                                "(rewards all equal), by reason.", ["reason"], registry=r)
        for algorithm in ("online_dpo", "best_of_n", "rloo"):  # every reason exported from the start
            self.filtered.labels(A.filter_reason(algorithm))
        self.refill = Gauge(names.LEARNER_REFILL_GROUPS, "Groups the last step filtered and refilled.",
                            registry=r)
        self.refill_capped = Counter(names.LEARNER_REFILL_CAPPED_STEPS_TOTAL, "Steps that reached "
                                     "learner.dynamic_sampling.refill_cap.", registry=r)

    def _init_mismatch(self, r: CollectorRegistry) -> None:
        """The training-inference mismatch of the last step that had fresh tokens (sampled by the learner's
        own version), 0 until one had; the counter says how many were measured (docs/off-policy.md)."""
        self.mismatch_abs_log_ratio = Gauge(names.LEARNER_MISMATCH_ABS_LOG_RATIO, "|log mu - log pi_old| of "
                                            "the last measured step's fresh tokens: mean and max.", ["stat"],
                                            registry=r)
        for stat in ("mean", "max"):  # exported from the start
            self.mismatch_abs_log_ratio.labels(stat)
        self.mismatch_kl = Gauge(names.LEARNER_MISMATCH_KL, "k3 estimate of KL(mu || pi_old) per fresh "
                                 "token, last measured step.", registry=r)
        self.mismatch_outside = Gauge(names.LEARNER_MISMATCH_OUTSIDE_SHARE, "Share of the last measured "
                                      "step's fresh tokens whose ratio pi_old / mu leaves [1/c, c] "
                                      "(c: learner.rollout_correction_cap).", registry=r)
        self.mismatch_tokens = Counter(names.LEARNER_MISMATCH_TOKENS_TOTAL, "Fresh tokens the mismatch was "
                                       "measured on.", registry=r)

    def record_mismatch(self, stats: dict[str, float]) -> None:
        """A step's mismatch figures (`asyncrlhf.algorithms.MismatchTotals.stats`), if it measured any token:
        a step with no fresh token leaves the gauges at the last one that had."""
        if not stats.get("mismatch_tokens"):
            return
        self.mismatch_tokens.inc(stats["mismatch_tokens"])
        self.mismatch_abs_log_ratio.labels("mean").set(stats["mismatch_abs_log_ratio_mean"])
        self.mismatch_abs_log_ratio.labels("max").set(stats["mismatch_abs_log_ratio_max"])
        self.mismatch_kl.set(stats["mismatch_kl"])
        self.mismatch_outside.set(stats["mismatch_outside_share"])

    def record_batching(self, stats: dict[str, float], filtered: int, capped: bool) -> None:
        """A step's padding shares (from its stats) and its groups filtered and refilled."""
        if "padding_share" in stats:
            self.padding_share.set(stats["padding_share"])
            self.unpacked_padding_share.set(stats["padding_share_unpacked"])
        self.refill.set(filtered)
        if capped:
            self.refill_capped.inc()

    def record_step(self, stats: dict[str, float], groups: list[TrainGroup], version: int) -> None:
        """A trained step: `version` is the one its update produced; staleness is per sample (the groups'
        count, by outcome, is the inbox's: `Inbox.end`)."""
        self.version.set(version)
        self.steps.inc()
        self.samples.inc(stats.get("sequences", 0))
        self.tokens.inc(stats.get("tokens", 0))
        self.reward.set(stats["reward_mean"])
        if stats.get("skipped_step"):
            self.skipped.labels(skip_reason(stats)).inc()
        if "loss" in stats:
            self.loss.set(stats["loss"])
        if "kl" in stats:
            self.kl.set(stats["kl"])
        for key, value in stats.items():
            self.stat.labels(key).set(value)
        self.record_mismatch(stats)
        for g in groups:
            for sample in g.message.samples:
                self.sample_tokens.labels("trained").observe(len(sample.completion_token_ids))
            for tokens in g.token_staleness():
                self.staleness.observe(g.decision.staleness)
                for staleness in tokens:
                    self.token_staleness.observe(staleness)

    def record_waits(self, wall_s: float, data_s: float, push_s: float) -> None:
        """One step's wall time (from the last step's end) and the seconds it waited on data and on a push:
        the waiting fractions over the last steps."""
        self._waits.append((wall_s, data_s, push_s))
        wall = sum(w for w, _, _ in self._waits)
        if wall > 0:
            self.waiting_fraction.labels("data").set(sum(d for _, d, _ in self._waits) / wall)
            self.waiting_fraction.labels("push").set(sum(p for _, _, p in self._waits) / wall)
