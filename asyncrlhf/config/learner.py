"""The learner: one section per algorithm, as a union on `learner.algorithm`.

Every member shares `LearnerBase` (optimizer and schedule, staleness, KL, LoRA, DeepSpeed, pushes,
checkpoints, device) and adds its algorithm's own section: `learner.online_dpo` (online DPO),
`learner.policy_gradient` (RLOO, GRPO, Dr. GRPO, REINFORCE++), `learner.ppo` (PPO); best-of-n needs none. A
knob of another algorithm fails at load time, and a key of the old flat section names its new place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from asyncrlhf.config.base import Section, Tagged
from asyncrlhf.config.dynamic_sampling import DynamicSamplingConfig


class KLConfig(Section):
    """`learner.kl`: the penalty that holds the policy near the reference (`asyncrlhf/algorithms/kl.py`)."""

    kind: Literal["kl", "clamped_kl", "bregman", "jensen_shannon", "squared_error"] = Field(
        "kl", description="The per-token estimator: kl (k1), clamped_kl, bregman (k3), jensen_shannon, "
        "squared_error (k2).")
    coef: float = Field(0.05, ge=0, description="KL coefficient (initial value when adaptive).")
    placement: Literal["reward", "loss"] = Field(
        "reward", description="Shape the reward, or add a loss term."
    )
    adaptive: bool = Field(False, description="Adaptive coefficient (Ziegler et al. 2019).")
    target: float = Field(6.0, gt=0, description="Adaptive controller's target KL.")
    horizon: int = Field(10_000, ge=1, description="Adaptive controller's horizon.")


class LoraConfig(Section):
    """LoRA adapters: only they train, the reference is the base with adapters off, pushes carry only them."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of every weight.")
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: int = Field(32, ge=1, description="Adapter scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names that get adapters.")


class DeepSpeedConfig(Section):
    """`learner.deepspeed`: the engine's JSON is generated from these and the learner's keys, unless
    `config_file` names your own (`asyncrlhf/training/user_deepspeed.py`: which of its keys win)."""

    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage.")
    bf16: bool = Field(False, description="Train in bfloat16.")
    config_file: str | None = Field(None, description="Your own DeepSpeed JSON; replaces the generated one.")
    offload_optimizer: bool = Field(False, description="ZeRO >= 1: keep the optimizer state in host memory.")


class PPOConfig(Section):
    """`learner.ppo`: clipped surrogate, value model and GAE."""

    clip_eps: float = Field(0.2, gt=0, description="Policy-ratio clip around the pre-update policy.")
    value_clip_eps: float = Field(0.2, gt=0, description="Value clip around the pre-update values.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (GAE).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    epochs: int = Field(1, ge=1, description="Passes over each batch.")
    minibatches: int = Field(1, ge=1, description="Mini-batches per pass.")
    vf_coef: float = Field(0.1, ge=0, description="Weight of the value loss.")
    value_init: Literal["reward_model", "policy"] = Field(
        "policy", description="The value model starts from the policy, or from the reward model (a `model` "
        "scorer with the policy's tokenizer).")
    whiten_advantages: bool = Field(True, description="Normalise advantages to zero mean, unit variance.")



class OnlineDPOConfig(Section):
    """`learner.online_dpo`: the DPO loss on each group's best and worst completion."""

    beta: float = Field(0.1, gt=0, description="DPO beta: how strongly the policy is held to the reference.")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="sigmoid (DPO), ipo (IPO) or hinge (SLiC).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Conservative DPO (sigmoid loss only).")


class PolicyGradientConfig(Section):
    """`learner.policy_gradient`: RLOO, GRPO, Dr. GRPO and REINFORCE++ (group advantages, clipped
    surrogate)."""

    clip_eps: float = Field(0.2, gt=0, description="Policy-ratio clip around the pre-update policy.")


# Keys of the flat learner section of before (one section held every algorithm's knobs) -> where they are now.
_MOVED = {
    "beta": "online_dpo.beta",
    "dpo_loss_type": "online_dpo.loss_type",
    "label_smoothing": "online_dpo.label_smoothing",
    "clip_eps": "policy_gradient.clip_eps",
}
_OWNERS = {
    "online_dpo": "online DPO's",
    "policy_gradient": "the policy-gradient family's (rloo, grpo, dr_grpo, reinforce_pp)",
}


