"""Where and how a run runs: its name and directory, Redis, the prompt task, metrics, and how `asyncrlhf up`
launches the services on one machine."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from asyncrlhf.config.base import Section


class RunConfig(Section):
    name: str = Field("default", description="Run name; Redis keys are `asyncrlhf:<name>:<stream>`.")
    dir: str = Field(
        "runs/{name}", description="Run directory (checkpoints, logs, reports); `{name}` expands."
    )
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    token: str | None = Field(
        None, description="Shared auth token for gRPC metadata and mutating HTTP routes (or ASYNCRLHF_TOKEN)."
    )
    allow_insecure_bind: bool = Field(
        False, description="Let a service bind a non-loopback address without a token (not recommended)."
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Experiment trackers the learner and evaluator log to "
        "(`asyncrlhf.trackers`); none by default.")
    tracker_errors: Literal["fail", "warn"] = Field(
        "fail", description="A tracker that is not installed or cannot start: fail at start, or warn and go "
        "on.")

    @property
    def path(self) -> Path:
        return Path(self.dir.format(name=self.name))


class RedisConfig(Section):
    url: str | None = Field(
        None,
        description="redis:// or rediss:// URL (password allowed). Unset: `asyncrlhf up` starts an embedded "
        "Redis.",
    )
    password: str | None = Field(None, description="Password, if not in the URL.")
    tls_ca_certs: str | None = Field(None, description="CA bundle for rediss:// connections.")
    persist: bool = Field(True, description="Embedded Redis: append-only file in the run directory.")
    claim_idle_ms: int = Field(
        30_000, ge=100, description="Re-claim entries pending longer than this (XAUTOCLAIM)."
    )
    max_deliveries: int = Field(
        3, ge=1, description="An entry failing this many times goes to the dead-letter stream."
    )
    block_ms: int = Field(
        1_000, ge=1, description="How long a consumer blocks on XREADGROUP before re-checking."
    )
    stream_maxlen: int = Field(
        100_000, ge=100, description="Approximate cap on each stream's length (XADD MAXLEN ~)."
    )
    reconnect_max_s: float = Field(30.0, gt=0, description="Longest back-off between reconnection attempts.")


class TaskConfig(Section):
    name: str = Field("demo", description="A shipped task (`demo`), `jsonl`, or `hf` (HF datasets).")
    train_path: str | None = Field(None, description="JSONL with a `prompt` field (task `jsonl`).")
    eval_path: str | None = Field(None, description="JSONL of held-out prompts (task `jsonl`).")
    prompt_field: str = Field(
        "prompt", description="The prompt: a string, or a chat `messages` list of {role, content}."
    )
    dataset: str | None = Field(
        None, description="Task `hf`: a hub name, a `save_to_disk` directory, or a .parquet/.json/.jsonl/"
        ".csv file (a list of files joined by commas).",
    )
    subset: str | None = Field(None, description="Task `hf`: the hub dataset's configuration (e.g. `main`).")
    split: str = Field("train", description="Task `hf`: the training split.")
    eval_split: str | None = Field(None, description="Task `hf`: the held-out split (unset: none).")
    reference_field: str | None = Field(
        None, description="Task `hf`: the reference answer (string or number) that verifiable rewards use."
    )
    reference_pattern: str | None = Field(
        None, description="Regex whose first group is the reference inside `reference_field` (e.g. GSM8k's "
        "`####\\s*(.+)$`); unset: the whole field.",
    )
    revision: str | None = Field(None, description="Task `hf` from the hub: the dataset commit to pin.")
    max_examples: int | None = Field(None, ge=1, description="Use only the first rows of each split.")
    too_long: Literal["truncate", "fail", "skip"] = Field(
        "truncate", description="A prompt longer than model.max_prompt_tokens: keep its last tokens, fail at "
        "start naming its row, or skip it (counted in the log).",
    )
    on_bad_row: Literal["fail", "skip"] = Field(
        "fail", description="A row with a missing or wrong-typed field: fail at start naming it, or skip it "
        "(skipped rows are counted in the log).",
    )


class MetricsConfig(Section):
    enabled: bool = True


class LaunchConfig(Section):
    """How `asyncrlhf up` runs the services on one machine."""

    learner_procs: int = Field(1, ge=1, description="Learner processes (torchrun) on this machine.")
    evaluator: bool = Field(True, description="Run the evaluator service alongside.")
    restart: bool = Field(False, description="Restart a crashed service instead of stopping the run.")
    max_restarts: int = Field(3, ge=0, description="Restarts allowed per service before the run stops.")
    gpus: dict[str, str] = Field(
        default_factory=dict,
        description="CUDA_VISIBLE_DEVICES per service, e.g. {generator: '0', learner: '1,2,3'}.",
    )
    progress_every_s: float = Field(1.0, gt=0, description="Refresh period of the progress display.")
    evaluator_grace_s: float = Field(
        600.0, gt=0, description="After the learner ends, wait this long for the last evaluation."
    )

