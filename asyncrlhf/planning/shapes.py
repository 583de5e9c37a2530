"""A model's shape for the plan (`memory.Shape`), read from its config.json wherever the run finds the model:
a hub id's config.json alone (from the HF cache, or the hub), a local directory, the packaged GGUF (converted
once), or the `tiny` preset. The model is built on PyTorch's meta device, so its parameters, and the LoRA
adapters a run would add, are counted exactly without allocating them."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from asyncrlhf.config import LoraConfig, ModelConfig
from asyncrlhf.model_sources import config_dir
from asyncrlhf.models import tiny_llama_config
from asyncrlhf.planning.memory import Shape

Head = Literal["causal", "score"]


def hf_config(model: ModelConfig):
    """The model's transformers config (its config.json)."""
    from transformers import AutoConfig

    directory = config_dir(model)
    return tiny_llama_config(model) if directory is None else AutoConfig.from_pretrained(directory)


_SHAPES: dict[tuple, Shape] = {}


def model_shape(model: ModelConfig, head: Head, lora: LoraConfig | None = None) -> Shape:
    """`model`'s shape with a causal-LM head (a policy) or a 1-output score head (a reward or value model);
    `lora`: count the adapters it would train. Built once per model, head and LoRA setting (a large model
    takes seconds even on the meta device, and a plan names its policy several times)."""
    where = (model.name_or_path, model.revision, model.gguf_file, model.tiny.model_dump_json())
    key = (*where, head, lora.model_dump_json() if lora else "")
    if key not in _SHAPES:
        _SHAPES[key] = _build_shape(model, head, lora)
    return _SHAPES[key]


def _build_shape(model: ModelConfig, head: Head, lora: LoraConfig | None) -> Shape:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = hf_config(model)
    if head == "score":
        config.num_labels = 1
    factory = AutoModelForCausalLM if head == "causal" else AutoModelForSequenceClassification
    with torch.device("meta"):
        built = factory.from_config(config)
    heads = config.num_attention_heads
    return Shape(
        params=sum(p.numel() for p in built.parameters()),
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size if head == "causal" else 1,
        max_positions=getattr(config, "max_position_embeddings", None) or 2048,
        adapter_params=adapter_params(built, lora) if lora is not None and lora.enabled else 0,
    )


def adapter_params(model: nn.Module, lora: LoraConfig) -> int:
    """Parameters of rank-r adapters on every linear layer named in `lora.target_modules`: r x (in + out)."""
    targets = set(lora.target_modules)
    return sum(lora.r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)
