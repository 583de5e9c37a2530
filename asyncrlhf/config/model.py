"""The policy and how it samples: the model to load (`model`), sampling settings, and the generator service
(`generator`: backend, replicas, WeightSync and HTTP addresses)."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field

from asyncrlhf.config.base import Section


class EngineHandoff(StrEnum):
    """`generator.vllm.handoff`: how a verified push reaches the workers of an engine in processes of its own
    (`asyncrlhf.sampling.hops.factory` turns it into the hop)."""

    AUTO = "auto"  # shared memory where /dev/shm is writable, else a file
    SHM = "shm"  # one shared-memory segment, rewritten per version
    FILE = "file"  # a safetensors file per version in the work directory


class TinyModelConfig(Section):
    """The `tiny` preset: a random Llama-style model and an offline tokenizer, built in code for tests."""

    layers: int = Field(2, ge=1, description="Transformer layers.")
    hidden: int = Field(64, ge=8, description="Hidden size.")
    heads: int = Field(4, ge=1, description="Attention heads (vLLM's CPU kernels need hidden / heads in "
                       "their head sizes: 2 for the default hidden).")
    intermediate: int = Field(128, ge=8, description="MLP intermediate size.")
    max_positions: int = Field(512, ge=16, description="Longest sequence (prompt + completion).")


class ModelConfig(Section):
    """The policy every service loads (and the reference, and the tokenizer)."""

    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="`tiny`, `smollm2-135m-instruct` (packaged GGUF), a local HF directory, or a .gguf file.",
    )
    gguf_file: str | None = Field(
        None, description="GGUF file name inside `name_or_path` when it is a directory."
    )
    cache_dir: str = Field(
        "~/.cache/asyncrlhf", description="Where GGUF files are converted once to safetensors."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype when loaded."
    )
    apply_chat_template: bool = Field(
        True, description="Wrap prompts in the tokenizer's chat template, if any."
    )
    system_prompt: str | None = Field(None, description="System message for the chat template.")
    max_prompt_tokens: int = Field(256, ge=1, description="Prompts are left-truncated to this many tokens.")
    tiny: TinyModelConfig = TinyModelConfig()
    allow_hub: bool = Field(False, description="Allow a hub model name (needs network); off: fail clearly.")
    revision: str | None = Field(
        None, description="A hub model's revision: pin a commit hash (a branch or tag is resolved at start, "
        "and the commit used is what the run's saved config records).",
    )


class SamplingConfig(Section):
    """`generator.sampling`: how completions are sampled."""

    temperature: float = Field(1.0, gt=0, description="Sampling temperature; behaviour log-probs use it too.")
    top_p: float = Field(1.0, gt=0, le=1.0, description="Nucleus sampling; 1.0 disables it.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_new_tokens: int = Field(64, ge=1, description="Most tokens sampled per completion.")


# LoRA ranks vLLM serves (vllm.config.lora.MaxLoRARanks); another rank is refused when the engine starts.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Head sizes vLLM's CPU attention kernels support (CPUAttentionBackend.get_supported_head_sizes).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Keys of the flat generator section of before -> where they are now.
_MOVED_TO_VLLM = {"gpu_memory_utilization": "gpu_memory_utilization", "vllm_dtype": "dtype",
                  "max_model_len": "max_model_len"}


class VLLMConfig(Section):
    """`generator.vllm`: the vLLM engine (`generator.backend=vllm`), on a GPU or on vLLM's CPU build."""

    enforce_eager: bool | None = Field(
        None, description="Skip torch.compile and CUDA graphs. None: true on CPU (compiling takes minutes "
        "there), false on GPU.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Engine dtype. auto: the learner's (`model.dtype`). Another dtype is logged as a "
        "warning: behaviour log-probs then differ from the learner's (by how much: docs/benchmarks.md).")
    kv_cache_gib: int = Field(
        1, ge=1, description="CPU: KV cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); on CPU vLLM would "
        "take gpu_memory_utilization as a share of host RAM.")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1.0, description="GPU: fraction of GPU memory for weights and KV cache.")
    max_model_len: int | None = Field(None, description="Max sequence length (None: the model's).")
    cache_root: str | None = Field(
        None, description="VLLM_CACHE_ROOT (None: `<model.cache_dir>/vllm`, never the home directory).")
    merge_lora: bool | None = Field(
        None, description="LoRA runs: fold each pushed adapter into the base weights (from a pristine copy "
        "the generator keeps in host memory) and reload them, so sampling runs the plain model, as the HF "
        "backend does; false: serve the adapter with vLLM's LoRA kernels. None: true on CPU (vLLM's CPU "
        "LoRA kernels are slow: docs/benchmarks.md), false on GPU (keeps host memory free; pushes stay "
        "adapters).")
    cpu_threads_bind: str = Field(
        "nobind", description="CPU: vLLM's VLLM_CPU_OMP_THREADS_BIND. `nobind` (default): the worker runs "
        "`generator.threads` threads (0: every core) where the OS schedules them. vLLM's own `auto` pins the "
        "worker to all cores but one, reserved for its scheduler: half the machine on 2 cores. A core list "
        "(`0-3`) pins to those cores.")
    engine_in_process: bool | None = Field(
        None, description="Run vLLM's engine core in the generator's own process (VLLM_ENABLE_V1_"
        "MULTIPROCESSING=0) instead of a process of its own. None: true on CPU (the separate engine process "
        "busy-polls a core, which a small host needs for the model: docs/benchmarks.md), false on GPU (the "
        "separate process overlaps scheduling with the GPU's work).")
    handoff: EngineHandoff = Field(
        EngineHandoff.AUTO, description="An engine in processes of its own: how a verified push reaches its "
        "workers. "
        "`shm`: one shared-memory segment rewritten per version, checked by the workers before they load "
        "it (no file per version); `file`: a safetensors file per version in the work directory; auto: "
        "shm where /dev/shm is writable, else file. An engine in the generator's process takes the "
        "tensors themselves.")
    collective_in_engine: bool = Field(
        True, description="An engine in processes of its own, with the collective route (generator."
        "collective, learner.collective): its worker joins the learner's weight group itself and receives "
        "each version's broadcast (NCCL into its GPU where both ends are on GPUs), verifying every bucket "
        "and tensor before it loads any; false: the generator's process joins and hands each version over "
        "(`handoff`). Full-weight pushes and tensor_parallel_size 1 only; otherwise the generator's process "
        "joins.")
    inflight_kv: Literal["keep", "recompute"] = Field(
        "keep", description="Continuous mode: after a push, sequences in flight keep the KV cache the old "
        "weights computed (`keep`, PipelineRL's choice: no recompute) or are prefilled again under the new "
        "weights (`recompute`); docs/pipeline.md measures both.")


