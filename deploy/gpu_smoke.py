"""GPU smoke test of the vLLM generator path (deploy/gpu-smoke runs it; under 5 minutes on one GPU):

1. the vLLM backend on CUDA with SmolLM2-135M in fp32 (the learner's dtype): tokens/s of one batch;
2. a learner step on CUDA: one AdamW step of the HF policy on that batch's samples (a REINFORCE-style loss
   on the behaviour log-probs' own completions), so the weights change;
3. a full push of the stepped weights (WeightTarget.apply_weights, as the WeightSync receiver calls it):
   seconds, then the per-token log-prob gap to the HF model on those weights (target <= 1e-3);
4. a LoRA push (rank 8 adapter, a second engine with enable_lora): seconds and the gap to HF + PEFT;
5. with `--tp N`: a third engine sharded over N GPUs (`generator.tensor_parallel_size=N`): tokens/s, then
   the full push of step 3 into every shard and the gap to the HF model (target <= 1e-3). Skipped, with the
   reason printed, when fewer than N GPUs are visible.
Prints one line per measurement and exits non-zero if a parity target is missed. Not run in CI (no GPU).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from asyncrlhf.config import load_config
from asyncrlhf.models import encode_prompts, load_policy, load_tokenizer
from asyncrlhf.sampling.hf import sampling_log_softmax
from asyncrlhf.sampling.vllm import VLLMBackend
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import adapter_tensors

PARITY_ATOL = 1e-3
PROMPTS = ["Write a haiku about the sea.", "Explain rain to a child.", "Name three fruits.", "Say hello."]


@torch.no_grad()
def gap(model, prompts, groups, sampling) -> float:
    worst = 0.0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids], device="cuda")
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
            ref = sampling_log_softmax(logits, sampling).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()
            worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
    return worst


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deploy/gpu-smoke", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="also shard a vLLM engine over N GPUs (generator.tensor_parallel_size=N) and "
                             "check its push and parity; 1 (the default): skip that step")
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


def smoke_config(cache: str, *extra: str):
    return load_config([], [f"model.cache_dir={cache}", "model.name_or_path=smollm2-135m-instruct",
                            "model.dtype=float32", "generator.backend=vllm", "generator.device=cuda",
                            "generator.vllm.gpu_memory_utilization=0.3", "generator.vllm.max_model_len=512",
                            "generator.sampling.max_new_tokens=64", *extra])


def engine(cache: str, *extra: str):
    cfg = smoke_config(cache, *extra)
    tokenizer = load_tokenizer(cfg.model)
    start = time.perf_counter()
    backend = VLLMBackend.from_config(cfg, tokenizer)
    print(f"engine start: {time.perf_counter() - start:.1f} s ({' '.join(extra) or 'full weights'})")
    return cfg, tokenizer, backend


def push_and_check(what, backend, model, weights, prompts, sampling) -> bool:
    """Push `weights` into the engine as version 1, time it, and compare its log-probs with `model`'s."""
    start = time.perf_counter()
    backend.apply_weights(weights, version=PolicyVersion(0, 1))
    print(f"{what} push: {time.perf_counter() - start:.2f} s")
    measured = gap(model, prompts, backend.generate(prompts, 2, sampling), sampling)
    print(f"parity after {what} push: {measured:.2e} nats/token (target <= {PARITY_ATOL})")
    backend.close()
    return measured <= PARITY_ATOL


def timed_generate(what, backend, prompts, sampling):
    start = time.perf_counter()
    groups = backend.generate(prompts, 4, sampling)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    print(f"{what} generate: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s")
    return groups


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    assert torch.cuda.is_available(), "gpu-smoke needs a CUDA GPU"
    ok = True
    cache = tempfile.mkdtemp(prefix="asyncrlhf-gpu-smoke-")
    cfg, tokenizer, backend = engine(cache)
    sampling = cfg.generator.sampling
    prompts = encode_prompts(tokenizer, PROMPTS, cfg.model)
    groups = timed_generate("vLLM", backend, prompts, sampling)

    policy = load_policy(cfg.model, device="cuda")
    print(f"parity before push: {gap(policy, prompts, groups, sampling):.2e} nats/token")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    start = time.perf_counter()
    loss = torch.zeros((), device="cuda")
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids], device="cuda")
            logits = policy(input_ids=ids).logits[0, len(prompt) - 1:-1]
            loss = loss - torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(prompt):, None]).mean()
    loss.backward()
    optimizer.step()
    torch.cuda.synchronize()
    print(f"learner step on CUDA: {time.perf_counter() - start:.2f} s")

    policy.eval()
    state = {name: t.detach().cpu() for name, t in policy.state_dict().items()}
    ok &= push_and_check("full", backend, policy, state, prompts, sampling)

    cfg, tokenizer, backend = engine(cache, "learner.lora.enabled=true", "learner.lora.r=8")
    peft = load_policy(cfg.model, lora=cfg.learner.lora, device="cuda").eval()
    gen = torch.Generator().manual_seed(0)
    adapter = {n: 0.05 * torch.randn(t.shape, generator=gen)
               for n, t in adapter_tensors(peft.state_dict()).items()}
    peft.load_state_dict({n: t.cuda() for n, t in adapter.items()}, strict=False)
    ok &= push_and_check("LoRA", backend, peft, adapter, prompts, sampling)

    skipped = tensor_parallel_skipped(args.tp, torch.cuda.device_count())
    if skipped:
        print(f"tensor parallel: skipped: {skipped}")
    else:
        _, _, backend = engine(cache, f"generator.tensor_parallel_size={args.tp}")
        timed_generate(f"vLLM TP={args.tp}", backend, prompts, sampling)
        ok &= push_and_check(f"TP={args.tp} full", backend, policy, state, prompts, sampling)
    print("gpu-smoke: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
