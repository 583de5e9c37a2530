"""What `asyncrlhf up` checks before anything starts (before Redis, before any service), so a run that cannot
start is refused with what to do: what becomes of the run directory (resume, `--fresh`, a checkpoint trained
with another config: `asyncrlhf.resume`), every model the services load can be found (a hub model fetched
once, here, not by each service at the same time), a config's SFT warm start has been trained, and on a GPU
machine the run fits its GPUs (`asyncrlhf plan`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from asyncrlhf.config import Config
from asyncrlhf.cores import cuda_available


def refusal(cfg: Config, files: Sequence[str], flags: Collection[str],
            say: Callable[[str], None]) -> str | None:
    """Every check in order, the run directory first (`flags`: `--fresh`, `--resume-anyway`); why the run must
    not start, or None."""
    from asyncrlhf.resume import prepare_run_dir

    return (prepare_run_dir(cfg, flags, say) or prepare_models(cfg, files)
            or plan_refusal(cfg, files))


def prepare_models(cfg: Config, files: Sequence[str]) -> str | None:
    """Find every model the services start from (a GGUF converted once, a hub model fetched once, here,
    so the services do not all do it at the same time); why one cannot be used, naming its key, or None."""
    from asyncrlhf.model_sources import ModelLoadError, resolve_model_dir
    from asyncrlhf.run_models import run_models

    for found in run_models(cfg):
        try:
            resolve_model_dir(found.model)
        except ModelLoadError as err:
            if found.key == "model.name_or_path":
                return warm_start_missing(cfg, files) or str(err)
            return f"{found.key}: {err}"
    return None


def plan_refusal(cfg: Config, files: Sequence[str]) -> str | None:
    """On a GPU machine, why the run does not fit its GPUs (`asyncrlhf plan`), or None; on the CPU, None."""
    if not cfg.launch.check_plan or not cuda_available():  # on a CPU build, without importing torch
        return None
    import torch

    from asyncrlhf.planning.plan import make_plan

    gpus = torch.cuda.device_count()
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
    refusals = make_plan(cfg, gpus, memory).refusals()
    if not refusals:
        return None
    return (f"the run does not fit this machine's {gpus} GPUs (`asyncrlhf plan {' '.join(files)}` shows each "
            "service's device and memory):\n" + "\n".join(f"  - {r}" for r in refusals)
            + "\n(launch.check_plan=false starts it anyway)")


def warm_start_missing(cfg: Config, files: Sequence[str]) -> str | None:
    """What to do when the model `up` starts from is this config's own SFT output (`sft.output`, a warm
    start such as configs/tools_calculator.yaml) and `asyncrlhf sft` has not written it yet; None when the
    model is something else."""
    from asyncrlhf.stages.common import run_path  # where `asyncrlhf sft` writes it

    model = Path(cfg.model.name_or_path).expanduser()
    output = run_path(cfg, cfg.sft.output)
    if model.exists() or model.resolve() != output.resolve():
        return None
    config = " ".join(files) or "CONFIG.yaml"
    return (f"model.name_or_path {model} is this config's SFT warm start (sft.output) and has not been "
            f"written yet: run `asyncrlhf sft {config}` first (it trains it from "
            f"{cfg.sft.base or cfg.model.name_or_path}), then `asyncrlhf up` again")
