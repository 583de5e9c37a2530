"""`Config`, the whole run's tree: its sections, the token from the environment, the YAML that is printed and
saved (without secrets), and the hash services log."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import yaml
from pydantic import model_validator

from asyncrlhf.config.base import Section
from asyncrlhf.config.learner import LearnerConfig, OnlineDPOLearnerConfig
from asyncrlhf.config.model import VLLM_CPU_HEAD_SIZES, VLLM_LORA_RANKS, GeneratorConfig, ModelConfig
from asyncrlhf.config.reward import EvaluatorConfig, RewardConfig
from asyncrlhf.config.run import (
    LaunchConfig,
    MetricsConfig,
    RedisConfig,
    RunConfig,
    TaskConfig,
    url_without_password,
)
from asyncrlhf.config.stages import RelabelConfig, RewardModelTrainingConfig, SFTConfig


class Config(Section):
    """The whole run."""

    run: RunConfig = RunConfig()
    redis: RedisConfig = RedisConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    generator: GeneratorConfig = GeneratorConfig()
    reward: RewardConfig = RewardConfig()
    learner: LearnerConfig = OnlineDPOLearnerConfig()
    evaluator: EvaluatorConfig = EvaluatorConfig()
    sft: SFTConfig = SFTConfig()
    relabel: RelabelConfig = RelabelConfig()
    rm: RewardModelTrainingConfig = RewardModelTrainingConfig()
    metrics: MetricsConfig = MetricsConfig()
    launch: LaunchConfig = LaunchConfig()

    @model_validator(mode="after")
    def _token_from_env(self) -> Config:
        if self.run.token is None and os.environ.get("ASYNCRLHF_TOKEN"):
            self.run = self.run.model_copy(update={"token": os.environ["ASYNCRLHF_TOKEN"]})
        return self

    @model_validator(mode="after")
    def _resolve_auto_backend(self) -> Config:
        """`generator.backend: auto` -> `vllm` where vLLM is installed, runs on this host and can serve this
        run (else `hf`), with the reason; before the checks below, which see the backend chosen."""
        if self.generator.backend == "auto":
            backend, reason = auto_backend(self)
            self.generator = self.generator.model_copy(update={"backend": backend, "auto_reason": reason})
        return self

    @model_validator(mode="after")
    def _continuous_corrects_stale_tokens(self) -> Config:
        """`learner.stale_policy` left unset in continuous mode: tis, not drop (its description says why)."""
        if self.generator.mode == "continuous" and "stale_policy" not in self.learner.model_fields_set:
            self.learner = self.learner.model_copy(update={"stale_policy": "tis"})
        return self

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> Config:
        g, tp = self.generator, self.generator.tensor_parallel_size
        if tp > 1 and g.backend != "vllm":
            raise ValueError(f"generator.tensor_parallel_size={tp} needs generator.backend=vllm (the `hf` "
                             "backend runs on one device)")
        gpus = self.launch.gpus.get("generator")
        given = len([d for d in str(gpus).split(",") if d.strip()]) if gpus is not None else tp
        if given < tp:
            raise ValueError(f"generator.tensor_parallel_size={tp} needs {tp} GPUs per generator replica, "
                             f"but launch.gpus.generator={gpus!r} lists fewer")
        return self

    @model_validator(mode="after")
    def _a_reward_to_train_on(self) -> Config:
        if not self.reward.scorers and self.task.env.kind == "none":
            raise ValueError("reward.scorers is empty: give at least one scorer (only an episode task, "
                             "task.env, may leave it empty: its environment gives the reward)")
        return self

    @model_validator(mode="after")
    def _vllm_can_serve(self) -> Config:
        if self.generator.backend != "vllm":
            return self
        problem = vllm_cannot_serve(self)
        if problem:
            raise ValueError(problem)
        return self

    def to_yaml(self) -> str:
        """The resolved config as YAML without its secrets (run.token, redis.password and
        redis.sentinel.password, a password in redis.url, a remote scorer's token), so it is safe to print and
        to write into run directories and checkpoints."""
        data = self.model_dump(mode="json")
        data["run"]["token"] = None
        data["redis"]["password"] = None
        data["redis"]["sentinel"]["password"] = None
        if data["redis"]["url"]:
            data["redis"]["url"] = url_without_password(data["redis"]["url"])
        for scorer in [*data["reward"]["scorers"], data["evaluator"]["gold"]]:
            if "token" in scorer:
                scorer["token"] = None
        return yaml.safe_dump(data, sort_keys=False)

    def hash(self) -> str:
        """Short, stable hash of the resolved config (the token excluded, so it is safe to log)."""
        data = self.model_dump(mode="json")
        data["run"].pop("token", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def vllm_cannot_serve(cfg: Config) -> str | None:
    """Why vLLM cannot serve this run (as configured), or None."""
    lora, merge = cfg.learner.lora, cfg.generator.vllm.merge_lora
    if lora.enabled and lora.r not in VLLM_LORA_RANKS and not (
            merge or (merge is None and not _on_gpu(cfg.generator.device))):  # merged: no LoRA kernels
        return (f"learner.lora.r={lora.r}: vLLM's LoRA kernels (generator.backend=vllm) serve ranks "
                f"{', '.join(map(str, VLLM_LORA_RANKS))}; pick one of those, or set "
                "generator.vllm.merge_lora=true (the adapter is folded into the weights)")
    tiny = cfg.model.tiny
    if cfg.model.name_or_path == "tiny" and tiny.hidden // tiny.heads not in VLLM_CPU_HEAD_SIZES:
        sizes, head = ", ".join(map(str, VLLM_CPU_HEAD_SIZES)), tiny.hidden // tiny.heads
        return (f"the tiny model's head size (model.tiny.hidden / heads = {head}) is not one vLLM's CPU "
                f"attention supports ({sizes}); with generator.backend=vllm set e.g. "
                f"model.tiny.heads={max(1, tiny.hidden // 32)}")
    return None


def auto_backend(cfg: Config) -> tuple[str, str]:
    """(backend, why) for `generator.backend: auto`: vLLM on a GPU where it is installed (found without
    importing it: that takes seconds) and can serve the run; HF otherwise. On CPU HF is chosen even where
    vLLM's CPU build is installed: it generates faster, but a small CPU host is bound by training
    (max_staleness 1 overlaps the two), so the demo runs in the same wall clock with either, and vLLM's
    engine starts later (the figures: docs/benchmarks.md, `bench generator`)."""
    if not _on_gpu(cfg.generator.device):
        return "hf", ("auto: on CPU the HF backend (vLLM's CPU build generates faster, but the demo is "
                      "bound by training here: no faster end to end)")
    if importlib.util.find_spec("vllm") is None:
        return "hf", "auto: vLLM is not installed (pip install 'asyncrlhf[vllm]')"
    problem = vllm_cannot_serve(cfg.model_copy(update={
        "generator": cfg.generator.model_copy(update={"backend": "vllm"})}))
    if problem:
        return "hf", f"auto: vLLM cannot serve this run ({problem})"
    return "vllm", "auto: vLLM is installed and can serve this run on the GPU"


def _on_gpu(device: str) -> bool:
    return device.startswith("cuda") or (device == "auto" and _cuda_available())


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
