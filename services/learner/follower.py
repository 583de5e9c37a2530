"""HTTP on the learner's other nodes. Under `torchrun --nnodes N` (deploy/k8s: one pod per node) rank 0
owns every bit of I/O, HTTP included; the first process of each other node (LOCAL_RANK 0) serves the same
three routes on `learner.http_port`, so every pod's probes get an answer:

- `/healthz`: the process is alive;
- `/readyz`: ready, "rank R of W, following rank 0";
- `/metrics`: no learner series. Rank 0 exports them; a zero-valued copy from each follower would add
  learners that never step (and trip alerts such as AsyncrlhfLearnerStalled).
"""

from __future__ import annotations

import logging
import os

from prometheus_client import CollectorRegistry

from asyncrlhf.config import Config
from asyncrlhf.metrics import make_app
from asyncrlhf.service import HttpServer, check_bind

log = logging.getLogger("asyncrlhf.learner")


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
