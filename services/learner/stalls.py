"""The learner's stall watch: a daemon thread beside the loop that asks the stall monitor, every second,
whether the learner has gone `launch.stall_after_s` without a step; the monitor's judgement goes to the log
and to `asyncrlhf_learner_stalled_seconds{hop}` (the alert AsyncrlhfLearnerStalled). A thread, because the
loop itself may be the thing that waits (on Redis, on a push)."""

from __future__ import annotations

import logging
import threading
import time

from asyncrlhf.config import Config
from asyncrlhf.stalls import Hop, Stall
from asyncrlhf.stalls.monitor import StallMonitor
from services.learner.metrics import LearnerMetrics

log = logging.getLogger("asyncrlhf.learner")
CHECK_EVERY_S = 1.0


class StallWatch:
    def __init__(self, cfg: Config, metrics: LearnerMetrics):
        self.metrics = metrics
        self.monitor = StallMonitor.from_config(cfg, say=log.warning)
        self.stepped_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def start(self) -> StallWatch:
        self.stepped_at = time.monotonic()
        self._thread.start()
        return self

    def stepped(self) -> None:
        self.stepped_at = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> Stall | None:
        stall = self.monitor.check(time.monotonic() - self.stepped_at, self.metrics.waiting.current)
        hop, seconds = (stall.hop, stall.stepless_s) if stall else (Hop.NONE, 0.0)
        self.metrics.stalled.clear()
        self.metrics.stalled.labels(hop.value).set(seconds)
        return stall

    def _run(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            try:
                self.check()
            except Exception:  # the watch must outlive whatever one check ran into
                log.exception("stall watch: a check failed; trying again in %.0f s", CHECK_EVERY_S)
