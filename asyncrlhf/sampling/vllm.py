"""The vLLM backend: a `vllm.LLM` engine on a GPU, with pushed weights loaded into the running engine.

vLLM is imported only when this backend is built (`pip install 'asyncrlhf[vllm]'`: Linux, CUDA).

- Sampling: `SamplingParams(n=k, logprobs=0)` returns each sampled token's log-prob; the engine is started
  with `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) so these are taken after temperature, as the
  learner needs. vLLM folds top-k / top-p truncation in as well (renormalised over the kept tokens); with
  top_k=0 and top_p=1, the defaults, the HF backend returns the same quantity.
- Full-weight pushes: `collective_rpc` calls `WeightLoaderExtension.asyncrlhf_load_weights` on every worker
  (the class is mixed into vLLM's worker through `worker_extension_cls`), which hands the HF-named tensors
  to the model's own `load_weights` (it maps HF names onto vLLM's fused layers); then the prefix cache is
  reset, since cached KV blocks were computed by the old weights.
- LoRA pushes (`learner.lora.enabled`): the adapter tensors are written as a PEFT adapter directory and
  served as a new `LoRARequest` per version (vLLM hot-loads it; the previous one is removed).
The gate guarantees no `generate` call is running while either happens.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrlhf.config import Config, LoraConfig, ModelConfig, SamplingConfig
from asyncrlhf.model_sources import resolve_model_dir
from asyncrlhf.models import load_policy, wrap_lora
from asyncrlhf.sampling import Completion
from asyncrlhf.weights.codec import adapter_tensors

log = logging.getLogger(__name__)

VLLM_MISSING = ("generator.backend=vllm needs vLLM, which is not installed: pip install 'asyncrlhf[vllm]' "
                "(Linux with a CUDA GPU), or use generator.backend=hf")
EXTENSION = f"{__name__}.WeightLoaderExtension"
RPC_BATCH_BYTES = 1 << 30  # tensors per collective_rpc call, so one message never holds a whole large model


def import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError(VLLM_MISSING) from err
    return vllm


class WeightLoaderExtension:
    """Mixed into vLLM's GPU worker class by `worker_extension_cls`: methods callable by `collective_rpc`."""

    def asyncrlhf_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        model.load_weights(weights=[(name, tensor.to(device)) for name, tensor in named])
        torch.cuda.synchronize(device)
        return len(named)


def model_dir_for_vllm(cfg: ModelConfig) -> Path:
    """A directory vLLM can load: the model's own, or for `tiny` a copy written once to the cache."""
    directory = resolve_model_dir(cfg)
    if directory is not None:
        return directory
    from asyncrlhf.models import load_tokenizer

    tiny = cfg.tiny.model_dump()
    name = "tiny-" + "-".join(f"{key}{value}" for key, value in sorted(tiny.items()))
    target = Path(cfg.cache_dir).expanduser() / name
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        load_policy(cfg).save_pretrained(staging, safe_serialization=True)
        load_tokenizer(cfg).save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
    return target


def weight_skeleton(model_dir: Path, dtype: torch.dtype, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """Name -> meta tensor of what a push may update, named as in the learner's HF (or PEFT) model: the
    receiver checks pushes against these shapes without a CPU copy of the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
        if lora.enabled:
            return adapter_tensors(wrap_lora(model, lora).state_dict())
    return dict(model.state_dict())


def peft_adapter_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT state-dict names (`...lora_A.default.weight`) -> saved-adapter names (`...lora_A.weight`)."""
    return {name.replace(".default.", "."): tensor.contiguous() for name, tensor in tensors.items()}


def _batches(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


class VLLMBackend:
    def __init__(self, llm: Any, skeleton: dict[str, torch.Tensor], lora: LoraConfig, adapter_root: Path):
        self.llm, self.skeleton, self.lora, self.adapter_root = llm, skeleton, lora, adapter_root
        self._version = 0
        self._lora_request: Any = None

    @classmethod
    def from_config(cls, cfg: Config, tokenizer=None) -> VLLMBackend:
        vllm = import_vllm()
        g, lora = cfg.generator, cfg.learner.lora
        model_dir = model_dir_for_vllm(cfg.model)
        kwargs: dict[str, Any] = dict(
            model=str(model_dir), tokenizer=str(model_dir), dtype=g.vllm_dtype, seed=cfg.run.seed,
            gpu_memory_utilization=g.gpu_memory_utilization, max_model_len=g.max_model_len,
            tensor_parallel_size=g.tensor_parallel_size,
            worker_extension_cls=EXTENSION, logprobs_mode="processed_logprobs",
        )
        if lora.enabled:
            kwargs.update(enable_lora=True, max_lora_rank=lora.r, max_loras=1)
        try:
            llm = vllm.LLM(**kwargs)
        except TypeError as err:
            if "logprobs_mode" in str(err) or "worker_extension_cls" in str(err):
                raise ImportError(f"vLLM {vllm.__version__} is too old for this backend (it needs "
                                  "logprobs_mode and worker_extension_cls): "
                                  "pip install 'vllm>=0.10.2'") from err
            raise
        dtype = getattr(torch, cfg.model.dtype if g.vllm_dtype == "auto" else g.vllm_dtype)
        adapter_root = Path(tempfile.mkdtemp(prefix="asyncrlhf-lora-"))
        return cls(llm, weight_skeleton(model_dir, dtype, lora), lora, adapter_root)

    @property
    def version(self) -> int:
        return self._version

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self.skeleton

    def apply_weights(
        self, tensors: Mapping[str, torch.Tensor], version: int, *, adopt: bool = False
    ) -> None:
        """Load into the engine (a copy to the GPU either way, so `adopt` changes nothing)."""
        if self.lora.enabled:
            self._load_adapter(tensors, version)
        else:
            for batch in _batches(tensors, RPC_BATCH_BYTES):
                self.llm.collective_rpc("asyncrlhf_load_weights", args=(batch,))
            self.llm.reset_prefix_cache()
        self._version = version

    def generate(self, prompts: Sequence[Sequence[int]], k: int,
                 sampling: SamplingConfig) -> list[list[Completion]]:
        from vllm import SamplingParams

        params = SamplingParams(n=k, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k or -1, max_tokens=sampling.max_new_tokens, logprobs=0)
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, params, lora_request=self._lora_request, use_tqdm=False)
        return [[self._completion(o) for o in request.outputs] for request in outputs]

    @staticmethod
    def _completion(output: Any) -> Completion:
        ids = list(output.token_ids)
        logps = [step[token].logprob for step, token in zip(output.logprobs, ids, strict=True)]
        return Completion(ids, logps, "stop" if output.finish_reason == "stop" else "length")

    def _load_adapter(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        from peft import LoraConfig as PeftLoraConfig
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        directory = self.adapter_root / f"v{version}"
        directory.mkdir(parents=True, exist_ok=True)
        save_file(peft_adapter_names(tensors), str(directory / "adapter_model.safetensors"))
        peft_cfg = PeftLoraConfig(r=self.lora.r, lora_alpha=self.lora.alpha, lora_dropout=self.lora.dropout,
                                  target_modules=list(self.lora.target_modules), task_type="CAUSAL_LM")
        config = peft_cfg.to_dict()
        config["target_modules"] = sorted(config["target_modules"])
        (directory / "adapter_config.json").write_text(json.dumps(config, default=str))
        previous = self._lora_request
        self._lora_request = LoRARequest(f"policy-v{version}", version, str(directory))
        self.llm.llm_engine.add_lora(self._lora_request)  # load now, not on the first request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
