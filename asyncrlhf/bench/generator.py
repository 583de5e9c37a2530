"""`asyncrlhf bench generator --config C.yaml [--backend vllm --backend hf] [--prompts N] [--repeats R]
[--json] [overrides]` (`--modes`: continuous against batch mode, `bench.modes`; `--push`: step-to-serve into
an engine out of process, shared memory against a file, `bench.enginepush`; `--delta`: delta pushes with
full fine-tuning, `bench.deltas`)

Tokens/s of the generator service against the bare backend call, on the same prompts, in one run; with
several `--backend`s, each is measured in turn on the same model and prompts and printed side by side, with
its time to first token (bare: one prompt, one sample, one new token; the median of `TTFT_TRIES`).
Service: the real generator process (`python -m services.generator`, the config and overrides given here,
the same torch thread count as the bare side) on the bench's Redis, serving weights the bench pushed to it
over gRPC. Each batch is enqueued as PromptGroups in one transaction (so the service reads it whole) and
timed until its RolloutGroups are written: consumer-group read, the gate, generation, protobuf RolloutGroups
with decoded text, and the atomic XADD + XACK, with the WeightSync server, the registry heartbeat and HTTP
running. Bare: `asyncrlhf.sampling.create_backend(...).generate` over the same batches in this process.
The two alternate batch by batch, so load from other processes hits both alike; tokens/s is over all
`--repeats` passes. Both build the model from the same seed and sample the same batches in the same order,
so they sample the same tokens. Target: service >= 0.9x bare.

With `--api-requests N`, N clients (the `openai` client, each on its own thread) each send one chat completion
to the service's OpenAI-compatible API at once after the warm-up, so the timed rounds measure a generator
that has served API traffic on its web server's worker threads (what such a thread leaves behind slowed
decoding before `cores.on_fresh_thread`).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup
from asyncrlhf.config import Config, ConfigError, load_config
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.models import encode_prompts, is_lora, load_policy, load_tokenizer
from asyncrlhf.processes import Service
from asyncrlhf.redis_server import free_port, redis_url
from asyncrlhf.registry import Registry
from asyncrlhf.sampling import Backend, create_backend
from asyncrlhf.streams import PROMPTS, REWARD_GROUP, ROLLOUTS, RunStreams, connect, run_key
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights import ClientAccess, PushStatus, PushTarget, WeightPusher
from asyncrlhf.weights.codec import adapter_tensors

TARGET_RATIO = 0.9
# The environment this process started with: the service gets it, not what the bare backend's vLLM wrote into
# os.environ for the workers it would spawn (LD_PRELOAD, its shared-memory buffer names, inductor settings).
START_ENV = dict(os.environ)
TTFT_TRIES = 5
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
        env = {**START_ENV, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
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


def api_traffic(service: GeneratorProcess, cfg: Config, n: int) -> None:
    """`n` chat completions sent at once, each by its own `openai` client on its own thread; all must
    succeed."""
    import openai  # only this option needs it

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=f"{service.process.url}/v1", api_key=cfg.run.token or "none",
                               max_retries=0, timeout=BATCH_TIMEOUT_S)
        reply = client.chat.completions.create(
            model=cfg.model.name_or_path, max_tokens=8, seed=i,
            messages=[{"role": "user", "content": f"Say something about the number {i}."}])
        if not reply.choices:
            raise RuntimeError(f"API request {i} returned no choice")

    with ThreadPoolExecutor(max_workers=n) as pool:
        list(pool.map(one, range(n)))


def first_token_s(backend: Backend, prompts: list[list[int]], cfg: Config) -> float:
    """Median seconds from a one-prompt, one-sample call to its first (and only) new token."""
    sampling = cfg.generator.sampling.model_copy(update={"max_new_tokens": 1})
    times = []
    for prompt in (prompts * TTFT_TRIES)[:TTFT_TRIES]:
        start = time.perf_counter()
        backend.generate([prompt], 1, sampling)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def push_state(cfg: Config, backend: Backend) -> dict[str, torch.Tensor]:
    """The weights to push to the service: the backend's own, or (vLLM keeps them in its engine: its named
    tensors are shapes only) the run's model as the learner loads it."""
    named = backend.named_tensors()
    if not any(t.is_meta for t in named.values()):
        return {name: t.detach().cpu().clone() for name, t in named.items()}
    policy = load_policy(cfg.model, lora=cfg.learner.lora)
    state = policy.state_dict()
    return adapter_tensors(state) if is_lora(policy) else dict(state)


