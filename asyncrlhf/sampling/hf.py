"""The transformers backend: batched `generate` on CPU or GPU, then one forward pass for behaviour log-probs.

Prompts are left-padded into one batch of `len(prompts) * k` rows. Sampling uses only `generator.sampling`
(the model file's own generation defaults, such as a repetition penalty, are cleared at load, so the
distribution sampled is softmax(logits / temperature) truncated by top-k / top-p and nothing else).

Behaviour log-probs are recorded while sampling, from the very logits each token was drawn from:
log mu(token | prefix), mu = softmax(logits / temperature) truncated by top-k then top-p and renormalised
(`sampling_log_softmax`), the definition the vLLM backend shares (vLLM's processed log-probs); with
top_k=0 and top_p=1, the defaults, it is the learner's log softmax(logits / temperature). (`output_logits`
would keep every step's (rows, vocab) logits.) `BehaviourLogprobs` runs first among the logits processors,
so it sees the model's raw logits; it keeps one step's (rows, vocab) log-probs and picks the sampled token's
at the next step. This costs no extra forward pass (`completion_logprobs`, one pass over
prompt + completion, is what the learner-side tools and the tests compare against).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from asyncrlhf.algorithms.logprobs import token_logprobs
from asyncrlhf.config import Config, SamplingConfig
from asyncrlhf.models import CausalLM, is_lora, load_policy, resolve_device, set_threads
from asyncrlhf.sampling.backend import Completion, Finish, TokenScore
from asyncrlhf.sampling.hops.hop import EngineHop
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import adapter_tensors
from asyncrlhf.weights.target import swap_in

log = logging.getLogger(__name__)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) input ids and attention mask, shorter prompts padded on the left with `pad_id`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids that count only real tokens (what `generate` uses with left padding)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def trim_at_eos(token_ids: Sequence[int], eos_ids: set[int]) -> tuple[list[int], Finish]:
    """The completion up to and including its first EOS ("stop"), or all of it ("length")."""
    for i, token in enumerate(token_ids):
        if token in eos_ids:
            return list(token_ids[: i + 1]), "stop"
    return list(token_ids), "length"


@torch.no_grad()
def completion_logprobs(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        new_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, N) log-probs of `new_ids` (B, N) given the left-padded prompts (B, T), under logits / temperature.

    Tokens after a row's EOS are scored too (as padding continuations); callers cut them off."""
    full = torch.cat([prompt_ids, new_ids], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(new_ids)], dim=1)
    n = new_ids.shape[1]
    out = model(input_ids=full, attention_mask=mask, position_ids=positions(mask), logits_to_keep=n + 1)
    logits = out.logits[:, -(n + 1):-1]  # position t predicts token t + 1
    return token_logprobs(logits, new_ids, temperature)


