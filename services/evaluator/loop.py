"""The evaluator: evaluate the initial policy, then follow CHECKPOINT_SAVED events on the run's events stream
(every `evaluator.every_n`-th), and stop after RUN_FINISHED once the final checkpoint is evaluated.

Each evaluation appends one row to `<run.dir>/eval/results.jsonl`:
    version, step (= version - 1), checkpoint ("initial" for the starting policy), time (unix),
    elapsed_s (since the run's first row), gold_reward, win_rate, kl, perplexity, n_prompts
    (with evaluator.judge also judged_win_rate, judged_win_rate_low / _high, judged_ties, judged_unparsed)
then updates the gauges and rewrites `<run.dir>/report.md`. A restarted evaluator skips versions already
in the file; the consumer group on the broadcast events stream resumes where it was.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from asyncrlhf._proto.events_pb2 import EVENT_KIND_CHECKPOINT_SAVED, EVENT_KIND_RUN_FINISHED
from asyncrlhf.config import Config
from asyncrlhf.metrics import make_app
from asyncrlhf.models import ModelLoadError, load_tokenizer, set_threads
from asyncrlhf.report import judged_text, load_results, write_report
from asyncrlhf.service import HttpServer, ServiceError, check_bind
from asyncrlhf.stages.evaluation import GoldEvaluation, eval_dir
from asyncrlhf.stalls import Wait
from asyncrlhf.streams import EVALUATOR_GROUP, EVENTS, RunStreams, connect
from asyncrlhf.trackers import open_trackers
from asyncrlhf.training.checkpoint import latest_checkpoint, load_checkpoint_policy, read_state
from services.evaluator.metrics import EvaluatorMetrics

log = logging.getLogger("asyncrlhf.evaluator")
RESULTS = "results.jsonl"
INITIAL = "initial"


class Evaluator:
    def __init__(self, cfg: Config, stop: threading.Event | None = None):
        self.cfg, self.stop = cfg, stop or threading.Event()
        self.metrics = EvaluatorMetrics()
        self.results_path = eval_dir(cfg) / RESULTS
        self.done = {int(r["version"]) for r in load_results(cfg.run.path)}
        self.evaluation: GoldEvaluation | None = None
        self.http: HttpServer | None = None
        self.client = connect(cfg.redis)
        self._checkpoints_seen = 0
        self.trackers = open_trackers(cfg, "evaluator")

    def start(self) -> Evaluator:
        ec = self.cfg.evaluator
        check_bind(ec.http_host, self.cfg, "evaluator HTTP")
        app = make_app("evaluator", self.metrics.registry, ready=self._ready)
        self.http = HttpServer(app, ec.http_host, ec.http_port).start()
        log.info("evaluator HTTP on %s", self.http.url)
        set_threads(ec.threads)
        self.evaluation = GoldEvaluation(self.cfg, load_tokenizer(self.cfg.model))
        return self

    def _started_evaluation(self) -> GoldEvaluation:
        if self.evaluation is None:
            raise RuntimeError("Evaluator.start() loads the models; call it before evaluating")
        return self.evaluation

    def _ready(self) -> tuple[bool, str]:
        if self.evaluation is None:
            return False, "loading models"
        self.client.ping()
        return True, f"{len(self.done)} versions evaluated"

    def run(self) -> int:
        try:
            self.evaluate_initial()
            self.follow()
        finally:
            self.trackers.close()
            if self.evaluation:
                self.evaluation.close()
            if self.http:
                self.http.stop()
        return 0

    # -- what to evaluate ---------------------------------------------------------------------------------

    def follow(self) -> None:
        """Evaluate checkpoints as their events arrive; return after RUN_FINISHED, or when stopped."""
        consumer = RunStreams.from_config(self.cfg, self.client).consumer(
            EVENTS, EVALUATOR_GROUP, f"evaluator-{socket.gethostname()}-{os.getpid()}"
        )
        last: tuple[str, int] | None = None
        while not self.stop.is_set():
            self.metrics.waiting.wait(Wait.CHECKPOINTS)
            for delivery in consumer.read(16):
                self.metrics.waiting.work()
                event = delivery.message
                if event.kind == EVENT_KIND_CHECKPOINT_SAVED:
                    last = (event.checkpoint_path, event.policy_version)
                    self._checkpoints_seen += 1
                    if self._checkpoints_seen % self.cfg.evaluator.every_n == 0:
                        self.evaluate_checkpoint(*last)
                consumer.ack([delivery])
                if event.kind == EVENT_KIND_RUN_FINISHED:
                    self.evaluate_final(last)
                    log.info("run finished; evaluator done")
                    return
                if self.stop.is_set():
                    return

    def evaluate_final(self, last: tuple[str, int] | None) -> None:
        """The run's last checkpoint, even when `every_n` skipped its event."""
        latest = latest_checkpoint(self.cfg)
        if latest is not None:
            version = read_state(latest).version
            last = max([c for c in (last, (str(latest), version)) if c], key=lambda c: c[1])
        if last is not None:
            self.evaluate_checkpoint(*last)

    def evaluate_initial(self) -> None:
        if 1 in self.done:
            return
        evaluation = self._started_evaluation()
        started = time.perf_counter()
        generations = evaluation.initial_generations()
        self._record(1, INITIAL, evaluation.evaluate(evaluation.reference, generations), started)

    def evaluate_checkpoint(self, path: str, version: int) -> None:
        if version in self.done:
            return
        started = time.perf_counter()
        evaluation = self._started_evaluation()
        try:
            policy = load_checkpoint_policy(path, self.cfg.model, device=str(evaluation.sampler.device))
        except (ModelLoadError, OSError):
            latest = latest_checkpoint(self.cfg)
            if latest is not None and latest.resolve() == Path(path).resolve():
                raise
            # The learner prunes old checkpoints (learner.keep_checkpoints); one can vanish before or while
            # it loads when evaluation falls behind training.
            log.warning("checkpoint %s (version %d) is gone (pruned? raise learner.keep_checkpoints); "
                        "skipped", path, version)
            self.metrics.skipped.labels("missing").inc()
            return
        generations = evaluation.generate(policy, version)
        self._record(version, path, evaluation.evaluate(policy, generations), started)

    # -- results ------------------------------------------------------------------------------------------

    def _record(self, version: int, checkpoint: str, measures: dict, started: float) -> None:
        now = time.time()
        rows = load_results(self.cfg.run.path)
        first = min((r["time"] for r in rows), default=now)
        row = {
            "version": version,
            "step": version - 1,
            "checkpoint": checkpoint,
            "time": now,
            "elapsed_s": now - first,
            **measures,
        }
        self.results_path.parent.mkdir(parents=True, exist_ok=True)
        with self.results_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.done.add(version)
        self.metrics.record(row)
        scalars = {f"eval/{k}": v for k, v in measures.items() if isinstance(v, (int, float))}
        self.trackers.log_scalars(scalars, step=row["step"])
        self.metrics.eval_time.observe(time.perf_counter() - started)
        log.info(
            "version %d: gold reward %.4f win rate %.3f KL %.4f perplexity %.2f%s",
            version,
            row["gold_reward"],
            row["win_rate"],
            row["kl"],
            row["perplexity"],
            f"; judged win rate {judged_text(row)}" if "judged_win_rate" in row else "",
        )
        try:
            write_report(self.cfg.run.path)
        except Exception:  # a failed plot must not stop the evaluations; the next result retries it
            log.exception("could not write the report")


def serve(cfg: Config, _log: logging.Logger, stop: threading.Event) -> int:
    if not cfg.redis.external:
        raise ServiceError("redis.url is not set: pass redis.url=redis://host:6379/0 or "
                           "redis.sentinel.addresses=[host:26379,...] (or use `asyncrlhf up`)")
    return Evaluator(cfg, stop).start().run()
