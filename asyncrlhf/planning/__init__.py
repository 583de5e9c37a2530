"""`asyncrlhf plan CONFIG [--gpus N] [--gpu-memory GiB] [overrides]`: where every service of a run computes
on one node and what it holds there, before anything starts; refuses (exit 1) a run that does not fit, with
the reason.

    --gpus N          GPUs on the node (default: this machine's)
    --gpu-memory GiB  memory of each (default: this machine's GPU's, else 80, an H100's or A100's)

Every process is placed as `asyncrlhf up` places it (launch.gpus, each service's `device`, learner ranks on
their own GPUs), and its memory estimated from its models' config.json (a hub id's alone, from the HF cache
or the hub; a local directory; the packaged model): weights by dtype, gradients and AdamW state per ZeRO
stage, activations of one micro-batch, vLLM's gpu_memory_utilization share, the reward, gold and reference
models, and ~1 GiB of CUDA context per process (asyncrlhf/planning/memory.py says how each is estimated).
`up` runs the same check on a GPU machine (launch.check_plan).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from asyncrlhf.config import ConfigError, load_config
from asyncrlhf.config_cli import split_config_args

DEFAULT_GPU_GIB = 80.0
FLAGS = ("--gpus", "--gpu-memory")


class UsageError(ValueError):
    """The command line cannot be read; the message says how to write it."""


def split_flags(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """`--gpus N` and `--gpu-memory GiB` (or `--flag=value`) out of argv; the rest is config and overrides."""
    found, rest, args = {}, [], list(argv)
    while args:
        arg = args.pop(0)
        name, eq, value = arg.partition("=")
        if name not in FLAGS:
            rest.append(arg)
            continue
        if not eq:
            if not args:
                raise UsageError(f"{name} needs a value")
            value = args.pop(0)
        found[name] = value
    return found, rest


def node(flags: dict[str, str]) -> tuple[int, float]:
    """(GPUs, GiB each): the flags, else this machine's GPUs."""
    import torch

    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        gpus = int(flags.get("--gpus", here))
        memory = float(flags["--gpu-memory"]) if "--gpu-memory" in flags else (
            torch.cuda.get_device_properties(0).total_memory / 1024**3 if here else DEFAULT_GPU_GIB)
    except ValueError:
        raise UsageError("--gpus takes a whole number, --gpu-memory a number of GiB") from None
    if gpus < 0 or memory <= 0:
        raise UsageError("--gpus must be 0 or more and --gpu-memory above 0")
    return gpus, memory


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    from asyncrlhf.model_sources import ModelLoadError
    from asyncrlhf.planning.plan import make_plan, table

    try:
        flags, rest = split_flags(argv)
        gpus, memory = node(flags)
        files, overrides = split_config_args(rest)
        cfg = load_config(files, overrides)
        plan = make_plan(cfg, gpus, int(memory * 1024**3))
    except (UsageError, ConfigError, ModelLoadError, ValueError) as err:  # ValueError: a setting the plan
        # cannot size (an unknown scorer kind, a value model whose tokenizer is not the policy's)
        print(f"asyncrlhf plan: {err}", file=sys.stderr)
        return 2
    where = f"{gpus} GPU{'s' if gpus != 1 else ''} of {memory:.1f} GiB" if gpus else "no GPU"
    print(f"asyncrlhf plan: {' '.join(files)} on {where}")
    print(table(plan))
    if not gpus and not plan.fits:
        print("(this machine has no GPU: plan for a GPU node with --gpus N --gpu-memory GiB)")
    return 0 if plan.fits else 1