class LearnerBase(Section):
    """What every algorithm's learner shares."""

    algorithm: str = Field(
        description="online_dpo, ppo, rloo, grpo, dr_grpo, reinforce_pp or best_of_n (picks the member)."
    )
    lr: float = Field(1e-6, gt=0, description="Learning rate (AdamW).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Decay after warm-up, to 0 at total_steps.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    total_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    groups_per_step: int = Field(8, ge=1, description="Prompt groups consumed per optimizer step.")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward pass.")
    packing: bool = Field(
        False, description="Pack samples end to end into rows of up to pack_tokens tokens (position ids "
        "restart per sample, attention never crosses samples; docs/packing.md): no compute on padding. "
        "Micro-batches are then formed and balanced across ranks by tokens, and micro_batch_size is unused."
    )
    pack_tokens: int = Field(2048, ge=1, description="Token budget of one packed row (a micro-batch) when "
                             "packing; a sample longer than it gets a row of its own.")
    pack_attention: Literal["varlen", "mask"] = Field(
        "varlen", description="How a packed row keeps its samples apart: varlen (each sample's attention "
        "computed on its own, where the model's attention goes through transformers' attention interface; "
        "others fall back to mask) or mask (a 4D block-diagonal mask: L x L attention per row).")
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    max_staleness: int = Field(
        1, ge=0, description="Groups may be generated by weights this many versions old."
    )
    stale_policy: Literal["drop", "tis", "decoupled", "keep"] = Field(
        "drop", description="For a group older than max_staleness: drop, IS-correct, or keep it. Left unset "
        "with generator.mode=continuous: tis (a long answer outlives max_staleness while short ones cycle, "
        "so drop would drop the long ones; its tokens within the bound stay fresh: docs/continuous.md)."
    )
    staleness_mode: Literal["bound", "exact", "paper"] = Field(
        "bound", description="bound: groups are at most max_staleness versions old; exact: every group is "
        "exactly max_staleness old (the first max_staleness steps train on the initial policy's); paper: one "
        "policy generates max_staleness + 1 batches, trained in turn (Noukhovitch et al. 2024)."
    )
    tis_cap: float = Field(2.0, gt=0, description="Truncated importance weights are clamped at this value.")
    rollout_correction: Literal["none", "tis", "mis"] = Field(
        "none", description="Importance weights pi_old / mu on every token, fresh ones included, for the "
        "generator's numerics (its kernels, bf16, FP8 against the learner's): tis truncates them at "
        "rollout_correction_cap, mis masks the tokens above it; online DPO weighs a pair by the product over "
        "its tokens. Composes with stale_policy tis/decoupled: the two weights multiply, as veRL's IS weight "
        "and rejection mask do, on the one ratio of a token (truncated at the lower cap, 0 where either "
        "masks; the ratio counted once, not squared). none: a fresh token's ratio is taken as 1 "
        "(docs/off-policy.md, \"The training-inference mismatch\").")
    rollout_correction_cap: float = Field(
        2.0, ge=1, description="The rollout correction's cap c (veRL's rollout_is_threshold and slime's "
        "tis_clip default to 2.0); the mismatch metrics count the tokens whose ratio leaves [1/c, c].")
    kl: KLConfig = KLConfig()
    lora: LoraConfig = LoraConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    sync_every: int = Field(1, ge=1, description="Push weights to generators every this many steps.")
    background_publish: bool = Field(
        True, description="Push each version on a thread of its own while the next step collects and trains "
        "(one push in flight; the next window's credits are freed when it completes, so max_staleness still "
        "holds). false: each step waits for every generator's reply. staleness_mode exact and paper always "
        "publish synchronously (their windows close at a push)."
    )
    push_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of pushed weights.")
    push_chunk_bytes: int = Field(4 << 20, ge=1024, description="Bytes per WeightSync chunk.")
    push_delta: bool = Field(
        False, description="Full fine-tuning: send a generator that kept the previous version only the "
        "elements that changed (int32 indices and values per tensor; a tensor whole where that is smaller), "
        "any other generator the version whole. The learner keeps the last version pushed (CPU, push_dtype), "
        "each generator the version it serves (docs/weights.md, \"Delta pushes\")."
    )
    push_timeout_s: float = Field(60.0, gt=0, description="A push to one generator fails after this long.")
    push_max_failures: int = Field(
        20, ge=1, description="Transient push failures in a row to a live generator before the learner stops."
    )
    relay_fanout: int = Field(
        0, ge=0, description="0: the learner streams each version to every generator. k: generators relay it "
        "in a tree (the learner streams to k, each that has committed forwards to at most k more), so the "
        "learner's upload stays about k versions; same-host generators keep shared memory (docs/weights.md)."
    )
    collective: bool = Field(
        False, description="Broadcast each version in buckets to the generators that offer a weight group "
        "(generator.collective): gloo, or NCCL where learner and generator are on GPUs; control and commit "
        "stay on gRPC. Taken before every other route; not beside run.grpc_tls (docs/weights.md).")
    collective_host: str = Field(
        "127.0.0.1", description="The learner's address the generators reach its weight group's rendezvous "
        "store at (gloo connects over the interface of each host's name; GLOO_SOCKET_IFNAME names another).")
    collective_bucket_bytes: int = Field(
        64 << 20, ge=1024, description="Bytes per broadcast bucket of the collective route (a larger tensor "
        "gets a bucket of its own); each end keeps two.")
    checkpoint_every: int = Field(50, ge=1, description="Write a checkpoint every this many steps.")
    keep_checkpoints: int = Field(3, ge=1, description="Newest checkpoints kept; older ones are deleted.")
    data_epochs: int = Field(1000, ge=1, description="Passes over the prompt set before stopping.")
    device: str = Field("auto", description="`auto`, `cpu`, `cuda`, `cuda:1`.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: leave torch's default).")
    http_host: str = Field("127.0.0.1", description="Bind address of the HTTP server (health, metrics).")
    http_port: int = Field(0, ge=0, description="HTTP port (0: pick a free one).")

    @model_validator(mode="after")
    def _controlled_staleness_pushes_every_step(self) -> LearnerBase:
        if self.staleness_mode != "bound" and self.sync_every != 1:
            raise ValueError(
                f"learner.staleness_mode={self.staleness_mode} needs every version pushed to the generators: "
                f"set learner.sync_every=1 (it is {self.sync_every}), or use staleness_mode=bound"
            )
        return self

    @model_validator(mode="after")
    def _delta_pushes_need_full_fine_tuning(self) -> LearnerBase:
        if self.push_delta and self.lora.enabled:
            raise ValueError(
                "learner.push_delta sends what changed in the full weights; with learner.lora.enabled only "
                "the adapters are pushed (a few MB, nearly every element changes at each step): set "
                "learner.push_delta=false, or learner.lora.enabled=false for full fine-tuning"
            )
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_fits(self) -> LearnerBase:
        if not self.dynamic_sampling.enabled:
            return self
        if self.algorithm == "ppo":
            raise ValueError(
                "learner.dynamic_sampling: PPO's advantages come from its value model, not from the group, "
                "so a group of equal rewards still teaches it: set learner.dynamic_sampling.enabled=false"
            )
        if self.staleness_mode != "bound":
            raise ValueError(
                f"learner.dynamic_sampling refills a step from groups enqueued at once, which "
                f"staleness_mode={self.staleness_mode}'s windows do not allow: use staleness_mode=bound"
            )
        return self

    # A moved key a user may reach for under this algorithm -> what this algorithm has instead (`{prefix}`:
    # the learner's dotted path).
    lookalikes: ClassVar[dict[str, str]] = {}

    @classmethod
    def misplaced(cls, key: str, prefix: str, data: Mapping[str, Any]) -> str | None:
        new = _MOVED.get(key)
        if new is None:
            return None
        section = new.split(".")[0]
        moved = f"`{prefix}{key}` is {_OWNERS[section]}, now `{prefix}{new}`"
        if section in cls.model_fields:
            return f"{moved}; move it there"
        instead = cls.lookalikes.get(key)
        return f"{moved}, but `{prefix}algorithm` is `{data.get('algorithm')}`" + (
            f"; {instead.format(prefix=prefix)}" if instead else ""
        )


