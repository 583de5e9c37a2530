"""The duties of a learner rank other than 0, beside training: it joins the weight gathers of every publish
(rank 0 pushes), and the first process of each other node answers health probes. Rank 0 owns every other
bit of I/O (`services/learner/lead.py`).

Under `torchrun --nnodes N` (deploy/k8s: one pod per node) the first process of each node other than rank
0's (LOCAL_RANK 0) serves the learner's three routes on `learner.http_port`, so every pod's probes get an
answer:

- `/healthz`: the process is alive;
- `/readyz`: ready, "rank R of W, following rank 0";
- `/metrics`: no learner series. Rank 0 exports them; a zero-valued copy from each follower would add
  learners that never step (and trip alerts such as AsyncrlhfLearnerStalled).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from prometheus_client import CollectorRegistry

from asyncrlhf.config import Config
from asyncrlhf.inbox.strategy import StepBatch
from asyncrlhf.learner import LearnerParts
from asyncrlhf.metrics import make_app
from asyncrlhf.service import HttpServer, check_bind
from asyncrlhf.training.batch import TrainGroup
from asyncrlhf.training.checkpoint import LearnerState
from services.learner.metrics import LearnerMetrics
from services.learner.sync import WeightPublisher

log = logging.getLogger("asyncrlhf.learner")


class Follower:
    def __init__(self, parts: LearnerParts, state: LearnerState, metrics: LearnerMetrics):
        self.state = state
        self.weights = WeightPublisher(parts.cfg, parts.models.policy, parts.rank, None, metrics)
        self.http = (serve_follower_http(parts.cfg, parts.rank, parts.world)
                     if leads_a_follower_node(parts.rank) else None)

    def start(self) -> None:
        """Nothing to start: rank 0 watches for stalls."""

    def collect(self) -> StepBatch | None:
        """Nothing to read: the step's groups come from rank 0's broadcast."""
        return None

    def trained(self, batch: StepBatch | None, groups: list[TrainGroup], stats: dict, started: float,
                publish: bool) -> None:
        if publish:  # the gathers only: rank 0 pushes
            self.weights.publish(self.state.version)

    def step_ended(self, stats: dict) -> None:
        """Rank 0 records the step."""

    def await_push(self) -> float:
        """No push to wait for: rank 0 pushes."""
        return 0.0

    def checkpointing(self) -> None:
        """Rank 0 fills in the inbox's records."""

    def checkpointed(self, path: Path) -> None:
        """Rank 0 announces the checkpoint."""

    def finish(self) -> None:
        if self.http:
            self.http.stop()


def leads_a_follower_node(rank: int) -> bool:
    """The first process of a node that does not hold rank 0 (torchrun and deepspeed set LOCAL_RANK)."""
    return rank != 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0


def serve_follower_http(cfg: Config, rank: int, world: int) -> HttpServer:
    check_bind(cfg.learner.http_host, cfg, "learner HTTP")
    following = f"rank {rank} of {world}, following rank 0"
    app = make_app("learner", CollectorRegistry(), ready=lambda: (True, following))
    http = HttpServer(app, cfg.learner.http_host, cfg.learner.http_port).start()
    log.info("learner HTTP on %s (%s)", http.url, following)
    return http
