"""What scores completions: the scorers (a union on `kind`: `rule`, `model`, `remote`, `judge`), the reward
service that sums them (`reward`), and the evaluator, which scores checkpoints with its own gold scorer
(`evaluator.gold`) and, optionally, a pairwise judge (`evaluator.judge`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from asyncrlhf.config.base import Section, Tagged
from asyncrlhf.config.judge import EvaluatorJudgeConfig, JudgeConfig


class _Scorer(Section):
    kind: str = Field(description="`rule` (Python), `model` (a reward model), `remote` (HTTP) or `judge` (a "
                      "language model that reads the answer).")
    weight: float = Field(1.0, description="Weight in the summed reward.")


class RuleScorerConfig(_Scorer):
    """A Python rule, called on each completion."""

    kind: Literal["rule"] = "rule"
    name: str = Field(min_length=1, description="A shipped rule's name or `path/to/file.py:function`.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the rule.")


class ModelScorerConfig(_Scorer):
    """A reward model (batch size and input length: `reward.*`; device: `reward.device`, the gold model's
    `evaluator.device`)."""

    kind: Literal["model"] = "model"
    path: str = Field(
        min_length=1, description="An HF directory, an `asyncrlhf train-rm` checkpoint, `tiny`, or a hub id "
        "(with `model.allow_hub`, as the policy's)."
    )
    revision: str | None = Field(
        None, description="A hub id's revision: pin a commit hash (a branch or tag resolves at load)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype. auto: bfloat16 on a GPU, float32 on the CPU (a 6.9B reward model "
        "holds 14 GB in bfloat16, 28 GB in float32)."
    )


class RemoteScorerConfig(_Scorer):
    """An OpenRLHF-compatible reward server (timeout and retries: `reward.*`)."""

    kind: Literal["remote"] = "remote"
    url: str = Field(min_length=1, description="Base URL of the server; requests go to `<url>/get_reward`.")
    token: str | None = Field(None, description="Bearer token sent to the server (never printed or saved).")


class JudgeScorerConfig(_Scorer, JudgeConfig):
    """A language model as the judge (docs/judges.md): its reply to a template becomes the score."""

    kind: Literal["judge"] = "judge"


ScorerConfig = Annotated[
    RuleScorerConfig | ModelScorerConfig | RemoteScorerConfig | JudgeScorerConfig, Tagged("kind")
]


def _sentiment() -> list[ScorerConfig]:
    return [RuleScorerConfig(name="sentiment")]


class RewardConfig(Section):
    """The reward service: the scorers it sums, penalties, and its replicas."""

    replicas: int = Field(1, ge=1, description="Reward processes `asyncrlhf up` starts.")
    scorers: list[ScorerConfig] = Field(
        default_factory=_sentiment,
        description="Summed with their weights.",
    )
    missing_eos_penalty: float | None = Field(
        -1.0, description="Score for completions without EOS (None: off)."
    )
    max_completion_tokens: int | None = Field(
        None, description="Longer completions get the missing-EOS score."
    )
    batch_size: int = Field(16, ge=1, description="Reward model: completions scored per forward pass.")
    max_length: int = Field(512, ge=8, description="Reward model input length; longer inputs are truncated.")
    device: str = Field("auto", description="Reward model device: `auto`, `cpu`, `cuda`, `cuda:1`.")
    retries: int = Field(2, ge=0, description="Retries of a failing scorer call before dead-lettering.")
    timeout_s: float = Field(30.0, gt=0, description="Remote scorer timeout.")
    http_host: str = Field("127.0.0.1", description="Bind address of the HTTP server (/score, /get_reward).")
    http_port: int = Field(0, ge=0, description="HTTP port (0: pick a free one).")
    max_request_items: int = Field(1024, ge=1, description="HTTP scoring: most items in one request.")


class EvaluatorConfig(Section):
    """The evaluator: scores each checkpoint's greedy completions on held-out prompts with the gold reward."""

    every_n: int = Field(1, ge=1, description="Evaluate every n-th checkpoint event.")
    num_prompts: int = Field(100, ge=1, description="Held-out prompts to evaluate on.")
    max_new_tokens: int = Field(64, ge=1, description="Most tokens generated per held-out prompt.")
    temperature: float = Field(0.0, ge=0, description="0: greedy decoding.")
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="Generation backend of the offline `asyncrlhf generate`.")
    device: str = Field("auto", description="`auto`, `cpu`, `cuda`, `cuda:1`.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: leave torch's default).")
    http_host: str = Field("127.0.0.1", description="Bind address of the HTTP server (health, metrics).")
    http_port: int = Field(0, ge=0, description="HTTP port (0: pick a free one).")
    gold: ScorerConfig = Field(
        default_factory=lambda: RuleScorerConfig(name="sentiment"),
        description="The gold reward evaluations score with (not `reward.scorers`, which may be a proxy RM).",
    )
    missing_eos_penalty: float | None = Field(
        -1.0,
        description="Gold score of a completion that did not end with EOS within max_new_tokens (None: off).",
    )
    references_path: str | None = Field(
        None,
        description="JSONL of {prompt, completion} reference answers for the win rate; unset: the initial "
        "policy's greedy completions, cached in `<run.dir>/eval/references.jsonl`.",
    )
    batch_size: int = Field(16, ge=1, description="Prompts generated and scored per forward pass.")
    judge: EvaluatorJudgeConfig | None = Field(
        None, description="A pairwise judge of each checkpoint's answers against the references (both "
        "orders, ties half, a bootstrap interval), reported beside the gold reward; None: off.")

