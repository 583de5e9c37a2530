"""The factory that builds the backend `generator.backend` names."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from asyncrlhf.config import Config
from asyncrlhf.sampling.backend import Backend

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def create_backend(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> Backend:
    """The backend `generator.backend` names, loaded with the run's model (and LoRA wrapping). A vLLM engine
    that `backend: auto` chose but that fails to start falls back to HF, with a warning saying why."""
    if cfg.generator.backend == "vllm":
        from asyncrlhf.sampling.vllm import VLLMBackend

        try:
            return VLLMBackend.from_config(cfg, tokenizer)
        except Exception as err:
            if cfg.generator.auto_reason is None:
                raise
            log.warning("generator.backend=auto chose vLLM, but its engine did not start (%s: %s): "
                        "generating with the HF backend instead", type(err).__name__, err)
    from asyncrlhf.sampling.hf import HFBackend

    return HFBackend.from_config(cfg, tokenizer)