def sampling_log_softmax(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probs of the distribution a token is drawn from: softmax(logits / temperature), truncated to the
    top-k, then to the top-p nucleus, renormalised (-inf outside). The behaviour log-prob definition both
    backends share; with top_k=0 and top_p=1 it is log softmax(logits / temperature)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    scores = logits.float() / sampling.temperature
    if sampling.top_k:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    return torch.log_softmax(scores, dim=-1)


class BehaviourLogprobs:
    """A logits processor that records log mu(sampled token | prefix), mu the distribution it was drawn from
    (`sampling_log_softmax`: temperature, top-k, top-p).

    Called once per generated position with the ids so far and that position's raw logits; the token sampled
    from the previous call's logits is the last id, so each call settles the previous position. `finish`
    settles the last one from the generated ids."""

    def __init__(self, sampling: SamplingConfig):
        self.sampling = sampling
        self._pending: torch.Tensor | None = None  # (B, V) log-probs of the position not yet settled
        self._settled: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            self._settle(self._pending, input_ids[:, -1])
        self._pending = sampling_log_softmax(scores, self.sampling)
        return scores

    def _settle(self, pending: torch.Tensor, tokens: torch.Tensor) -> None:
        self._settled.append(pending.gather(-1, tokens[:, None])[:, 0])
        self._pending = None

    def finish(self, new_ids: torch.Tensor) -> torch.Tensor:
        """(B, N) log-probs of the N generated tokens `new_ids`."""
        if self._pending is not None:
            self._settle(self._pending, new_ids[:, -1])
        if len(self._settled) != new_ids.shape[1]:
            raise RuntimeError(f"recorded {len(self._settled)} log-probs for {new_ids.shape[1]} tokens: "
                               "another logits processor ran ahead of BehaviourLogprobs")
        if not self._settled:
            return torch.zeros(new_ids.shape, dtype=torch.float32)
        return torch.stack(self._settled, dim=1)


class EachStep:
    """A logits processor that only calls `hook()` once per decoding step (a core share re-sizing torch's
    threads, asyncrlhf/cores.py) and leaves the scores as they are."""

    def __init__(self, hook: Callable[[], object]):
        self.hook = hook

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.hook()
        return scores


class HFBackend:
    """A transformers causal LM (LoRA-wrapped in a LoRA run, so pushed adapter names match).

    With `merge_lora` (the generator service, which owns its model) the adapter is folded into the base
    weights it targets after every update, from a pristine copy of those weights (no drift over updates), so
    sampling runs the plain model: no per-layer adapter matmuls. The adapter tensors stay what is pushed and
    reported. A caller that shares its model with the backend (an evaluation stage) leaves it unmerged."""

    def __init__(self, model: CausalLM, pad_id: int, eos_ids: set[int], device: torch.device,
                 merge_lora: bool = False):
        from transformers import GenerationConfig

        self.model, self.pad_id, self.eos_ids, self.device = model.eval(), pad_id, eos_ids, device
        self.model.requires_grad_(False)
        generation_owner = model.get_base_model() if is_lora(model) else model
        generation_owner.generation_config = GenerationConfig(
            eos_token_id=sorted(eos_ids), pad_token_id=pad_id,
            bos_token_id=generation_owner.config.bos_token_id)
        state = model.state_dict(keep_vars=True)
        self._live = adapter_tensors(state) if is_lora(model) else dict(state)
        self._version = 0
        self._pristine: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._merged = False
        self.step_hook: Callable[[], object] | None = None  # called between decoding steps
        if merge_lora and is_lora(model):
            from peft.tuners.lora import LoraLayer

            weights = [layer.get_base_layer().get_parameter("weight")
                       for layer in model.modules() if isinstance(layer, LoraLayer)]
            self._pristine = [(weight, weight.detach().clone()) for weight in weights]
            self._merge()

    @torch.no_grad()
    def _merge(self) -> None:
        """Base weights := pristine + the current adapter's delta (peft's merge)."""
        if self._merged:
            self.model.unmerge_adapter()  # clears peft's merged state; the weights are reset just below
        for live, pristine in self._pristine:
            live.copy_(pristine)
        self.model.merge_adapter()
        self._merged = True

    @classmethod
    def from_config(cls, cfg: Config, tokenizer) -> HFBackend:
        set_threads(cfg.generator.threads)
        torch.manual_seed(cfg.run.seed)
        device = resolve_device(cfg.generator.device)
        model = load_policy(cfg.model, lora=cfg.learner.lora, device=str(device))
        configured = getattr(model.config, "eos_token_id", None)
        configured = configured if isinstance(configured, list) else [configured]
        eos = {tokenizer.eos_token_id, *configured} - {None}
        return cls(model, tokenizer.pad_token_id, eos, device, merge_lora=True)

    @property
    def version(self) -> int:
        return self._version

    @property
    def hop(self) -> EngineHop | None:
        """None: pushes are swapped into this backend's own module (`apply_weights`), with no engine hop."""
        return None

    @property
    def context_length(self) -> int | None:
        """The longest sequence (prompt + completion) the model's positions cover, from its config
        (`max_position_embeddings`, or GPT-2's `n_positions`); None when the config names neither."""
        config = self.model.config
        return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._live

    @torch.no_grad()
    def apply_weights(
        self, tensors: Mapping[str, torch.Tensor], version: PolicyVersion, *, adopt: bool = False
    ) -> dict[str, torch.Tensor]:
        # adopted: tensors of the live dtype become live storage, no copy; the replaced ones go back
        replaced = swap_in(self._live, tensors, adopt=adopt)
        if self._pristine:
            self._merge()
        self._version = version.step
        return replaced

    @torch.no_grad()
    def _shared_prefix(self, ids: torch.Tensor, mask: torch.Tensor, k: int):
        """The KV cache of every prompt but its last token, computed once per prompt and repeated for its k
        samples (`generate` then runs only the last prompt token and the new ones), or None when k == 1."""
        if k == 1 or ids.shape[1] < 2:
            return None
        head = mask[:, :-1]
        out = self.model(input_ids=ids[:, :-1], attention_mask=head, position_ids=positions(head),
                         use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(k)
        return cache

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], k: int,
                 sampling: SamplingConfig) -> list[list[Completion]]:
        from transformers import LogitsProcessorList

        ids, mask = left_pad(prompts, self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = self._shared_prefix(ids, mask, k)
        ids, mask = ids.repeat_interleave(k, dim=0), mask.repeat_interleave(k, dim=0)  # row i * k + j
        behaviour = BehaviourLogprobs(sampling)
        processors = [behaviour] + ([EachStep(self.step_hook)] if self.step_hook else [])
        with warnings.catch_warnings():  # transformers 5 renames it `cache`; `past_key_values` works < 6
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=True,
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                max_new_tokens=sampling.max_new_tokens, logits_processor=LogitsProcessorList(processors),
            )
        new = out[:, ids.shape[1]:]
        logps = behaviour.finish(new).cpu()
        rows = []
        for row, tokens in enumerate(new.cpu().tolist()):
            kept, finish = trim_at_eos(tokens, self.eos_ids)
            rows.append(Completion(kept, logps[row, : len(kept)].tolist(), finish))
        return [rows[i * k:(i + 1) * k] for i in range(len(prompts))]

    @torch.no_grad()
    def score_tokens(self, sequences: Sequence[Sequence[int]], top_n: int) -> list[list[TokenScore]]:
        """For each sequence, for each position t >= 1: (log p(token_t | prefix), the `top_n` most likely
        (id, log p) at t), p = softmax(logits) (`Backend.score_tokens`). One forward pass per sequence, so
        memory stays at one (T, vocab) row of log-probs."""
        out = []
        for seq in sequences:
            ids = torch.as_tensor([list(seq)], dtype=torch.long, device=self.device)
            logps = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            chosen = logps.gather(-1, ids[0, 1:, None])[:, 0].cpu().tolist()
            top_lp, top_id = logps.topk(top_n, dim=-1) if top_n else (logps[:, :0], logps[:, :0].long())
            out.append([(lp, list(zip(i, t, strict=True))) for lp, i, t in
                        zip(chosen, top_id.cpu().tolist(), top_lp.cpu().tolist(), strict=True)])
        return out