class GeneratorConfig(Section):
    """The generator service: backend, replicas, sampling, and its WeightSync and HTTP addresses."""

    backend: Literal["hf", "vllm", "auto"] = Field(
        "hf", description="`hf` (transformers, CPU or GPU), `vllm` (GPU, or vLLM's CPU build: `make vllm`), "
        "or `auto`: vLLM on a GPU where it is installed and can serve this run, else `hf` (resolved at load; "
        "`auto_reason` says why)."
    )
    auto_reason: str | None = Field(
        None, description="Written by `backend: auto` at load: the backend it chose and why (not a setting).")
    replicas: int = Field(1, ge=1, description="Generator processes `asyncrlhf up` starts.")
    samples_per_prompt: int = Field(4, ge=1, description="k: completions sampled per prompt group.")
    batch_prompts: int = Field(8, ge=1, description="Prompt groups sampled together in one backend call.")
    mode: Literal["batch", "continuous"] = Field(
        "batch", description="`batch`: read up to batch_prompts groups, sample them, write them when the "
        "longest sample ends, apply pushes between batches. `continuous` (vLLM backend): keep the engine "
        "full, start a group whenever k slots free up, write each group the step it ends, apply a push "
        "between two engine steps (tokens carry the version that sampled them), hand unfinished samples on "
        "at a stop; with task.env, each episode's next turn enters the engine when its environment step "
        "returns (docs/environments.md). The HF backend has no step-wise engine: it runs `batch` whatever "
        "this says, and says so.")
    max_running_samples: int = Field(
        0, ge=0, description="Continuous mode: samples in the engine at once (0: batch_prompts x "
        "samples_per_prompt, the batch mode's); with task.env, episodes in flight, in the engine or waiting "
        "on their environment. A group starts when k of them are free.")
    save_every_tokens: int = Field(
        32, ge=1, description="Continuous mode: save each group's samples in flight to Redis whenever they "
        "have grown by this many tokens since the last save, so a SIGKILLed generator loses at most this "
        "many tokens per sample (another continues from the save). 32: a few saves per 192-token answer, "
        "each one small HSET, against regenerating whole samples.")
    sampling: SamplingConfig = SamplingConfig()
    device: str = Field("auto", description="`auto`, `cpu`, `cuda`, `cuda:1`.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: leave torch's default).")
    grpc_host: str = Field("127.0.0.1", description="WeightSync bind address.")
    grpc_port: int = Field(0, ge=0, description="WeightSync port (0: pick a free one).")
    advertise_host: str | None = Field(None, description="Address the learner dials (defaults to grpc_host).")
    data_channel: bool = Field(
        True, description="Offer pushes a TCP data channel beside WeightSync (on grpc_host): tensor bytes "
        "there, control over gRPC (docs/weights.md); over TLS from run.grpc_tls's files when WeightSync is.")
    data_port: int = Field(
        0, ge=0, description="Data channel port (0: pick a free one); open it to the learner and to relaying "
        "generators as WeightSync's.")
    collective: bool = Field(
        True, description="Offer pushes a weight group: the learner (learner.collective) then broadcasts the "
        "tensor bytes to it (gloo; NCCL on a GPU), control over gRPC (docs/weights.md); never beside TLS.")
    http_host: str = Field("127.0.0.1", description="Bind address of the HTTP server (health, metrics, API).")
    http_port: int = Field(0, ge=0, description="Health, metrics and /v1/completions (0: pick a free one).")
    api_max_prompt_tokens: int | None = Field(
        None, ge=1, description="Longest prompt the OpenAI-compatible API (/v1) accepts, in tokens. None: "
        "what the engine holds (the model's context length, or generator.vllm.max_model_len) less the "
        "request's max_tokens. model.max_prompt_tokens caps training prompts only, not the API.")
    heartbeat_s: float = Field(2.0, gt=0, description="Registry heartbeat period.")
    registry_ttl_s: float = Field(10.0, gt=0, description="A generator silent this long leaves the registry.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM: GPUs one generator replica shards the model over (replicas: copies)."
    )
    vllm: VLLMConfig = VLLMConfig()

    @classmethod
    def misplaced(cls, key: str, prefix: str, data: Mapping[str, Any]) -> str | None:
        new = _MOVED_TO_VLLM.get(key)
        return f"`{prefix}{key}` is now `{prefix}vllm.{new}`; move it there" if new else None

