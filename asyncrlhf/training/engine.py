"""DeepSpeed engines for the learner: process group, DeepSpeed config, gathering weights to push or save.

Runs for real on CPU (gloo) and GPU (nccl). Gradient accumulation is driven by the trainer, which marks
the accumulation boundary itself (`set_gradient_accumulation_boundary`): a step's number of sequences
varies (ties, stale groups), and the loss is already normalised by the whole step's token count.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from asyncrlhf.config import LearnerConfig
from asyncrlhf.redis_server import free_port
from asyncrlhf.weights.codec import adapter_tensors


def init_distributed() -> tuple[int, int]:
    """Join (or, run alone, create) the process group; returns (rank, world_size).

    Under `deepspeed`/`torchrun` the launcher sets RANK/WORLD_SIZE/MASTER_*; a plain process becomes a world
    of one on a free loopback port.
    """
    # DeepSpeed JIT-builds a CPU comm op at start; one build cache per environment, so two virtualenvs (or
    # two checkouts) do not keep rebuilding over each other's copy (a minute or more each time).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    import deepspeed
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


def deepspeed_config(cfg: LearnerConfig, total_steps: int) -> dict:
    """The DeepSpeed config for `cfg`, or the user's own JSON (`learner.deepspeed.config_file`)."""
    ds = cfg.deepspeed
    if ds.config_file:
        path = Path(ds.config_file)
        if not path.is_file():
            raise FileNotFoundError(f"learner.deepspeed.config_file {path} does not exist")
        return json.loads(path.read_text())
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
    """A DeepSpeed engine around `model` with AdamW and the configured schedule."""
    import deepspeed

    optimizer = make_optimizer(model, cfg, lr)
    scheduler = make_scheduler(optimizer, cfg)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg, cfg.total_steps)
    )
    return engine


@contextlib.contextmanager
def gathered(module: nn.Module, zero_stage: int) -> Iterator[None]:
    """Under ZeRO-3 parameters are partitioned: gather them (read-only) for a push or a save."""
    if zero_stage < 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield


def full_state_dict(module: nn.Module, zero_stage: int, only_adapters: bool) -> Mapping[str, torch.Tensor]:
    """The tensors generators need: every weight, or just LoRA adapters; detached CPU copies."""
    with gathered(module, zero_stage):
        state = module.state_dict()
        if only_adapters:
            state = adapter_tensors(state)
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}