class OnlineDPOLearnerConfig(LearnerBase):
    """`algorithm: online_dpo`: DPO on each group's best and worst completion."""

    algorithm: Literal["online_dpo"] = "online_dpo"
    online_dpo: OnlineDPOConfig = OnlineDPOConfig()

    lookalikes: ClassVar[dict[str, str]] = {"clip_eps": "online DPO has no ratio clip"}


class PPOLearnerConfig(LearnerBase):
    """`algorithm: ppo`: clipped surrogate with a value model and GAE."""

    algorithm: Literal["ppo"] = "ppo"
    ppo: PPOConfig = PPOConfig()

    lookalikes: ClassVar[dict[str, str]] = {
        "beta": "PPO's KL weight lives in `{prefix}kl.coef`",
        "clip_eps": "PPO's clip is `{prefix}ppo.clip_eps`",
    }


class PolicyGradientLearnerConfig(LearnerBase):
    """`algorithm: rloo | grpo | dr_grpo | reinforce_pp`: group-baseline advantages, clipped surrogate."""

    algorithm: Literal["rloo", "grpo", "dr_grpo", "reinforce_pp"]
    policy_gradient: PolicyGradientConfig = PolicyGradientConfig()

    lookalikes: ClassVar[dict[str, str]] = {"beta": "its KL weight lives in `{prefix}kl.coef`"}


class BestOfNLearnerConfig(LearnerBase):
    """`algorithm: best_of_n`: fine-tune on each group's best completion."""

    algorithm: Literal["best_of_n"] = "best_of_n"

    lookalikes: ClassVar[dict[str, str]] = {
        "beta": "best-of-n fine-tuning has no KL term",
        "clip_eps": "best-of-n fine-tuning has no ratio clip",
    }


LearnerConfig = Annotated[
    OnlineDPOLearnerConfig | PPOLearnerConfig | PolicyGradientLearnerConfig | BestOfNLearnerConfig,
    Tagged("algorithm", default="online_dpo"),
]
