"""Sampling for the API, backend-agnostic: prompts in, finished choices out, with OpenAI's semantics.

- temperature 0 is greedy: sampled as top-k 1 at temperature 1 (deterministic on any backend);
- a request runs in its own torch RNG stream (`torch.random.fork_rng`), seeded by `seed` or by a fresh random
  seed, so a seeded request is reproducible and API traffic never shifts the training loop's random stream
  (the HF backend samples from that stream; the vLLM backend draws its engine's seed from it);
- stop strings are applied to the decoded text: the text ends before the first one, the tokens count up to
  the one that completed it, and the choice finishes with "stop";
- every log-prob the API returns (`logprobs`, its top-N alternatives, echoed prompt tokens) is
  log softmax(logits) under the weights that sampled: the model's own distribution, whatever the request's
  temperature or top_p (so a greedy token's log-prob is its probability, not 0). It is what vLLM's own
  server reports by default, and the one definition both backends can give: vLLM's prompt log-probs ignore the
  sampling parameters (`Backend.score_tokens`). They come from one scoring pass of the backend, under the
  gate with the sampling, so they are the same weights version as the sample. (The training loop's behaviour
  log-probs are another quantity: under the distribution actually sampled, `asyncrlhf.sampling.Completion`.)

One request is one batch on the backend, taken through the gate as an "api" batch (`asyncrlhf.serving.gate`
says how it takes turns with the training loop and weight swaps).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from asyncrlhf.config import SamplingConfig
from asyncrlhf.cores import on_fresh_thread
from asyncrlhf.sampling import Backend, Finish, TokenScore
from asyncrlhf.serving.gate import BackendGate, GateBusy
from asyncrlhf.serving.openai.errors import OpenAIError
from asyncrlhf.serving.openai.limits import PromptLimits

# Below this, logits / temperature overflows float32 and sampling is greedy in all but name anyway.
MIN_TEMPERATURE = 1e-3

@dataclass(frozen=True)
class Params:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stops: list[str]
    top_n: int | None = None  # None: no log-probs asked for (no scoring pass); 0: only the tokens' own


@dataclass
class Sampled:
    """One choice. `scores[t]` covers prompt + completion position t + 1 (when log-probs were asked for;
    `logprobs` are then the completion's scores)."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish: Finish
    logprobs: list[float]
    scores: list[TokenScore] | None = field(default=None)


class ApiSampler:
    def __init__(self, backend: Backend, gate: BackendGate, tokenizer, limits: PromptLimits):
        self.backend, self.gate, self.tokenizer, self.limits = backend, gate, tokenizer, limits

    def check_prompt(self, ids: Sequence[int], max_tokens: int, param: str) -> None:
        self.limits.check(len(ids), max_tokens, param)
        vocab = len(self.tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise OpenAIError(400, f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                              param=param, code="invalid_value")

    def sample(self, prompts: list[list[int]], n: int, params: Params,
               param: str = "prompt") -> tuple[int, list[list[Sampled]]]:
        """(the weights version that sampled, out[i][j]: the j-th choice of prompts[i]). `param`: the
        request field the prompts came from, named by a refusal."""
        for ids in prompts:
            self.check_prompt(ids, params.max_tokens, param)
        greedy = params.temperature < MIN_TEMPERATURE
        sampling = SamplingConfig(temperature=1.0 if greedy else params.temperature,
                                  top_p=1.0 if greedy else params.top_p, top_k=1 if greedy else 0,
                                  max_new_tokens=params.max_tokens)
        try:
            with self.gate.generating("api"):
                version = self.backend.version
                if version == 0:
                    raise OpenAIError(503, "no weights yet: this generator waits for the learner's first "
                                           "push; retry later", code="not_ready", retry_after_s=5)
                # torch work on a thread that exits: the web server's worker threads live on, and each
                # would keep an OpenMP pool that slows the training loop's decoding (`on_fresh_thread`)
                choices = on_fresh_thread(lambda: self._sample(prompts, n, sampling, params))
        except GateBusy as err:
            raise OpenAIError(429, f"the generator is busy ({err}); retry later", code="busy",
                              retry_after_s=1) from err
        return version, choices

    def _sample(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                params: Params) -> list[list[Sampled]]:
        with torch.random.fork_rng():
            torch.manual_seed(secrets.randbits(63) if params.seed is None else params.seed)
            groups = self.backend.generate(prompts, n, sampling)
        choices = [[self._finish(p, c.token_ids, c.logprobs, c.finish, params) for c in group]
                   for p, group in zip(prompts, groups, strict=True)]
        if params.top_n is not None:
            self._score(choices, params.top_n)
        return choices

    def _finish(self, prompt: list[int], tokens: list[int], logprobs: list[float], finish: Finish,
                params: Params) -> Sampled:
        text = self.decode(tokens)
        cut = [text.find(s) for s in params.stops if s in text]
        if cut:
            text = text[: min(cut)]
            k = next(k for k in range(1, len(tokens) + 1)
                     if any(s in self.decode(tokens[:k]) for s in params.stops))
            tokens, logprobs, finish = tokens[:k], logprobs[:k], "stop"
        return Sampled(prompt, tokens, text, finish, logprobs)

    def _score(self, choices: list[list[Sampled]], top_n: int) -> None:
        flat = [c for group in choices for c in group]
        scored = self.backend.score_tokens([c.prompt_ids + c.token_ids for c in flat], top_n)
        for choice, scores in zip(flat, scored, strict=True):
            choice.scores = scores
            if choice.token_ids:
                choice.logprobs = [lp for lp, _ in scores[-len(choice.token_ids):]]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def usage(prompts: list[list[int]], choices: list[list[Sampled]]) -> dict[str, int]:
    """Each prompt counted once, every choice's completion tokens."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for group in choices for c in group)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def text_pieces(sampler: ApiSampler, choice: Sampled) -> list[str]:
    """The choice's text cut at token boundaries: what a stream sends, one chunk per piece."""
    pieces, done = [], 0
    for k in range(1, len(choice.token_ids) + 1):
        end = min(len(sampler.decode(choice.token_ids[:k])), len(choice.text))
        if end > done:
            pieces.append(choice.text[done:end])
            done = end
    if done < len(choice.text):
        pieces.append(choice.text[done:])
    return pieces
