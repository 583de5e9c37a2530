"""`asyncrlhf bench generator --config configs/tiny.yaml [--prompts N] [--repeats R] [--json] [overrides]`

Tokens/s of the generator service against the bare backend call, on the same prompts, in one run, with the
same backend object (same weights, same device). Bare: `backend.generate` over the prompts in batches of
`generator.batch_prompts`. Service: the prompts enqueued as PromptGroups, then the service's loop steps
until every group is written: consumer-group read, the gate, generation, protobuf RolloutGroups with
decoded text, and the atomic XADD + XACK, with the WeightSync server and the registry heartbeat running.
The version it serves arrived by a real gRPC push. Both phases start from the same torch seed, so they
sample the same tokens. The two alternate batch by batch, so load from other processes hits both alike;
tokens/s is over all `--repeats` passes. Target: service >= 0.9x bare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import uuid
from typing import Sequence

import torch

from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.config import ConfigError, load_config
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.models import encode_prompts, load_tokenizer
from asyncrlhf.redis_server import redis_url
from asyncrlhf.streams import PROMPTS, ROLLOUTS, connect
from asyncrlhf.weights import PushTarget, WeightPusher
from asyncrlhf.sampling import Backend, create_backend
from services.generator.run import GeneratorService

SEED = 1234
TARGET_RATIO = 0.9


def synthetic_prompts(n: int) -> list[str]:
    topics = ["the sea", "a quiet town", "learning to cook", "an old map", "the first snow", "a train ride"]
    return [f"Write two sentences about {topics[i % len(topics)]} (#{i})." for i in range(n)]


class RngStream:
    """A torch RNG stream of its own (CPU, and CUDA when present): entering it swaps its state in, leaving
    swaps it out, so two interleaved phases each sample as if they ran alone from the same seed."""

    def __init__(self, seed: int):
        with torch.random.fork_rng(devices=self._devices()):
            torch.manual_seed(seed)
            self._state = self._get()

    @staticmethod
    def _devices() -> list[int]:
        return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []

    def _get(self):
        return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self._devices()]

    def _set(self, state) -> None:
        torch.set_rng_state(state[0])
        for device, cuda_state in zip(self._devices(), state[1]):
            torch.cuda.set_rng_state(cuda_state, device)

    def __enter__(self) -> "RngStream":
        self._outer = self._get()
        self._set(self._state)
        return self

    def __exit__(self, *exc: object) -> None:
        self._state = self._get()
        self._set(self._outer)


def paired_run(service: GeneratorService, backend: Backend, prompts: list[list[int]], cfg) -> dict:
    """Bare and service, batch by batch in turn (so load from other processes hits both alike): the bare
    `backend.generate` of a batch, and the service loop until that batch's groups are written."""
    g = cfg.generator
    bare_rng, service_rng = RngStream(SEED), RngStream(SEED)
    out = {"bare_tokens": 0, "bare_s": 0.0, "service_tokens": 0, "service_s": 0.0}
    producer = service.streams.producer(PROMPTS)
    for n, i in enumerate(range(0, len(prompts), g.batch_prompts)):
        batch = prompts[i:i + g.batch_prompts]
        phases = [lambda: _bare_batch(backend, batch, g, bare_rng, out),
                  lambda: _service_batch(service, producer, batch, service_rng, out)]
        for phase in phases if n % 2 == 0 else reversed(phases):  # neither always goes second (warm caches)
            phase()
    service.client.delete(service.streams.key(ROLLOUTS.name))
    return out


def _bare_batch(backend: Backend, batch: list[list[int]], g, rng: RngStream, out: dict) -> None:
    with rng:
        start = time.perf_counter()
        groups = backend.generate(batch, g.samples_per_prompt, g.sampling)
        out["bare_s"] += time.perf_counter() - start
    out["bare_tokens"] += sum(len(c.token_ids) for group in groups for c in group)


def _service_batch(service: GeneratorService, producer, batch: list[list[int]], rng: RngStream,
                   out: dict) -> None:
    producer.add_many(PromptGroup(group_id=f"bench-{uuid.uuid4().hex}", prompt_token_ids=p,
                                  enqueued_at=time.time()) for p in batch)
    before, written = _tokens_generated(service), 0
    with rng:
        start = time.perf_counter()
        while written < len(batch):
            written += service.loop.step()
        out["service_s"] += time.perf_counter() - start
    out["service_tokens"] += int(_tokens_generated(service) - before)


def _tokens_generated(service: GeneratorService) -> float:
    return service.metrics.registry.get_sample_value("asyncrlhf_generator_tokens_total") or 0.0


def _delete_run_keys(client, run: str) -> None:
    keys = list(client.scan_iter(match=f"asyncrlhf:{run}:*"))
    if keys:
        client.delete(*keys)


def measure(cfg, prompt_count: int, repeats: int) -> dict:
    tokenizer = load_tokenizer(cfg.model)
    backend = create_backend(cfg, tokenizer)
    prompts = encode_prompts(tokenizer, synthetic_prompts(prompt_count), cfg.model)
    with redis_url(cfg.redis.model_copy(update={"persist": False})) as url, contextlib.ExitStack() as stack:
        run = cfg.run.model_copy(update={"name": f"bench-{uuid.uuid4().hex[:8]}"})
        cfg = cfg.model_copy(update={"redis": cfg.redis.model_copy(update={"url": url}), "run": run})
        service = GeneratorService(cfg, backend=backend, tokenizer=tokenizer, client=connect(cfg.redis))
        service.start()
        stack.callback(service.close)
        with WeightPusher(cfg.run.token) as pusher:
            state = {name: t.detach().cpu().clone() for name, t in backend.named_tensors().items()}
            (outcome,) = pusher.push(state, 1, [PushTarget(service.id, service.weight_sync.address)])
        if outcome.status != "ok":
            raise RuntimeError(f"could not push weights to the service: {outcome}")
        paired_run(service, backend, prompts[: 2 * cfg.generator.batch_prompts], cfg)  # warm-up
        rounds = [paired_run(service, backend, prompts, cfg) for _ in range(repeats)]
        stack.callback(_delete_run_keys, service.client, cfg.run.name)
    bare = sum(r["bare_tokens"] for r in rounds) / sum(r["bare_s"] for r in rounds)
    served = sum(r["service_tokens"] for r in rounds) / sum(r["service_s"] for r in rounds)
    g = cfg.generator
    device = str(getattr(backend, "device", ""))
    return {"backend": g.backend, "model": cfg.model.name_or_path, "device": device,
            "prompts": prompt_count, "k": g.samples_per_prompt, "batch_prompts": g.batch_prompts,
            "max_new_tokens": g.sampling.max_new_tokens, "repeats": repeats,
            "bare_tokens_per_s": bare, "service_tokens_per_s": served, "ratio": served / bare,
            "target_ratio": TARGET_RATIO, "rounds": rounds}


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
    result = measure(cfg, args.prompts, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"generator bench: {result['backend']} backend, model {result['model']}, "
          f"{result['prompts']} prompts x k={result['k']}, batches of {result['batch_prompts']}, "
          f"max_new_tokens={result['max_new_tokens']}, "
          f"{result['repeats']} passes")
    print(f"  bare backend  {result['bare_tokens_per_s']:10.1f} tokens/s")
    print(f"  service       {result['service_tokens_per_s']:10.1f} tokens/s")
    verdict = "meets" if result["ratio"] >= TARGET_RATIO else "misses"
    print(f"  ratio         {result['ratio']:10.3f}x  ({verdict} the {TARGET_RATIO}x target)")
    return 0
