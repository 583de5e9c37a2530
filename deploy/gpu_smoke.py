"""GPU smoke test of the generator and learner path (deploy/gpu-smoke runs it; within 10 minutes on one GPU).

On a GPU (the demo model, SmolLM2-135M, fp32: the learner's dtype):
1. `learner`: four learner steps with DeepSpeed (full fine-tuning, `asyncrlhf.bench.inprocess`: generate,
   score, train, apply), timed;
2. `generate`: the vLLM backend (its engine in processes of its own, the GPU default) against bare vLLM
   (`LLM.generate` on the same engine, the same sampling): tokens/s of each;
3. `push-shm`: the learner's weights pushed over WeightSync (the same-host route, then the engine's
   shared-memory handoff, no file), timed, then the per-token log-prob gap to the HF model on those weights
   (target <= 1e-3);
4. `push-lora`: a rank-8 LoRA adapter into a second engine (vLLM's LoRA kernels), timed, and its gap to
   HF + PEFT;
5. `push-1b`: a 1B-parameter bf16 model (random weights, built in code) pushed the same way, timed;
6. `push-collective`: other weights (the learner's, perturbed) pushed over the collective route into the
   same engine, whose worker joins the weight group itself (`handoff: engine worker joined`): NCCL with two
   GPUs or more (the engine's worker on cuda:0, the learner on cuda:1: NCCL takes one device per rank), else
   gloo; timed, then the log-prob gap to the HF model on the pushed weights
   (<= 1e-3) and to the model it served before (must be far larger: the served weights really changed,
   where an update that silently did nothing would still report success);
7. `tensor-parallel` (`--tp N`): an engine sharded over N GPUs, the push of step 3 and its gap.
On CPU (vLLM's CPU build) the same script runs its CPU form: the tiny model, and every step that needs CUDA
reported as skipped with the reason. Each step passes, fails (with its error) or is skipped; the script prints
one line per step and a JSON summary (also written to `--json PATH`), and exits non-zero if any step failed:
anything unexpected fails loudly.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncrlhf.config import load_config
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.sampling.hf import sampling_log_softmax
from asyncrlhf.sampling.hops.hop import HopKind
from asyncrlhf.sampling.hops.worker_round import WorkerRound
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import ClientAccess, ServerAccess
from asyncrlhf.weights.collective_member import CollectiveMember
from asyncrlhf.weights.collective_sender import CollectiveSender
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.stream import StreamSender
from asyncrlhf.weights.vocabulary import Route

PARITY_ATOL = 1e-3
PROMPTS = ["Write a haiku about the sea.", "Explain rain to a child.", "Name three fruits.", "Say hello."]
TOKEN = "gpu-smoke"
NO_CUDA = "needs CUDA (no GPU visible: the CPU form of the smoke)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deploy/gpu-smoke", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="also shard a vLLM engine over N GPUs (generator.tensor_parallel_size=N) and "
                             "check its push and parity; 1 (the default): skip that step")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the JSON summary here")
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error(f"--tp {args.tp}: give the number of GPUs to shard over, 1 or more")
    return args


def tensor_parallel_skipped(tp: int, visible: int) -> str | None:
    """Why the tensor-parallel step does not run, or None when it does."""
    if tp == 1:
        return "not asked for (--tp 2 shards the engine over 2 GPUs)"
    if visible < tp:
        return f"--tp {tp} needs {tp} GPUs, {visible} visible"
    return None


def smoke_config(cache: str, *extra: str, cuda: bool = True):
    """The demo model on a GPU; on CPU the tiny model (head size 32, which vLLM's CPU attention takes)."""
    device = ["generator.device=cuda", "learner.device=cuda", "model.name_or_path=smollm2-135m-instruct",
              "generator.vllm.gpu_memory_utilization=0.3"] if cuda else \
        ["generator.device=cpu", "learner.device=cpu", "model.name_or_path=tiny", "model.tiny.heads=2",
         "generator.vllm.kv_cache_gib=1"]
    return load_config(["configs/tiny.yaml"], [
        f"model.cache_dir={cache}", f"run.dir={cache}/run", *device, "model.dtype=float32",
        "generator.backend=vllm", "generator.vllm.engine_in_process=false",
        "generator.vllm.max_model_len=512",
        "generator.sampling.max_new_tokens=32", "learner.lora.enabled=false", "learner.total_steps=4",
        "learner.checkpoint_every=1000", "learner.lr=1e-5", *extra])


class Summary:
    """Each step's outcome: `run` it (pass, or fail with its error) or `skip` it (with the reason)."""

    def __init__(self, device: str):
        self.device = device
        self.steps: list[dict[str, Any]] = []

    def run(self, name: str, step: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        start = time.perf_counter()
        try:
            figures = step()
        except Exception as err:  # every failure is reported, then the script exits non-zero
            traceback.print_exc()
            self._add(name, "fail", time.perf_counter() - start, error=f"{type(err).__name__}: {err}")
            return None
        self._add(name, "fail" if figures.pop("failed", None) else "pass", time.perf_counter() - start,
                  **figures)
        return figures

    def skip(self, name: str, reason: str) -> None:
        self._add(name, "skip", 0.0, reason=reason)

    def _add(self, name: str, status: str, seconds: float, **figures: Any) -> None:
        entry = {"name": name, "status": status, "seconds": round(seconds, 3), **figures}
        self.steps.append(entry)
        details = " ".join(f"{k}={v}" for k, v in figures.items())
        print(f"gpu-smoke: {name}: {status.upper()} ({seconds:.1f} s) {details}", flush=True)

    @property
    def ok(self) -> bool:
        return all(s["status"] != "fail" for s in self.steps)

    def as_json(self) -> dict[str, Any]:
        return {"device": self.device, "pass": self.ok, "steps": self.steps}


@torch.no_grad()
def gap(model, prompts, groups, sampling, device) -> float:
    worst = 0.0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
            ref = sampling_log_softmax(logits, sampling).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()
            worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
    return worst


def learner_steps(cfg) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Four DeepSpeed steps with the HF backend in the same process; the trained full weights."""
    from asyncrlhf.bench.inprocess import InProcess
    from asyncrlhf.training import engine

    run = InProcess(cfg.model_copy(update={"generator": cfg.generator.model_copy(update={"backend": "hf"})}))
    result = run.run()
    weights = engine.full_state_dict(run.policy.module, cfg.learner.deepspeed.zero_stage, False)
    figures = {"steps": cfg.learner.total_steps, "s_per_step": round(result["s_per_step"], 3),
               "failed": run.state.steps != cfg.learner.total_steps}
    return figures, {name: t.detach().cpu() for name, t in weights.items()}


def tokens_per_s(backend, prompts, sampling) -> dict[str, Any]:
    """The backend's `generate` against bare `LLM.generate` on the same engine, after a warm-up, alternating
    which goes first."""
    from vllm import SamplingParams

    params = SamplingParams(n=4, temperature=sampling.temperature, top_p=sampling.top_p,
                            top_k=sampling.top_k or -1, max_tokens=sampling.max_new_tokens, logprobs=0,
                            seed=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    backend.generate(prompts, 4, sampling)
    seconds, tokens = {"ours": 0.0, "bare": 0.0}, {"ours": 0, "bare": 0}

    def ours() -> int:
        return sum(len(c.token_ids) for g in backend.generate(prompts, 4, sampling) for c in g)

    def bare() -> int:
        return sum(len(o.token_ids) for r in backend.llm.generate(requests, params, use_tqdm=False)
                   for o in r.outputs)

    for i in range(4):
        for name, run in (("ours", ours), ("bare", bare)) if i % 2 else (("bare", bare), ("ours", ours)):
            start = time.perf_counter()
            tokens[name] += run()
            seconds[name] += time.perf_counter() - start
    rate = {name: tokens[name] / seconds[name] for name in tokens}
    return {"tokens_per_s": round(rate["ours"], 1), "bare_tokens_per_s": round(rate["bare"], 1),
            "ratio": round(rate["ours"] / rate["bare"], 3)}


def push(backend, weights, version: int, dtype: str = "float32", nccl: bool | None = None) -> dict[str, Any]:
    """`weights` over WeightSync into `backend`, as a learner on this host pushes them: seconds, route. `nccl`
    not None: over the collective route only (NCCL when true, else gloo), received by the engine's worker
    where it joins weight groups (on the engine's GPU, cuda:0: the learner on cuda:1), else by this process
    (on cuda:1, the learner on cuda:0)."""
    in_engine = backend.hop.rounds if nccl is not None else None
    member = None if nccl is None else in_engine or CollectiveMember("cuda:1" if nccl else "cpu")
    server, port = serve(WeightReceiver(backend, collective=member), access=ServerAccess(TOKEN))
    learner_device = ("cuda:1" if in_engine is not None else "cuda:0") if nccl else "cpu"
    senders = None if nccl is None else \
        [CollectiveSender(timeout_s=600, device=learner_device), StreamSender(4 << 20)]
    try:
        target = PushTarget("smoke", f"127.0.0.1:{port}")
        with WeightPusher(ClientAccess(TOKEN), dtype=dtype, timeout_s=600, route_senders=senders) as pusher:
            (route,) = pusher.probe([target])
            start = time.perf_counter()
            (outcome,) = pusher.push(weights, PolicyVersion(0, version), [target])
            seconds = time.perf_counter() - start
    finally:
        server.stop(0)
        if member is not None and member is not in_engine:  # the engine's is the backend's to close
            member.close()
    if outcome.status != "ok" or (nccl is not None and outcome.route != Route.COLLECTIVE):
        raise RuntimeError(f"push refused, or not over the route asked: {outcome}")
    # the hop the bytes took when they reached this process: a worker round hands them over by its own
    handed = backend.hop.handed if isinstance(backend.hop, WorkerRound) else backend.hop
    handoff = "engine worker joined" if in_engine is not None else str(handed.kind)
    return {"route": str(route), "handoff": handoff,
            "push_s": round(seconds, 3), "bytes": outcome.bytes,
            "failed": backend.version != version or handed.kind is HopKind.FILE}


def large_model_dir(cache: str) -> Path:
    """A ~1B-parameter Llama (random weights, bf16) saved once to the cache, tokenizer of the demo model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target = Path(cache) / "llama-1b-random"
    if not (target / "config.json").is_file():
        config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20,
                             num_attention_heads=16, num_key_value_heads=16, vocab_size=49152,
                             max_position_embeddings=2048, torch_dtype="bfloat16")
        with torch.device("cuda"):
            LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(target)
        demo = load_config([], [f"model.cache_dir={cache}", "model.name_or_path=smollm2-135m-instruct"])
        load_tokenizer(demo.model).save_pretrained(target)  # its vocabulary: 49152
    return target


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    summary = Summary("cuda" if cuda else "cpu")
    cache = tempfile.mkdtemp(prefix="asyncrlhf-gpu-smoke-")
    cfg = smoke_config(cache, cuda=cuda)
    state: dict[str, Any] = {}

    def learn():
        figures, state["weights"] = learner_steps(cfg)
        return figures

    summary.run("learner", learn)
    smoke_engine(summary, cfg, state, cuda)
    if not cuda:
        summary.skip("push-lora", "the CPU form starts one engine "
                                  "(tests/integration/vllm/test_lora.py pushes adapters on CPU)")
        summary.skip("push-1b", NO_CUDA)
        summary.skip("tensor-parallel", NO_CUDA)
    else:
        summary.run("push-lora", lambda: push_lora(cache))
        summary.run("push-1b", lambda: push_large(cache))
        skipped = tensor_parallel_skipped(args.tp, torch.cuda.device_count())
        if skipped:
            summary.skip("tensor-parallel", skipped)
        else:
            tp = smoke_config(cache, f"generator.tensor_parallel_size={args.tp}", cuda=True)
            smoke_engine(summary, tp, state, cuda, prefix=f"tp{args.tp}-")
    out = summary.as_json()
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print("gpu-smoke: " + ("PASS" if summary.ok else "FAIL"))
    return 0 if summary.ok else 1


def smoke_engine(summary: Summary, cfg, state: dict[str, Any], cuda: bool, prefix: str = "") -> None:
    """Generation and a push of the learner's weights into one engine, then its gap to the HF model."""
    from asyncrlhf.sampling.vllm import VLLMBackend

    tokenizer = load_tokenizer(cfg.model)
    prompts = encode_prompts(tokenizer, PROMPTS, cfg.model)
    started: list[Any] = []

    def start() -> dict[str, Any]:
        started.append(VLLMBackend.from_config(cfg, tokenizer))
        local = started[0].hop.kind is HopKind.IN_PROCESS
        return {"out_of_process": not local, "failed": local}

    summary.run(f"{prefix}engine-start", start)
    if not started:
        return
    engine = started[0]
    sampling = cfg.generator.sampling
    try:
        summary.run(f"{prefix}generate", lambda: tokens_per_s(engine, prompts, sampling))
        weights = state.get("weights")
        if weights is None:
            summary.skip(f"{prefix}push-shm", "the learner step failed: no trained weights to push")
            return
        device = "cuda" if cuda else "cpu"

        def push_and_check():
            figures = push(engine, weights, version=engine.version + 1)
            model = load_policy(cfg.model, device=device).eval()
            model.load_state_dict(weights)
            measured = gap(model, prompts, engine.generate(prompts, 2, sampling), sampling, device)
            failed = figures["failed"] or measured > PARITY_ATOL
            return {**figures, "gap": f"{measured:.2e}", "failed": failed}

        summary.run(f"{prefix}push-shm", push_and_check)
        if not prefix:
            summary.run("push-collective", lambda: push_collective(engine, cfg, weights, prompts, cuda))
    finally:
        engine.close()


def push_collective(engine, cfg, weights, prompts, cuda: bool) -> dict[str, Any]:
    """The learner's weights, perturbed, over the collective route into `engine`, which serves `weights`:
    the gap to the pushed model, and to the one served before (the served weights must have moved)."""
    nccl = cuda and torch.cuda.device_count() >= 2
    gen = torch.Generator().manual_seed(1)
    moved = {n: t + 0.05 * torch.randn(t.shape, generator=gen) if t.is_floating_point() else t
             for n, t in weights.items()}
    figures = push(engine, moved, version=engine.version + 1, nccl=nccl)
    device = "cuda" if cuda else "cpu"
    model = load_policy(cfg.model, device=device).eval()
    groups = engine.generate(prompts, 2, cfg.generator.sampling)
    model.load_state_dict(moved)
    to_pushed = gap(model, prompts, groups, cfg.generator.sampling, device)
    model.load_state_dict(weights)
    to_before = gap(model, prompts, groups, cfg.generator.sampling, device)
    failed = figures["failed"] or to_pushed > PARITY_ATOL or to_before <= 10 * PARITY_ATOL
    backend = "nccl" if nccl else "gloo" + ("" if not cuda else " (nccl needs 2 GPUs: one per rank)")
    return {**figures, "backend": backend, "gap": f"{to_pushed:.2e}", "gap_to_previous": f"{to_before:.2e}",
            "failed": failed}


def push_lora(cache: str) -> dict[str, Any]:
    """A rank-8 adapter into an engine that serves it with vLLM's LoRA kernels; its gap to HF + PEFT."""
    from asyncrlhf.sampling.vllm import VLLMBackend
    from asyncrlhf.weights.codec import adapter_tensors

    cfg = smoke_config(cache, "learner.lora.enabled=true", "learner.lora.r=8", cuda=True)
    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    try:
        peft = load_policy(cfg.model, lora=cfg.learner.lora, device="cuda").eval()
        gen = torch.Generator().manual_seed(0)
        adapter = {n: 0.05 * torch.randn(t.shape, generator=gen)
                   for n, t in adapter_tensors(peft.state_dict()).items()}
        peft.load_state_dict({n: t.cuda() for n, t in adapter.items()}, strict=False)
        start = time.perf_counter()
        backend.apply_weights(adapter, PolicyVersion(0, 1))
        seconds = time.perf_counter() - start
        prompts = encode_prompts(tokenizer, PROMPTS, cfg.model)
        sampling = cfg.generator.sampling
        measured = gap(peft, prompts, backend.generate(prompts, 2, sampling), sampling, "cuda")
    finally:
        backend.close()
    return {"push_s": round(seconds, 3), "gap": f"{measured:.2e}", "failed": measured > PARITY_ATOL}


def push_large(cache: str) -> dict[str, Any]:
    from asyncrlhf.sampling.vllm import VLLMBackend

    model_dir = large_model_dir(cache)
    cfg = load_config([], [f"model.cache_dir={cache}", f"model.name_or_path={model_dir}",
                           "model.dtype=bfloat16", "generator.backend=vllm", "generator.device=cuda",
                           "generator.vllm.gpu_memory_utilization=0.4", "generator.vllm.max_model_len=512",
                           "generator.vllm.engine_in_process=false"])
    backend = VLLMBackend.from_config(cfg, load_tokenizer(cfg.model))
    try:
        gen = torch.Generator().manual_seed(0)
        weights = {name: 0.02 * torch.randn(t.shape, generator=gen).to(torch.bfloat16)
                   for name, t in backend.named_tensors().items()}
        return push(backend, weights, version=1, dtype="bfloat16")
    finally:
        backend.close()


if __name__ == "__main__":
    sys.exit(main())