@dataclass(frozen=True)
class Workload:
    """What one bench run generates: `prompts` groups per phase, `repeats` passes over them, after
    `api_requests` chat completions sent at once to the service's API (0: none)."""

    prompts: int
    repeats: int
    api_requests: int = 0


def measure(cfg: Config, files: Sequence[str], overrides: Sequence[str], work: Workload) -> dict:
    tokenizer = load_tokenizer(cfg.model)
    backend = create_backend(cfg, tokenizer)
    try:
        return _measure(cfg, files, overrides, work, tokenizer, backend)
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()


def _measure(cfg: Config, files: Sequence[str], overrides: Sequence[str], work: Workload, tokenizer,
             backend: Backend) -> dict:
    threads = torch.get_num_threads()  # the bare side's, once generator.threads is applied
    prompts = encode_prompts(tokenizer, synthetic_prompts(work.prompts), cfg.model)
    with redis_url(cfg.redis.model_copy(update={"persist": False})) as url, contextlib.ExitStack() as stack:
        run = cfg.run.model_copy(update={"name": f"bench-{uuid.uuid4().hex[:8]}"})
        cfg = cfg.model_copy(update={"redis": cfg.redis.model_copy(update={"url": url}), "run": run})
        streams = RunStreams.from_config(cfg)
        stack.callback(_delete_run_keys, streams.client, cfg.run.name)
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncrlhf-bench-")))
        service = stack.enter_context(GeneratorProcess(cfg, files, overrides, threads, logs / "service.log"))
        if service.target is None:
            raise RuntimeError("the generator service did not register")
        with WeightPusher(ClientAccess(cfg.run.token)) as pusher:
            (outcome,) = pusher.push(push_state(cfg, backend), PolicyVersion(0, 1), [service.target])
        if outcome.status != PushStatus.OK:
            raise RuntimeError(f"could not push weights to the service: {outcome}")
        paired_run(streams, service, backend, prompts[: 2 * cfg.generator.batch_prompts], cfg)  # warm-up
        if work.api_requests:
            api_traffic(service, cfg, work.api_requests)
        rounds = [paired_run(streams, service, backend, prompts, cfg) for _ in range(work.repeats)]
        ttft = first_token_s(backend, prompts, cfg)
    bare = sum(r["bare_tokens"] for r in rounds) / sum(r["bare_s"] for r in rounds)
    served = sum(r["service_tokens"] for r in rounds) / sum(r["service_s"] for r in rounds)
    g = cfg.generator
    device = str(getattr(backend, "device", "")) or g.device
    return {"backend": g.backend, "model": cfg.model.name_or_path, "device": device, "threads": threads,
            "prompts": work.prompts, "k": g.samples_per_prompt, "batch_prompts": g.batch_prompts,
            "max_new_tokens": g.sampling.max_new_tokens, "repeats": work.repeats,
            "bare_tokens_per_s": bare, "service_tokens_per_s": served, "ratio": served / bare,
            "bare_first_token_s": ttft, "api_requests": work.api_requests,
            "target_ratio": TARGET_RATIO, "rounds": rounds}


def _delete_run_keys(client, run: str) -> None:
    keys = list(client.scan_iter(match=run_key(run, "*")))
    if keys:
        client.delete(*keys)


