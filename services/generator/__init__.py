"""The generator service: samples k completions per prompt group and streams RolloutGroups to Redis.
The sampling backends (HF, vLLM) and the backend gate are library code: `asyncrlhf.sampling`,
`asyncrlhf.serving.gate`.

    loop.py     prompts stream -> backend -> rollouts stream, one batch at a time
    server.py   WeightSync gRPC server into the backend, registry heartbeat
    http.py     /healthz /readyz /metrics and POST /v1/completions
    metrics.py  the Prometheus metrics
    run.py      one process wired from the config (`python -m services.generator --config X`)
"""
