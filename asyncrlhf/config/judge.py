"""A language model as the judge (`reward.scorers[].kind: judge`, `evaluator.judge`): which model answers
(an engine in this process, or an OpenAI-compatible endpoint), what it reads (a template), and how its
reply becomes a number (a value parsed from the text, or the probability of a chosen token)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncrlhf.config.base import Section
from asyncrlhf.config.model import ModelConfig

# What each comparison asks for when the config names no choices or labels.
DEFAULT_CHOICES = {"single": ["Yes", "No"], "pairwise": ["A", "B"]}
DEFAULT_LABELS = {"single": {"yes": 1.0, "no": 0.0}, "pairwise": {"a": 1.0, "b": 0.0, "tie": 0.5}}


class JudgeEngineConfig(Section):
    """The judge's engine when it runs in this process (no `endpoint.url`): vLLM, or transformers."""

    backend: Literal["vllm", "hf"] = Field(
        "vllm", description="`vllm` (a GPU, or vLLM's CPU build) or `hf` (transformers).")
    fallback_to_hf: bool = Field(
        True, description="`backend: vllm` where vLLM is not installed or its engine does not start: judge "
        "with transformers instead (logged as a warning saying why); false: fail.")
    device: str = Field("auto", description="`auto`, `cpu`, `cuda`, `cuda:1`: where the judge's engine runs.")
    threads: int = Field(0, ge=0, description="CPU threads of the engine (0: every core).")
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1.0, description="vLLM on a GPU: its share of the GPU's memory (the judge usually "
        "shares a GPU with the generator: docs/judges.md).")
    kv_cache_gib: int = Field(1, ge=1, description="vLLM on CPU: KV cache size in GiB.")
    max_model_len: int | None = Field(
        2048, ge=16, description="vLLM: longest judge prompt + reply (None: the model's).")


class JudgeEndpointConfig(Section):
    """An OpenAI-compatible server that answers for the judge: `vllm serve`, an asyncrlhf generator's `/v1`,
    or a hosted API."""

    url: str | None = Field(
        None, description="Base URL with its `/v1` (`http://judge:8000/v1`); set: the judge is this server.")
    model: str = Field("judge", description="The `model` each request names.")
    api_key_env: str | None = Field(
        None, description="Name of the environment variable holding the API key (the key itself is never "
        "written in a config).")
    api: Literal["chat", "completions"] = Field(
        "chat", description="`chat`: /v1/chat/completions with the template as the user message; "
        "`completions`: /v1/completions with the rendered template as the prompt.")
    top_logprobs: int = Field(
        20, ge=1, le=20, description="`reply: logprob`: alternatives asked for at the reply's first token.")


