"""A floor on a run's time on H100-class GPUs: the least time a step's arithmetic and memory reads take, not a
measurement (vLLM's scheduling, weight pushes, Python and the kernels' own efficiency come on top).

- learner: a token costs 2 FLOPs a parameter forward and 4 backward (Kaplan et al. 2020), so 6N to train a
  full model; LoRA skips the weights' gradients (4N), a frozen reference adds a forward (2N), PPO's value
  model trains alike, and PPO repeats it for `ppo.epochs`. Split over the ranks, at ASSUMED_MFU of the peak;
- generation: decoding reads every weight once per token (batched sequences share the read), so a batch
  takes at least max_new_tokens x weight bytes / HBM bandwidth, over the tensor-parallel shards; a step
  needs groups_per_step / (batch_prompts x replicas) batches.
Off-policy (`learner.max_staleness` >= 1) the two overlap and a step takes the longer; on-policy, both.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrlhf.config import Config, PPOLearnerConfig
from asyncrlhf.planning.memory import DTYPE_BYTES, Shape

PEAK_FLOPS = 989e12  # H100 SXM, dense bf16
HBM_BYTES_PER_S = 3.35e12  # H100 SXM
ASSUMED_MFU = 0.4  # a well-tuned training step's share of the peak


@dataclass(frozen=True)
class StepFloor:
    """Seconds a step takes at least: training on the learner's ranks, generating one batch."""

    train_s: float
    generate_s: float
    overlapped: bool  # off-policy: generation runs while the learner trains

    @property
    def step_s(self) -> float:
        return max(self.train_s, self.generate_s) if self.overlapped else self.train_s + self.generate_s


def step_floor(cfg: Config, policy: Shape, value: Shape | None, needs_reference: bool, tokens: int
               ) -> StepFloor:
    """The floor of one step of `cfg`, whose sequences hold `tokens` tokens."""
    lc, g = cfg.learner, cfg.generator
    trained_tokens = lc.groups_per_step * g.samples_per_prompt * tokens
    per_token = (4 if lc.lora.enabled else 6) * policy.params + (2 * policy.params if needs_reference else 0)
    if value is not None:
        per_token += 6 * value.params
    epochs = lc.ppo.epochs if isinstance(lc, PPOLearnerConfig) else 1
    train = epochs * per_token * trained_tokens / (cfg.launch.learner_procs * PEAK_FLOPS * ASSUMED_MFU)
    dtype = cfg.model.dtype if g.backend != "vllm" or g.vllm.dtype == "auto" else g.vllm.dtype
    shards = g.tensor_parallel_size if g.backend == "vllm" else 1
    batches = -(-lc.groups_per_step // (g.batch_prompts * g.replicas))
    read = policy.params * DTYPE_BYTES[dtype] / (shards * HBM_BYTES_PER_S)
    generate = batches * g.sampling.max_new_tokens * read
    return StepFloor(train, generate, overlapped=lc.max_staleness >= 1)
