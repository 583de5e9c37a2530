"""DeepSpeed engines for the learner: process group, DeepSpeed config, gathering weights to push or save.

Runs for real on CPU (gloo) and GPU (nccl). Gradient accumulation is driven by the trainer, which marks
the accumulation boundary itself (`set_gradient_accumulation_boundary`): a step's number of sequences
varies (ties, stale groups), and the loss is already normalised by the whole step's token count.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from asyncrlhf.config import LearnerConfig
from asyncrlhf.deepspeed_import import import_deepspeed
from asyncrlhf.redis_server import free_port
from asyncrlhf.training import user_deepspeed
from asyncrlhf.weights.codec import adapter_tensors


def init_distributed() -> tuple[int, int]:
    """Join (or, run alone, create) the process group; returns (rank, world_size).

    Under `deepspeed`/`torchrun` the launcher sets RANK/WORLD_SIZE/MASTER_*; a plain process becomes a world
    of one on a free loopback port.
    """
    # DeepSpeed JIT-builds a CPU comm op at start; one build cache per environment, so two virtualenvs (or
    # two checkouts) do not keep rebuilding over each other's copy (a minute or more each time).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    deepspeed = import_deepspeed()
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:
            deepspeed.init_distributed(dist_backend=backend, verbose=False)
        else:  # alone: a world of one, without writing RANK/MASTER_* into the environment children inherit
            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it; harmless to a child
            if backend == "gloo":
                _skip_shm_comm_op()
            deepspeed.init_distributed(dist_backend=backend, verbose=False, auto_mpi_discovery=False,
                                       init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _skip_shm_comm_op() -> None:
    """A CPU world of one has no peer to reduce with through DeepSpeed's shared-memory comm op, which it
    would otherwise JIT-compile at start (minutes on a fresh machine): mark the op unavailable, as DeepSpeed
    does on machines that cannot build it, so its TorchBackend uses plain torch.distributed."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def effective_learner(cfg: LearnerConfig) -> LearnerConfig:
    """The learner section in effect: with a user DeepSpeed JSON, its values win (`user_deepspeed`), and
    every one that replaces a different learner value is logged."""
    if not cfg.deepspeed.config_file:
        return cfg
    user = user_deepspeed.resolve(cfg, world_size())
    user_deepspeed.log_overrides(user)
    return user.learner


def deepspeed_config(cfg: LearnerConfig) -> dict:
    """The DeepSpeed config for `cfg`, or the user's own JSON (`learner.deepspeed.config_file`) with its
    "auto" values filled."""
    ds = cfg.deepspeed
    if ds.config_file:
        return user_deepspeed.resolve(cfg, world_size()).config
    zero: dict = {"stage": ds.zero_stage}
    if ds.offload_optimizer and ds.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,  # the trainer marks boundaries itself
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if ds.bf16:
        config["bf16"] = {"enabled": True}
    return config


def make_optimizer(model: nn.Module, cfg: LearnerConfig, lr: float | None = None) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (LoRA target_modules matched nothing?)")
    # foreach=False: the same kernel path on every world size, so 1 rank and 2 ranks agree closely.
    return torch.optim.AdamW(params, lr=lr or cfg.lr, weight_decay=cfg.weight_decay, foreach=False)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: LearnerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    warmup, total = cfg.warmup_steps, max(cfg.total_steps, 1)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if cfg.lr_schedule == "linear":
            return 1.0 - progress
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1.0 + torch.cos(torch.tensor(progress * torch.pi)).item())
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def initialize(model: nn.Module, cfg: LearnerConfig, lr: float | None = None):
    """A DeepSpeed engine around `model`: the optimizer and scheduler of the user's JSON where it has them
    (DeepSpeed builds them), else AdamW with `learner.lr` and the configured schedule."""
    deepspeed = import_deepspeed()

    config = deepspeed_config(cfg)
    optimizer, params, scheduler = None, None, None
    if "optimizer" in config:
        _torch_adam_without_cuda(config)
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        optimizer = make_optimizer(model, cfg, lr)
    if "scheduler" not in config:
        scheduler = functools.partial(make_scheduler, cfg=cfg)  # DeepSpeed calls it with the optimizer
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer,
                                      lr_scheduler=scheduler, config=config)
    return engine


def _torch_adam_without_cuda(config: dict) -> None:
    """DeepSpeed's Adam without CUDA and without offload would need the fused CUDA kernel: use torch's
    AdamW/Adam with the same parameters instead (CPU offload keeps DeepSpeed's CPU Adam)."""
    block = config["optimizer"]
    offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if torch.cuda.is_available() or offload not in (None, "none"):
        return
    if str(block.get("type", "")).lower() in ("adam", "adamw"):
        block.setdefault("params", {}).setdefault("torch_adam", True)
        block["params"].setdefault("foreach", False)


def optimizer_of(engine) -> torch.optim.Optimizer:
    """The optimizer that updates the weights (under ZeRO the engine's optimizer wraps it)."""
    basic = getattr(engine, "basic_optimizer", None)
    return basic if basic is not None else engine.optimizer


def effective_settings(engine, cfg: LearnerConfig) -> str:
    """One line for the start-up log: what is in effect, read from the engine and its optimizer."""
    optimizer = optimizer_of(engine)
    group = optimizer.param_groups[0]
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    scheduler = type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else "none"
    betas = tuple(group.get("betas", ())) or "-"
    micro = engine.train_micro_batch_size_per_gpu()
    return (f"ZeRO stage {engine.zero_optimization_stage()}, optimizer {type(optimizer).__name__} lr "
            f"{group['lr']:g} betas {betas} eps {group.get('eps', '-')} weight_decay "
            f"{group.get('weight_decay')}, scheduler {scheduler}, precision {precision}, micro-batch {micro}"
            f" x {engine.world_size} ranks, gradient clipping {engine.gradient_clipping()}, offload "
            f"optimizer {cfg.deepspeed.offload_optimizer}, config {cfg.deepspeed.config_file or 'generated'}")


@contextlib.contextmanager
def gathered(module: nn.Module, zero_stage: int) -> Iterator[None]:
    """Under ZeRO-3 parameters are partitioned: gather them all (read-only). Pushes and saves gather one
    layer at a time (`full_state_dict`); this is for reading the whole model at once, as tests do."""
    if zero_stage < 3:
        yield
        return
    deepspeed = import_deepspeed()

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield


def full_state_dict(module: nn.Module, zero_stage: int, only_adapters: bool) -> dict[str, torch.Tensor]:
    """The tensors generators need: every weight, or just LoRA adapters; detached CPU copies.

    Under ZeRO-3 every rank must call this (the gathers are collectives); it gathers one module's own
    parameters at a time and copies them out before the next, so memory stays at one layer beyond the
    partitions."""
    if zero_stage < 3:
        state = module.state_dict()
        if only_adapters:
            state = adapter_tensors(state)
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}
    deepspeed = import_deepspeed()

    wanted = list(module.state_dict().keys())  # names only: partitioned parameters are empty here
    if only_adapters:
        wanted = [name for name in wanted if "lora_" in name]
    wanted_set = set(wanted)
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        own = [(f"{prefix}.{name}" if prefix else name, t)
               for name, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]]
        own = [(name, t) for name, t in own if name in wanted_set]
        if not own:
            continue
        params = [t for _, t in own if isinstance(t, nn.Parameter)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            for name, tensor in own:
                out[name] = tensor.detach().to("cpu", copy=True)
    return {name: out[name] for name in wanted}