class JudgeConfig(Section):
    """A judge: its model, the template it reads, and how its reply becomes a value."""

    model: ModelConfig = Field(
        default_factory=ModelConfig, description="The judge's model when it runs in this process (as the "
        "policy's `model`; a judge prompt longer than `model.max_prompt_tokens` keeps its end and is counted "
        "as truncated).")
    engine: JudgeEngineConfig = JudgeEngineConfig()
    endpoint: JudgeEndpointConfig = JudgeEndpointConfig()
    compare: Literal["single", "pairwise"] = Field(
        "single", description="`single`: the judge reads one answer (`{{ completion }}`); `pairwise`: two "
        "answers to the same prompt (`{{ completion_a }}`, `{{ completion_b }}`), each pair in both orders.")
    template: str | None = Field(
        None, description="The judge's prompt, inline. It sees `prompt`, `completion` (pairwise: "
        "`completion_a`, `completion_b`) and `reference`. None (and no template_path): the shipped one for "
        "`compare`.")
    template_path: str | None = Field(None, description="The judge's prompt, from a file.")
    template_format: Literal["jinja", "format"] = Field(
        "jinja", description="`jinja` (sandboxed, `{{ prompt }}`) or `format` (Python str.format, "
        "`{prompt}`).")
    system: str | None = Field(None, description="A system message sent before the template.")
    reply: Literal["logprob", "number", "label"] = Field(
        "logprob", description="How the reply becomes a value: `logprob`: the probability of the first of "
        "`choices` among them at the reply's first token; `number`: a number in the text; `label`: a word in "
        "the text, mapped by `labels`.")
    choices: list[str] | None = Field(
        None, description="`reply: logprob`: the tokens compared, the first one's share is the value. None: "
        "[Yes, No] (single), [A, B] (pairwise).")
    pattern: str | None = Field(
        None, description="`number`/`label`: a regex whose first group is the value (None: the first number, "
        "or the first word).")
    json_field: str | None = Field(
        None, description="`number`/`label`: read this field of the first JSON object in the reply instead.")
    labels: dict[str, float] | None = Field(
        None, description="`reply: label`: label (any case) -> value. None: yes 1, no 0 (single); a 1, b 0, "
        "tie 0.5 (pairwise).")
    parse_fail_reward: float = Field(
        0.0, description="The value of a reply that does not parse (counted in the metrics).")
    max_new_tokens: int = Field(16, ge=1, description="`number`/`label`: most tokens of the judge's reply.")
    max_in_flight: int = Field(8, ge=1, description="Endpoint: requests in flight at once.")
    timeout_s: float = Field(30.0, gt=0, description="Endpoint: timeout of one request.")
    retries: int = Field(2, ge=0, description="Endpoint: retries of a request that timed out or failed.")
    cache_size: int = Field(
        10_000, ge=0, description="Replies kept, keyed by the hash of the rendered request (template, "
        "prompt, completion, reference); 0: no cache.")
    batch_size: int = Field(32, ge=1, description="Engine in this process: judge prompts per engine call.")

    @field_validator("choices", "labels", mode="before")
    @classmethod
    def _yes_is_not_true(cls, value):
        """YAML reads a bare Yes / No as a boolean: as a choice or a label it means the word (matched in any
        case)."""
        def word(v):
            return {True: "yes", False: "no"}[v] if isinstance(v, bool) else v

        if isinstance(value, list):
            return [word(v) for v in value]
        if isinstance(value, dict):
            return {word(k): v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _consistent(self) -> JudgeConfig:
        if self.template is not None and self.template_path is not None:
            raise ValueError("give the judge's template inline (`template`) or as a file (`template_path`), "
                             "not both")
        if self.reply == "logprob" and len(self.choices_or_default) < 2:
            raise ValueError(f"`reply: logprob` compares at least two choices; got {self.choices}")
        if self.pattern is not None and self.json_field is not None:
            raise ValueError("read the judge's reply with `pattern` or with `json_field`, not both")
        return self

    @property
    def choices_or_default(self) -> list[str]:
        return self.choices if self.choices is not None else DEFAULT_CHOICES[self.compare]

    @property
    def labels_or_default(self) -> dict[str, float]:
        labels = self.labels if self.labels is not None else DEFAULT_LABELS[self.compare]
        return {k.casefold(): v for k, v in labels.items()}

    @property
    def remote(self) -> bool:
        return self.endpoint.url is not None


class EvaluatorJudgeConfig(JudgeConfig):
    """`evaluator.judge`: a pairwise judge of each checkpoint's answers against the reference answers."""

    compare: Literal["single", "pairwise"] = Field(
        "pairwise", description="Must be `pairwise`: the evaluator compares two answers.")
    bootstrap_samples: int = Field(
        1000, ge=100, description="Resamples of the held-out prompts for the win rate's interval.")
    confidence: float = Field(0.95, gt=0, lt=1, description="Coverage of the bootstrap interval.")

    @model_validator(mode="after")
    def _pairwise(self) -> EvaluatorJudgeConfig:
        if self.compare != "pairwise":
            raise ValueError("evaluator.judge compares each answer with its reference: set "
                             "`evaluator.judge.compare: pairwise`")
        return self
