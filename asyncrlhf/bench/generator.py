"""`asyncrlhf bench generator --config configs/tiny.yaml [--prompts N] [--repeats R] [--json] [overrides]`

Tokens/s of the generator service against the bare backend call, on the same prompts, in one run.
Service: the real generator process (`python -m services.generator`, the config and overrides given here,
the same torch thread count as the bare side) on the bench's Redis, serving weights the bench pushed to it
over gRPC. Each batch is enqueued as PromptGroups in one transaction (so the service reads it whole) and
timed until its RolloutGroups are written: consumer-group read, the gate, generation, protobuf RolloutGroups
with decoded text, and the atomic XADD + XACK, with the WeightSync server, the registry heartbeat and HTTP
running. Bare: `asyncrlhf.sampling.create_backend(...).generate` over the same batches in this process.
The two alternate batch by batch, so load from other processes hits both alike; tokens/s is over all
`--repeats` passes. Both build the model from the same seed and sample the same batches in the same order,
so they sample the same tokens. Target: service >= 0.9x bare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup
from asyncrlhf.config import Config, ConfigError, load_config
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.launcher import Service
from asyncrlhf.models import encode_prompts, load_tokenizer
from asyncrlhf.redis_server import free_port, redis_url
from asyncrlhf.registry import Registry
from asyncrlhf.sampling import Backend, create_backend
from asyncrlhf.streams import PROMPTS, REWARD_GROUP, ROLLOUTS, RunStreams, connect, run_key
from asyncrlhf.weights import PushTarget, WeightPusher

TARGET_RATIO = 0.9
START_TIMEOUT_S = 600.0  # import, model load (a GGUF conversion on first use), gRPC and HTTP up
BATCH_TIMEOUT_S = 600.0


def synthetic_prompts(n: int) -> list[str]:
    topics = ["the sea", "a quiet town", "learning to cook", "an old map", "the first snow", "a train ride"]
    return [f"Write two sentences about {topics[i % len(topics)]} (#{i})." for i in range(n)]


class GeneratorProcess:
    """`python -m services.generator` as a child process on `cfg`'s Redis and run, with `threads` torch
    threads: entered once it has registered (its WeightSync address is `target`), stopped on exit."""

    def __init__(self, cfg: Config, files: Sequence[str], overrides: Sequence[str], threads: int, log: Path):
        port = free_port()
        args = [*(a for f in files for a in ("--config", f)), *overrides, f"redis.url={cfg.redis.url}",
                f"run.name={cfg.run.name}", f"generator.threads={threads}", f"generator.http_port={port}"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        argv = [sys.executable, "-m", "services.generator", *args]
        self.cfg, self.process = cfg, Service("generator", "generator", argv, env, log, port)
        self.target: PushTarget | None = None

    def __enter__(self) -> GeneratorProcess:
        self.process.start()
        try:
            self.target = self._registered()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_alive(self, deadline: float, what: str) -> None:
        """Raise, with the service's log, if it exited or `deadline` (monotonic) passed."""
        code = self.process.poll()
        if code is not None or time.monotonic() > deadline:
            state = f"exited with {code}" if code is not None else "timed out"
            raise RuntimeError(f"the generator service did not {what} ({state}); its log:\n"
                               f"{self.process.tail()}")

    def stop(self) -> None:
        self.process.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.signal(signal.SIGKILL)
            self.process.wait()

    def _registered(self) -> PushTarget:
        registry = Registry(connect(self.cfg.redis), self.cfg.run.name)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (members := registry.live()):
            self.check_alive(deadline, "register")
            time.sleep(0.2)
        return PushTarget(members[0].id, members[0].address)


def paired_run(streams: RunStreams, service: GeneratorProcess, backend: Backend, prompts: list[list[int]],
               cfg: Config) -> dict:
    """Bare and service, batch by batch in turn (so load from other processes hits both alike): the bare
    `backend.generate` of a batch, and the service until that batch's groups are written."""
    g = cfg.generator
    out = {"bare_tokens": 0, "bare_s": 0.0, "service_tokens": 0, "service_s": 0.0}
    producer, rollouts = streams.producer(PROMPTS), streams.consumer(ROLLOUTS, REWARD_GROUP, "bench")
    for n, i in enumerate(range(0, len(prompts), g.batch_prompts)):
        batch = prompts[i:i + g.batch_prompts]
        phases = [partial(_bare_batch, backend, batch, g, out),
                  partial(_service_batch, service, producer, rollouts, batch, out)]
        for phase in phases if n % 2 == 0 else reversed(phases):  # neither always goes second (warm caches)
            phase()
    return out


def _bare_batch(backend: Backend, batch: list[list[int]], g, out: dict) -> None:
    start = time.perf_counter()
    groups = backend.generate(batch, g.samples_per_prompt, g.sampling)
    out["bare_s"] += time.perf_counter() - start
    out["bare_tokens"] += sum(len(c.token_ids) for group in groups for c in group)


