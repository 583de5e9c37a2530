"""The generator service: samples k completions (or runs k episodes) per prompt group and streams
RolloutGroups to Redis. The sampling backends (HF, vLLM), the continuous sampler and the backend gate are
library code: `asyncrlhf.sampling`, `asyncrlhf.envs.continuous`, `asyncrlhf.serving.gate`.

    loop.py        what every loop shares (`LoopContext`, `GroupKind`), and the batch loop: prompts stream ->
                   backend -> rollouts stream, one batch at a time
    continuous.py  the continuous loop: the engine kept full, groups in and out one engine step at a time
    handover.py    continuous mode's saves and hand-on: the progress that outlives a generator
    samples.py     what a group is without `task.env`: k single-turn samples
    episodes.py    what a group is with `task.env`: k multi-turn episodes
    server.py      WeightSync gRPC server into the backend, registry heartbeat
    http.py        /healthz /readyz /metrics and POST /v1/completions
    metrics.py     the Prometheus metrics
    run.py         one process wired from the config (`python -m services.generator --config X`)
"""
