"""`asyncrlhf learner --config X [overrides]` / `python -m services.learner --config X`.

Several processes: `torchrun --nproc_per_node 3 -m services.learner --config X` (or the `deepspeed`
launcher); rank 0 does the I/O. Several nodes: `torchrun --nnodes N --node_rank R --master_addr <node 0>
...` on each (deploy/k8s/components/multinode-learner); the first process of every other node answers
health probes. `--no-resume` starts fresh even when the run has a checkpoint.
"""

import sys

from asyncrlhf.service import run_service


def _body(cfg, log, stop, resume: bool) -> int:
    from services.learner.loop import Learner

    return Learner(cfg, stop=stop, resume=resume).run()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    resume = "--no-resume" not in argv
    argv = [a for a in argv if a not in ("--no-resume", "--resume")]
    return run_service(lambda cfg, log, stop: _body(cfg, log, stop, resume), argv, "learner")


if __name__ == "__main__":
    sys.exit(main())