def _service_batch(service: GeneratorProcess, producer, rollouts, batch: list[list[int]],
                   out: dict) -> None:
    """Enqueue the batch whole and wait for its RolloutGroups (read, as the reward service would)."""
    groups = [PromptGroup(group_id=f"bench-{uuid.uuid4().hex}", prompt_token_ids=p, enqueued_at=time.time())
              for p in batch]
    written: list[RolloutGroup] = []
    deadline = time.monotonic() + BATCH_TIMEOUT_S
    start = time.perf_counter()
    producer.add_many(groups, atomic=True)
    while len(written) < len(groups):
        service.check_alive(deadline, "write its rollouts")
        deliveries = rollouts.read(len(groups) - len(written), block_ms=100)
        rollouts.ack(deliveries)
        written += [d.message for d in deliveries]
    out["service_s"] += time.perf_counter() - start
    out["service_tokens"] += sum(len(s.completion_token_ids) for group in written for s in group.samples)


def measure(cfg: Config, files: Sequence[str], overrides: Sequence[str], prompt_count: int,
            repeats: int) -> dict:
    tokenizer = load_tokenizer(cfg.model)
    backend = create_backend(cfg, tokenizer)
    threads = torch.get_num_threads()  # the bare side's, once generator.threads is applied
    prompts = encode_prompts(tokenizer, synthetic_prompts(prompt_count), cfg.model)
    with redis_url(cfg.redis.model_copy(update={"persist": False})) as url, contextlib.ExitStack() as stack:
        run = cfg.run.model_copy(update={"name": f"bench-{uuid.uuid4().hex[:8]}"})
        cfg = cfg.model_copy(update={"redis": cfg.redis.model_copy(update={"url": url}), "run": run})
        streams = RunStreams.from_config(cfg)
        stack.callback(_delete_run_keys, streams.client, cfg.run.name)
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncrlhf-bench-")))
        service = stack.enter_context(GeneratorProcess(cfg, files, overrides, threads, logs / "service.log"))
        if service.target is None:
            raise RuntimeError("the generator service did not register")
        with WeightPusher(cfg.run.token) as pusher:
            state = {name: t.detach().cpu().clone() for name, t in backend.named_tensors().items()}
            (outcome,) = pusher.push(state, 1, [service.target])
        if outcome.status != "ok":
            raise RuntimeError(f"could not push weights to the service: {outcome}")
        paired_run(streams, service, backend, prompts[: 2 * cfg.generator.batch_prompts], cfg)  # warm-up
        rounds = [paired_run(streams, service, backend, prompts, cfg) for _ in range(repeats)]
    bare = sum(r["bare_tokens"] for r in rounds) / sum(r["bare_s"] for r in rounds)
    served = sum(r["service_tokens"] for r in rounds) / sum(r["service_s"] for r in rounds)
    g = cfg.generator
    device = str(getattr(backend, "device", ""))
    return {"backend": g.backend, "model": cfg.model.name_or_path, "device": device, "threads": threads,
            "prompts": prompt_count, "k": g.samples_per_prompt, "batch_prompts": g.batch_prompts,
            "max_new_tokens": g.sampling.max_new_tokens, "repeats": repeats,
            "bare_tokens_per_s": bare, "service_tokens_per_s": served, "ratio": served / bare,
            "target_ratio": TARGET_RATIO, "rounds": rounds}


def _delete_run_keys(client, run: str) -> None:
    keys = list(client.scan_iter(match=run_key(run, "*")))
    if keys:
        client.delete(*keys)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench generator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompt groups per phase")
    parser.add_argument("--repeats", type=int, default=3,
                        help="passes over the prompts (each alternates bare and service batch by batch)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args, rest = parser.parse_known_args(list(argv))
    files, overrides = split_config_args(rest)
    try:
        cfg = load_config(files, overrides)
    except ConfigError as err:
        print(f"asyncrlhf bench generator: {err}", file=sys.stderr)
        return 2
    result = measure(cfg, files, overrides, args.prompts, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"generator bench: {result['backend']} backend, model {result['model']}, "
          f"{result['prompts']} prompts x k={result['k']}, batches of {result['batch_prompts']}, "
          f"max_new_tokens={result['max_new_tokens']}, {result['threads']} torch threads, "
          f"{result['repeats']} passes")
    print(f"  bare backend  {result['bare_tokens_per_s']:10.1f} tokens/s")
    print(f"  service       {result['service_tokens_per_s']:10.1f} tokens/s")
    verdict = "meets" if result["ratio"] >= TARGET_RATIO else "misses"
    print(f"  ratio         {result['ratio']:10.3f}x  ({verdict} the {TARGET_RATIO}x target)")
    return 0
