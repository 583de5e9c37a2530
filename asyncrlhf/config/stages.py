"""The offline stages (`asyncrlhf sft`, `relabel`, `train-rm`): their data, budgets and outputs."""

from __future__ import annotations

from pydantic import Field

from asyncrlhf.config.base import Section
from asyncrlhf.config.learner import LoraConfig


class SFTConfig(Section):
    """`asyncrlhf sft`: supervised fine-tuning, loss on completion tokens only."""

    base: str | None = Field(
        None, description="Model to fine-tune (as `model.name_or_path`); unset: `model.name_or_path`."
    )
    data: str | None = Field(
        None,
        description="JSONL of {prompt, completion} rows or a `datasets` directory; unset: best-of-n samples "
        "of the base model on the task's train prompts, picked by `evaluator.gold`.",
    )
    prompt_field: str = Field("prompt", description="The prompt field of `data`.")
    completion_field: str = Field("completion", description="The completion field of `data`.")
    best_of_n: int = Field(4, ge=1, description="Samples per prompt when building data by best-of-n.")
    num_prompts: int = Field(64, ge=0, description="Train prompts to sample for best-of-n (0: all).")
    epochs: int = Field(1, ge=1, description="Passes over the data.")
    lr: float = Field(1e-5, gt=0, description="Learning rate (AdamW).")
    batch_size: int = Field(8, ge=1, description="Examples per optimizer step.")
    micro_batch_size: int = Field(4, ge=1, description="Examples per forward pass.")
    max_length: int = Field(256, ge=8, description="Prompt + completion tokens; longer completions are cut.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Train LoRA adapters (merged on save).")
    output: str = Field("{run_dir}/sft", description="HF directory written (`{run_dir}`: the run directory).")


class RelabelConfig(Section):
    """`asyncrlhf relabel`: order preference pairs by the gold reward (`evaluator.gold`)."""

    input: str | None = Field(
        None,
        description="JSONL of {prompt, chosen, rejected} pairs; unset: two samples of `model.name_or_path` "
        "per train prompt (generator.sampling).",
    )
    num_prompts: int = Field(64, ge=0, description="Train prompts to sample pairs for (0: all).")
    output: str = Field("{run_dir}/preferences.jsonl", description="Pairs written, chosen/rejected by gold.")


class RewardModelTrainingConfig(Section):
    """`asyncrlhf train-rm`: Bradley-Terry reward model on preference pairs."""

    base: str | None = Field(
        None, description="Model the RM starts from (a 1-output head is added); unset: `model.name_or_path`."
    )
    data: str | None = Field(
        None, description="JSONL of {prompt, chosen, rejected}; unset: `relabel.output`."
    )
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="Pairs held out to measure accuracy.")
    epochs: int = Field(1, ge=1, description="Passes over the pairs.")
    lr: float = Field(1e-5, gt=0, description="Learning rate (AdamW).")
    batch_size: int = Field(8, ge=1, description="Pairs per optimizer step.")
    micro_batch_size: int = Field(4, ge=1, description="Pairs per forward pass.")
    max_length: int = Field(256, ge=8, description="Tokens of prompt + completion (the last ones are kept).")
    output: str = Field(
        "{run_dir}/rm",
        description="Checkpoint directory; use it as a reward scorer `{kind: model, path: ...}`.",
    )