def _measure_in_child(files: Sequence[str], overrides: Sequence[str], work: Workload) -> dict:
    argv = [sys.executable, "-m", "asyncrlhf.cli", "bench", "generator",
            *(a for f in files for a in ("--config", f)), "--prompts", str(work.prompts),
            "--repeats", str(work.repeats), "--api-requests", str(work.api_requests), "--json", *overrides]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the bench of `{' '.join(overrides)}` failed ({done.returncode}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
    # vLLM logs to stdout too: the result is the last line that is a JSON object
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench generator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", action="append", choices=["hf", "vllm"],
                        help="measure this backend (repeat it to compare: --backend vllm --backend hf); "
                             "default: generator.backend")
    parser.add_argument("--prompts", type=int, default=64, help="prompt groups per phase")
    parser.add_argument("--repeats", type=int, default=3,
                        help="passes over the prompts (each alternates bare and service batch by batch)")
    parser.add_argument("--api-requests", type=int, default=0,
                        help="after the warm-up, send this many chat completions to the service's API "
                             "at once")
    parser.add_argument("--json", action="store_true", help="print one JSON object (a list with --backend)")
    parser.add_argument("--modes", action="store_true",
                        help="instead: tokens/s of continuous against batch mode on one vLLM engine "
                             "(asyncrlhf.bench.modes)")
    parser.add_argument("--push", action="store_true",
                        help="instead: step-to-serve of full pushes into a vLLM engine in processes of its "
                             "own, shared-memory handoff against a file (asyncrlhf.bench.enginepush)")
    parser.add_argument("--delta", action="store_true",
                        help="instead: what delta pushes send with full fine-tuning, --repeats steps "
                             "(asyncrlhf.bench.deltas)")
    args, rest = parser.parse_known_args(list(argv))
    if args.api_requests < 0:
        parser.error(f"--api-requests must be 0 or more, got {args.api_requests}")
    files, overrides = split_config_args(rest)
    runs = [[*overrides, f"generator.backend={b}"] for b in args.backend or []] or [list(overrides)]
    try:
        configs = [load_config(files, o) for o in runs]
    except ConfigError as err:
        print(f"asyncrlhf bench generator: {err}", file=sys.stderr)
        return 2
    if args.delta:
        from asyncrlhf.bench import deltas

        measured = deltas.measure(configs[0], args.repeats)
        print(json.dumps(measured) if args.json else "\n".join(deltas.report(measured)))
        return 0
    if args.push:
        from asyncrlhf.bench.enginepush import compare as compare_pushes
        from asyncrlhf.bench.enginepush import report as push_report

        pushes = compare_pushes(configs[0], args.repeats)
        print(json.dumps(pushes) if args.json else "\n".join(push_report(pushes)))
        return 0
    if args.modes:
        from asyncrlhf.bench.modes import compare, report

        modes = compare(configs[0], args.prompts, args.repeats)
        print(json.dumps(modes) if args.json else "\n".join(report(modes)))
        return 0
    work = Workload(args.prompts, args.repeats, args.api_requests)
    if len(runs) == 1:
        results = [measure(configs[0], files, runs[0], work)]
    else:  # each backend in its own process: one engine's threads, affinity and memory never skew another's
        results = [_measure_in_child(files, o, work) for o in runs]
    if args.json:
        print(json.dumps(results if args.backend else results[0]))
        return 0
    first = results[0]
    print(f"generator bench: model {first['model']}, {first['prompts']} prompts x k={first['k']}, "
          f"batches of {first['batch_prompts']}, max_new_tokens={first['max_new_tokens']}, "
          f"{first['threads']} torch threads, {first['repeats']} passes"
          + (f", after {first['api_requests']} API requests at once" if first["api_requests"] else ""))
    print(f"  {'backend':8} {'device':6} {'bare tok/s':>11} {'service tok/s':>14} {'ratio':>7} "
          f"{'first token':>12}")
    for r in results:
        verdict = "ok" if r["ratio"] >= TARGET_RATIO else f"< {TARGET_RATIO}"
        print(f"  {r['backend']:8} {r['device']:6} {r['bare_tokens_per_s']:11.1f} "
              f"{r['service_tokens_per_s']:14.1f} {r['ratio']:6.3f}x {r['bare_first_token_s'] * 1000:9.0f} ms"
              f"  ({verdict})")
    if len(results) > 1:
        base = results[-1]
        for r in results[:-1]:
            bare = r["bare_tokens_per_s"] / base["bare_tokens_per_s"]
            served = r["service_tokens_per_s"] / base["service_tokens_per_s"]
            print(f"  {r['backend']} / {base['backend']}: {bare:.2f}x bare tokens/s, "
                  f"{served:.2f}x service tokens/s")
    return 0
