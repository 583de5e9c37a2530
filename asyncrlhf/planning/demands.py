"""What each process of a run holds in memory, item by item (`Demand`), from the models' shapes and the run's
sizes (`asyncrlhf.planning.memory` has the arithmetic and its approximations).

- learner rank: the policy's weights, gradients and AdamW state per ZeRO stage, the reference (a frozen copy
  unless LoRA, whose reference is the base with adapters off), PPO's value model trained alike, activations
  of one micro-batch; rank 0 keeps the last pushed version in host memory;
- generator: vLLM claims `gpu_memory_utilization` of each GPU it shards over (weights and KV cache inside
  it); the HF backend holds the weights and the KV cache of one batch;
- reward: each scorer's model (`SCORER_DEMANDS`, by scorer kind), scoring `reward.batch_size` inputs;
- evaluator: the reference and the checkpoint being evaluated, their KV cache, and the gold scorer's model.

A scorer kind that holds memory adds its function to SCORER_DEMANDS. A judge (`reward.scorers[].kind: judge`,
`evaluator.judge`) whose model runs in this process holds its engine on the device of the service that asks
it (the reward replica's, or the evaluator's); one behind an endpoint (`endpoint.url`) holds nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from asyncrlhf.config import Config, JudgeConfig, ModelScorerConfig, ScorerConfig
from asyncrlhf.model_sources import named_model
from asyncrlhf.models import resolve_dtype
from asyncrlhf.planning import memory as mem
from asyncrlhf.planning.placement import CPU, Process
from asyncrlhf.planning.shapes import model_shape


@dataclass(frozen=True)
class Demand:
    """Memory one process holds on one device for one reason."""

    service: str
    device: str  # `gpu 0`, ..., or `cpu`
    item: str  # what it is, e.g. "policy weights (bfloat16)"
    bytes: int


def _torch_dtype(device: str, setting: str) -> str:
    import torch

    return resolve_dtype(setting, torch.device("cuda" if device != CPU else "cpu"))


def sequence_tokens(cfg: Config) -> int:
    """Tokens of one sampled sequence: the prompt and the completion (an episode's, with an environment)."""
    episode = cfg.task.env.kind != "none"
    new = cfg.task.env.max_episode_tokens if episode else cfg.generator.sampling.max_new_tokens
    return cfg.model.max_prompt_tokens + new


def model_scorer(sc: ModelScorerConfig, cfg: Config, device: str) -> list[tuple[str, int]]:
    """A reward model scoring `reward.batch_size` inputs of up to `reward.max_length` tokens."""
    dtype = _torch_dtype(device, sc.dtype)
    shape = model_shape(named_model(sc.path, cfg.model, revision=sc.revision), "score")
    size = mem.DTYPE_BYTES[dtype]
    tokens = cfg.reward.max_length
    return [(f"reward model {sc.path} ({dtype})", mem.weights(shape.params, size)),
            (f"scoring {cfg.reward.batch_size} x {tokens} tokens",
             mem.inference_activations(shape, cfg.reward.batch_size, tokens, size))]


def judge_engine(judge: JudgeConfig, cfg: Config, device: str, gpu_bytes: int) -> list[tuple[str, int]]:
    """A judge's engine in this process: vLLM's share of the GPU (its weights and KV cache inside it), or on
    the CPU its weights and KV cache (`engine.kv_cache_gib`); transformers: its weights and one batch of
    `batch_size` prompts scored at `engine.max_model_len`. Nothing for a judge behind an endpoint."""
    if judge.remote:
        return []
    name, engine = judge.model.name_or_path, judge.engine
    if engine.backend == "vllm" and device != CPU:
        return [(f"judge {name}: vLLM's share (gpu_memory_utilization {engine.gpu_memory_utilization:.2f})",
                 int(engine.gpu_memory_utilization * gpu_bytes))]
    dtype = _torch_dtype(device, judge.model.dtype)
    shape = model_shape(judge.model, "causal")
    size = mem.DTYPE_BYTES[dtype]
    weights = (f"judge {name} weights ({dtype})", mem.weights(shape.params, size))
    if engine.backend == "vllm":
        return [weights, (f"judge {name}: vLLM KV cache (engine.kv_cache_gib)",
                          engine.kv_cache_gib * mem.GIB)]
    tokens = engine.max_model_len or shape.max_positions
    return [weights, (f"judge {name}: scoring {judge.batch_size} x {tokens} tokens",
                      mem.inference_activations(shape, judge.batch_size, tokens, size))]


# scorer kind -> (its config, the run's, its device, a GPU's bytes) -> [(what, bytes)]
SCORER_DEMANDS: dict[str, Callable[..., list[tuple[str, int]]]] = {
    "rule": lambda sc, cfg, device, gpu_bytes: [],
    "remote": lambda sc, cfg, device, gpu_bytes: [],
    "model": lambda sc, cfg, device, gpu_bytes: model_scorer(sc, cfg, device),
    "judge": judge_engine,
}


def scorer_demands(sc: ScorerConfig, cfg: Config, device: str, gpu_bytes: int) -> list[tuple[str, int]]:
    if sc.kind not in SCORER_DEMANDS:
        raise ValueError(f"asyncrlhf plan does not know what a `{sc.kind}` scorer holds: add it to "
                         "SCORER_DEMANDS in asyncrlhf/planning/demands.py")
    return SCORER_DEMANDS[sc.kind](sc, cfg, device, gpu_bytes)


def demands(process: Process, cfg: Config, gpu_bytes: int) -> list[Demand]:
    """Every item `process` holds, on the device that holds it."""
    items: list[tuple[str, str, int]] = {
        "learner": _learner, "generator": _generator, "reward": _reward, "evaluator": _evaluator,
    }[process.kind](process, cfg, gpu_bytes)
    used = {device for device, _, size in items if size}
    vllm = process.kind == "generator" and cfg.generator.backend == "vllm"  # its share includes the context
    context = [(d, "CUDA context and allocator", mem.CONTEXT_BYTES) for d in process.devices
               if d != CPU and d in used and not vllm]
    return [Demand(process.service, device, item, size) for device, item, size in items + context if size]


def _learner(process: Process, cfg: Config, gpu_bytes: int) -> list[tuple[str, str, int]]:
    from asyncrlhf.training.objectives import make_objective
    from asyncrlhf.training.policies import value_source

    lc, device = cfg.learner, process.devices[0]
    ranks, zero = cfg.launch.learner_procs, lc.deepspeed.zero_stage
    compute = "bfloat16" if lc.deepspeed.bf16 else cfg.model.dtype
    size, loaded = mem.DTYPE_BYTES[compute], mem.DTYPE_BYTES[cfg.model.dtype]
    policy = model_shape(cfg.model, "causal", lc.lora if lc.lora.enabled else None)
    trained = policy.adapter_params if lc.lora.enabled else policy.params
    optimizer_at = CPU if lc.deepspeed.offload_optimizer and zero >= 1 else device
    shards = ranks if zero == 3 else 1
    tokens, rows = (lc.pack_tokens, 1) if lc.packing else (sequence_tokens(cfg), lc.micro_batch_size)
    what = "LoRA adapters" if lc.lora.enabled else "policy"
    items = [
        (device, f"policy weights ({compute}{f', 1/{shards}' if shards > 1 else ''})",
         mem.weights(policy.params, size, shards)),
        (device, f"{what} gradients (ZeRO-{zero})", mem.gradients(trained, size, zero, ranks)),
        (optimizer_at, f"{what} AdamW state (ZeRO-{zero})",
         mem.optimizer_state(trained, lc.deepspeed.bf16, zero, ranks)),
        (device, f"activations ({rows} x {tokens} tokens)",
         mem.training_activations(policy, rows, tokens, size)),
    ]
    objective = make_objective(cfg)
    if objective.needs_reference and not lc.lora.enabled:
        items.append((device, f"reference policy ({cfg.model.dtype}, frozen)",
                      mem.weights(policy.params, loaded)))
    if objective.needs_values:
        value = model_shape(value_source(cfg), "score")
        items += [(device, f"value model ({compute}, trained)",
                   mem.weights(value.params, size, shards) + mem.gradients(value.params, size, zero, ranks)),
                  (optimizer_at, "value model AdamW state",
                   mem.optimizer_state(value.params, lc.deepspeed.bf16, zero, ranks)),
                  (device, "value model activations", mem.training_activations(value, rows, tokens, size))]
    if process.rank == 0:
        pushed = mem.DTYPE_BYTES[lc.push_dtype]
        items.append((CPU, f"last pushed version ({lc.push_dtype})", mem.weights(trained, pushed)))
    return items


def _generator(process: Process, cfg: Config, gpu_bytes: int) -> list[tuple[str, str, int]]:
    g = cfg.generator
    policy = model_shape(cfg.model, "causal")
    sequences = g.batch_prompts * g.samples_per_prompt
    if g.backend == "vllm":
        v = g.vllm
        if process.devices == (CPU,):
            dtype = cfg.model.dtype if v.dtype == "auto" else v.dtype
            return [(CPU, f"vLLM weights ({dtype})", mem.weights(policy.params, mem.DTYPE_BYTES[dtype])),
                    (CPU, "vLLM KV cache (generator.vllm.kv_cache_gib)", v.kv_cache_gib * mem.GIB)]
        share = int(v.gpu_memory_utilization * gpu_bytes)
        return [(d, f"vLLM's share (gpu_memory_utilization {v.gpu_memory_utilization:.2f})", share)
                for d in process.devices]
    size = mem.DTYPE_BYTES[cfg.model.dtype]
    device, tokens = process.devices[0], sequence_tokens(cfg)
    return [(device, f"policy weights ({cfg.model.dtype})", mem.weights(policy.params, size)),
            (device, f"KV cache ({sequences} x {tokens} tokens)",
             mem.kv_cache(policy, sequences, tokens, size))]


def _reward(process: Process, cfg: Config, gpu_bytes: int) -> list[tuple[str, str, int]]:
    device = process.devices[0]
    return [(device, item, size)
            for sc in cfg.reward.scorers for item, size in scorer_demands(sc, cfg, device, gpu_bytes)]


def _evaluator(process: Process, cfg: Config, gpu_bytes: int) -> list[tuple[str, str, int]]:
    ec, device = cfg.evaluator, process.devices[0]
    policy = model_shape(cfg.model, "causal")
    size = mem.DTYPE_BYTES[cfg.model.dtype]
    tokens = cfg.model.max_prompt_tokens + ec.max_new_tokens
    items = [(device, f"reference and checkpoint policies ({cfg.model.dtype})",
              2 * mem.weights(policy.params, size)),
             (device, f"KV cache and KL scoring ({ec.batch_size} x {tokens} tokens)",
              mem.kv_cache(policy, ec.batch_size, tokens, size)
              + mem.inference_activations(policy, ec.batch_size, tokens, size))]
    gold = [(device, f"gold: {item}", size)
            for item, size in scorer_demands(ec.gold, cfg, device, gpu_bytes)]
    judged = judge_engine(ec.judge, cfg, device, gpu_bytes) if ec.judge is not None else []
    return items + gold + [(device, f"evaluator.judge: {item}", size) for item, size in judged]
