"""One typed config tree for every service.

Load order: defaults <- YAML file(s) <- CLI overrides. Overrides are accepted in both spellings the seed
code's users type: `--learner.lr 1e-6` and `learner.lr=1e-6`. Values are parsed as YAML scalars, so
`1e-6`, `true`, `[q_proj, v_proj]` and `null` mean what they look like.

Unknown keys and wrong types fail with the full dotted path and, for a typo, a "did you mean" suggestion.
The resolved config and its hash are what every service logs at start and what every checkpoint saves.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal, Sequence
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot be used; the message says which key and what to do."""


class Section(BaseModel):
    """Base of every section: unknown keys fail, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field("default", description="Run name; Redis keys are `asyncrlhf:<name>:<stream>`.")
    dir: str = Field("runs/{name}", description="Run directory (checkpoints, logs, reports); `{name}` expands.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    token: str | None = Field(
        None, description="Shared auth token for gRPC metadata and mutating HTTP routes (or ASYNCRLHF_TOKEN)."
    )
    allow_insecure_bind: bool = Field(
        False, description="Let a service bind a non-loopback address without a token (not recommended)."
    )

    @property
    def path(self) -> Path:
        return Path(self.dir.format(name=self.name))


class RedisConfig(Section):
    url: str | None = Field(
        None, description="redis:// or rediss:// URL (password allowed). Unset: `asyncrlhf up` starts an embedded Redis."
    )
    password: str | None = Field(None, description="Password, if not in the URL.")
    tls_ca_certs: str | None = Field(None, description="CA bundle for rediss:// connections.")
    persist: bool = Field(True, description="Embedded Redis: append-only file in the run directory.")
    claim_idle_ms: int = Field(30_000, ge=100, description="Re-claim entries pending longer than this (XAUTOCLAIM).")
    max_deliveries: int = Field(3, ge=1, description="An entry failing this many times goes to the dead-letter stream.")
    block_ms: int = Field(1_000, ge=1, description="How long a consumer blocks on XREADGROUP before re-checking.")
    stream_maxlen: int = Field(100_000, ge=100, description="Approximate cap on each stream's length (XADD MAXLEN ~).")
    reconnect_max_s: float = Field(30.0, gt=0, description="Longest back-off between reconnection attempts.")


class TinyModelConfig(Section):
    """The `tiny` preset: a random Llama-style model and an offline tokenizer, built in code for tests."""

    layers: int = Field(2, ge=1)
    hidden: int = Field(64, ge=8)
    heads: int = Field(4, ge=1)
    intermediate: int = Field(128, ge=8)
    max_positions: int = Field(512, ge=16)


class ModelConfig(Section):
    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="`tiny`, `smollm2-135m-instruct` (packaged GGUF), a local HF directory, or a .gguf file.",
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside `name_or_path` when it is a directory.")
    cache_dir: str = Field(
        "~/.cache/asyncrlhf", description="Where GGUF files are converted once to safetensors."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype when loaded.")
    apply_chat_template: bool = Field(True, description="Wrap prompts in the tokenizer's chat template, if any.")
    system_prompt: str | None = Field(None, description="System message for the chat template.")
    max_prompt_tokens: int = Field(256, ge=1, description="Prompts are left-truncated to this many tokens.")
    tiny: TinyModelConfig = TinyModelConfig()
    allow_hub: bool = Field(False, description="Allow a hub model name (needs network); off: fail clearly.")


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; behaviour log-probs use it too.")
    top_p: float = Field(1.0, gt=0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_new_tokens: int = Field(64, ge=1)


class GeneratorConfig(Section):
    backend: Literal["hf", "vllm"] = Field("hf", description="`hf` (transformers, CPU or GPU) or `vllm` (GPU).")
    replicas: int = Field(1, ge=1, description="Generator processes `asyncrlhf up` starts.")
    samples_per_prompt: int = Field(4, ge=1, description="k: completions sampled per prompt group.")
    batch_prompts: int = Field(8, ge=1, description="Prompt groups sampled together in one backend call.")
    sampling: SamplingConfig = SamplingConfig()
    device: str = Field("auto", description="`auto`, `cpu`, `cuda`, `cuda:1`.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: leave torch's default).")
    grpc_host: str = Field("127.0.0.1", description="WeightSync bind address.")
    grpc_port: int = Field(0, ge=0, description="WeightSync port (0: pick a free one).")
    advertise_host: str | None = Field(None, description="Address the learner dials (defaults to grpc_host).")
    http_host: str = Field("127.0.0.1")
    http_port: int = Field(0, ge=0, description="Health, metrics and /v1/completions (0: pick a free one).")
    heartbeat_s: float = Field(2.0, gt=0, description="Registry heartbeat period.")
    registry_ttl_s: float = Field(10.0, gt=0, description="A generator silent this long leaves the registry.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1.0, description="vLLM: fraction of GPU memory.")
    vllm_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: int | None = Field(None, description="vLLM max sequence length (None: model's).")


class ScorerConfig(Section):
    kind: Literal["model", "rule", "remote"] = Field(description="Reward model, Python rule, or remote HTTP.")
    name: str | None = Field(None, description="rule: a registry name or `path/to/file.py:function`.")
    path: str | None = Field(None, description="model: an HF directory or a `asyncrlhf train-rm` checkpoint.")
    url: str | None = Field(None, description="remote: base URL of an OpenRLHF-compatible `/get_reward` server.")
    weight: float = Field(1.0, description="Weight in the summed reward.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the rule.")


class RewardConfig(Section):
    replicas: int = Field(1, ge=1)
    scorers: list[ScorerConfig] = Field(
        default_factory=lambda: [ScorerConfig(kind="rule", name="sentiment")],
        description="Summed with their weights.",
    )
    missing_eos_penalty: float | None = Field(-1.0, description="Score for completions without EOS (None: off).")
    max_completion_tokens: int | None = Field(None, description="Longer completions get the missing-EOS score.")
    batch_size: int = Field(16, ge=1)
    max_length: int = Field(512, ge=8, description="Reward model input length; longer inputs are truncated.")
    device: str = "auto"
    retries: int = Field(2, ge=0, description="Retries of a failing scorer call before dead-lettering.")
    timeout_s: float = Field(30.0, gt=0, description="Remote scorer timeout.")
    http_host: str = "127.0.0.1"
    http_port: int = Field(0, ge=0)
    max_request_items: int = Field(1024, ge=1, description="HTTP scoring: most items in one request.")


class KLConfig(Section):
    kind: Literal["kl", "clamped_kl", "bregman", "jensen_shannon", "squared_error"] = "kl"
    coef: float = Field(0.05, ge=0, description="KL coefficient (initial value when adaptive).")
    placement: Literal["reward", "loss"] = Field("reward", description="Shape the reward, or add a loss term.")
    adaptive: bool = Field(False, description="Adaptive coefficient (Ziegler et al. 2019).")
    target: float = Field(6.0, gt=0, description="Adaptive controller's target KL.")
    horizon: int = Field(10_000, ge=1, description="Adaptive controller's horizon.")


class LoraConfig(Section):
    enabled: bool = False
    r: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class DeepSpeedConfig(Section):
    zero_stage: Literal[0, 1, 2, 3] = 0
    bf16: bool = False
    config_file: str | None = Field(None, description="Your own DeepSpeed JSON; replaces the generated one.")
    offload_optimizer: bool = False


class PPOConfig(Section):
    clip_eps: float = Field(0.2, gt=0)
    value_clip_eps: float = Field(0.2, gt=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    epochs: int = Field(1, ge=1, description="Passes over each batch.")
    minibatches: int = Field(1, ge=1, description="Mini-batches per pass.")
    vf_coef: float = Field(0.1, ge=0)
    value_init: Literal["reward_model", "policy"] = "policy"
    whiten_advantages: bool = True


class LearnerConfig(Section):
    algorithm: Literal["online_dpo", "ppo", "rloo", "grpo", "dr_grpo", "reinforce_pp", "best_of_n"] = "online_dpo"
    lr: float = Field(1e-6, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    total_steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    groups_per_step: int = Field(8, ge=1, description="Prompt groups consumed per optimizer step.")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward pass.")
    max_staleness: int = Field(1, ge=0, description="Groups may be generated by weights this many versions old.")
    stale_policy: Literal["drop", "tis", "decoupled", "keep"] = Field(
        "drop", description="For a group older than max_staleness: drop, IS-correct, or keep it."
    )
    tis_cap: float = Field(2.0, gt=0, description="Truncated importance weights are clamped at this value.")
    beta: float = Field(0.1, gt=0, description="DPO beta.")
    dpo_loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    clip_eps: float = Field(0.2, gt=0, description="Policy-ratio clip for GRPO / REINFORCE++.")
    ppo: PPOConfig = PPOConfig()
    kl: KLConfig = KLConfig()
    lora: LoraConfig = LoraConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    sync_every: int = Field(1, ge=1, description="Push weights to generators every this many steps.")
    push_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    push_chunk_bytes: int = Field(4 << 20, ge=1024)
    push_timeout_s: float = Field(60.0, gt=0)
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    data_epochs: int = Field(1000, ge=1, description="Passes over the prompt set before stopping.")
    device: str = "auto"
    threads: int = Field(0, ge=0)
    http_host: str = "127.0.0.1"
    http_port: int = Field(0, ge=0)


class EvaluatorConfig(Section):
    every_n: int = Field(1, ge=1, description="Evaluate every n-th checkpoint event.")
    num_prompts: int = Field(100, ge=1, description="Held-out prompts to evaluate on.")
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0, description="0: greedy decoding.")
    backend: Literal["hf", "vllm"] = "hf"
    device: str = "auto"
    threads: int = Field(0, ge=0)
    http_host: str = "127.0.0.1"
    http_port: int = Field(0, ge=0)
    gold: ScorerConfig = Field(
        default_factory=lambda: ScorerConfig(kind="rule", name="sentiment"),
        description="The gold reward evaluations score with (not `reward.scorers`, which may be a proxy RM).",
    )
    missing_eos_penalty: float | None = Field(
        -1.0, description="Gold score of a completion that did not end with EOS within max_new_tokens (None: off)."
    )
    references_path: str | None = Field(
        None,
        description="JSONL of {prompt, completion} reference answers for the win rate; unset: the initial "
        "policy's greedy completions, cached in `<run.dir>/eval/references.jsonl`.",
    )
    batch_size: int = Field(16, ge=1, description="Prompts generated and scored per forward pass.")


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
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    best_of_n: int = Field(4, ge=1, description="Samples per prompt when building data by best-of-n.")
    num_prompts: int = Field(64, ge=0, description="Train prompts to sample for best-of-n (0: all).")
    epochs: int = Field(1, ge=1)
    lr: float = Field(1e-5, gt=0)
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
    epochs: int = Field(1, ge=1)
    lr: float = Field(1e-5, gt=0)
    batch_size: int = Field(8, ge=1, description="Pairs per optimizer step.")
    micro_batch_size: int = Field(4, ge=1, description="Pairs per forward pass.")
    max_length: int = Field(256, ge=8, description="Tokens of prompt + completion (the last ones are kept).")
    output: str = Field(
        "{run_dir}/rm",
        description="Checkpoint directory; use it as a reward scorer `{kind: model, path: ...}`.",
    )


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
    evaluator_grace_s: float = Field(600.0, gt=0, description="After the learner ends, wait this long for the last evaluation.")


class MetricsConfig(Section):
    enabled: bool = True


class TaskConfig(Section):
    name: str = Field("demo", description="A shipped task (`demo`) or `jsonl`.")
    train_path: str | None = Field(None, description="JSONL with a `prompt` field (task `jsonl`).")
    eval_path: str | None = Field(None, description="JSONL of held-out prompts (task `jsonl`).")
    prompt_field: str = "prompt"


class Config(Section):
    """The whole run."""

    run: RunConfig = RunConfig()
    redis: RedisConfig = RedisConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    generator: GeneratorConfig = GeneratorConfig()
    reward: RewardConfig = RewardConfig()
    learner: LearnerConfig = LearnerConfig()
    evaluator: EvaluatorConfig = EvaluatorConfig()
    sft: SFTConfig = SFTConfig()
    relabel: RelabelConfig = RelabelConfig()
    rm: RewardModelTrainingConfig = RewardModelTrainingConfig()
    metrics: MetricsConfig = MetricsConfig()
    launch: LaunchConfig = LaunchConfig()

    @model_validator(mode="after")
    def _token_from_env(self) -> "Config":
        if self.run.token is None and os.environ.get("ASYNCRLHF_TOKEN"):
            self.run = self.run.model_copy(update={"token": os.environ["ASYNCRLHF_TOKEN"]})
        return self

    def to_yaml(self) -> str:
        """The resolved config as YAML without its secrets (run.token, redis.password, a password in
        redis.url), so it is safe to print and to write into run directories and checkpoints."""
        data = self.model_dump(mode="json")
        data["run"]["token"] = None
        data["redis"]["password"] = None
        if data["redis"]["url"]:
            data["redis"]["url"] = _without_password(data["redis"]["url"])
        return yaml.safe_dump(data, sort_keys=False)

    def hash(self) -> str:
        """Short, stable hash of the resolved config (the token excluded, so it is safe to log)."""
        data = self.model_dump(mode="json")
        data["run"].pop("token", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]

    def key(self, stream: str) -> str:
        """Redis key of a stream or record of this run."""
        return f"asyncrlhf:{self.run.name}:{stream}"


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}***@{parts.hostname}{port}"))


# ---------------------------------------------------------------------------------------------------------
# Loading


def load_config(files: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> Config:
    """Resolve defaults <- each YAML file in order <- overrides (`a.b=v` or `--a.b v`)."""
    data: dict[str, Any] = {}
    for file in files:
        _deep_merge(data, _read_yaml(Path(file)))
    for dotted, value in parse_overrides(overrides):
        _set_dotted(data, dotted, value)
    _check_keys(data, Config, prefix="")
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    """`["learner.lr=1e-6", "--run.name", "x", "--learner.lora.enabled=true"]` -> [(path, value), ...]."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        key = arg[2:] if arg.startswith("--") else arg
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        elif arg.startswith("--") and i + 1 < len(args):
            raw = args[i + 1]
            i += 2
        else:
            raise ConfigError(f"override `{arg}` has no value; write `{key}=VALUE` or `--{key} VALUE`")
        if not key or key.startswith(".") or key.endswith("."):
            raise ConfigError(f"override `{arg}`: expected a dotted key such as `learner.lr`")
        pairs.append((key, _parse_scalar(raw)))
    return pairs


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _parse_scalar(raw: str) -> Any:
    if _FLOAT.match(raw) and not raw.lstrip("+-").isdigit():
        return float(raw)  # YAML 1.1 reads `1e-6` as a string; users mean a number
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(loaded).__name__}")
    return loaded


def _deep_merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override `{dotted}`: `{part}` is a value, not a section")
        node = child
    node[parts[-1]] = value


def _section_fields(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """Field name -> the nested Section type (or None for a leaf)."""
    out: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        out[name] = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return out


def _check_keys(data: dict[str, Any], model: type[BaseModel], prefix: str) -> None:
    """Unknown keys fail with the full dotted path and the closest known key."""
    fields = _section_fields(model)
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            guess = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean `{prefix}{guess[0]}`?" if guess else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"unknown key `{path}`{hint}")
        nested = fields[key]
        if nested is not None and isinstance(value, dict):
            _check_keys(value, nested, prefix=f"{path}.")


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        lines.append(f"`{path}`: {e['msg']} (got {e.get('input')!r})")
    return "invalid config: " + "; ".join(lines)
