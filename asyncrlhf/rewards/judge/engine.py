"""Who answers for the judge: the `JudgeEngine` protocol, and the engine in this process (`LocalEngine`).

An engine takes rendered judge prompts and returns, per prompt, a `Reply` or the `JudgeCallError` that
ended that call (the other calls of the batch keep their replies). Decoding is greedy (temperature 0), so
a prompt's reply is a function of the prompt, which is what makes the judge's cache sound.

The local engine is a generator backend (`asyncrlhf.sampling`) loaded with the judge's model: vLLM (a GPU,
or vLLM's CPU build), or transformers where vLLM is not installed or does not start
(`judge.engine.fallback_to_hf`). Prompts go through the judge model's chat template (`judge.system` first)
and are batched, `judge.batch_size` per engine call. `reply: logprob` reads the first reply token's
alternatives from one scoring pass (`Backend.score_tokens` on the prompt plus one token): the model's own
distribution, log softmax(logits), as an OpenAI-compatible server reports `top_logprobs`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Protocol

from asyncrlhf.config import Config, GeneratorConfig, JudgeConfig, RunConfig, VLLMConfig
from asyncrlhf.models import encode_prompts, load_tokenizer
from asyncrlhf.rewards.judge.meter import JudgeMeter, NullMeter, Outcome
from asyncrlhf.rewards.judge.reply import Reply
from asyncrlhf.sampling.backend import Backend
from asyncrlhf.sampling.offline import sampling_for

log = logging.getLogger(__name__)

TOP_N = 20  # alternatives read at the reply's first token (an OpenAI server's most)


class JudgeCallError(RuntimeError):
    """A judge call got no reply (timeout, connection lost, server error) after its retries."""


class JudgeEngine(Protocol):
    """What the judge asks: `identity` names the model (part of every cache key)."""

    identity: str

    def ask(self, prompts: Sequence[str], logprob: bool) -> list[Reply | JudgeCallError]:
        """One reply per rendered prompt: its first-token alternatives (`logprob`), else its greedy text."""

    def close(self) -> None: ...


class LocalEngine:
    """A generator backend holding the judge's model, in this process."""

    def __init__(self, backend: Backend, tokenizer, cfg: JudgeConfig, identity: str,
                 meter: JudgeMeter | None = None):
        self.backend, self.tokenizer, self.cfg, self.identity = backend, tokenizer, cfg, identity
        self.meter = meter or NullMeter()
        self.truncated = 0  # judge prompts cut to model.max_prompt_tokens (their end kept)

    @classmethod
    def from_config(cls, cfg: JudgeConfig, seed: int = 0, meter: JudgeMeter | None = None) -> LocalEngine:
        tokenizer = load_tokenizer(cfg.model)
        backend, name = judge_backend(cfg, tokenizer, seed)
        return cls(backend, tokenizer, cfg, f"{name}:{cfg.model.name_or_path}:{cfg.model.gguf_file}", meter)

    def ask(self, prompts: Sequence[str], logprob: bool) -> list[Reply | JudgeCallError]:
        """Batches of `batch_size`, each one metered call. An engine that raises has failed as a whole:
        that propagates (the reward loop retries the batch)."""
        ids = self._encode(prompts)
        replies: list[Reply | JudgeCallError] = []
        for start in range(0, len(ids), self.cfg.batch_size):
            chunk = ids[start: start + self.cfg.batch_size]
            self.meter.started(len(chunk))
            began = time.perf_counter()
            outcome: Outcome = "failed"
            try:
                replies += self._first_tokens(chunk) if logprob else self._texts(chunk)
                outcome = "answered"
            finally:
                self.meter.ended(len(chunk), time.perf_counter() - began, outcome)
        return replies

    def close(self) -> None:
        close = getattr(self.backend, "close", None)  # the vLLM engine's processes
        if close is not None:
            close()

    def _encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Chat-templated ids, left-truncated to model.max_prompt_tokens (counted in `truncated`)."""
        limit = self.cfg.model.max_prompt_tokens
        full = encode_prompts(self.tokenizer, list(prompts), self.cfg.model.model_copy(
            update={"system_prompt": self.cfg.system, "max_prompt_tokens": 1 << 30}))
        self.truncated += sum(len(x) > limit for x in full)
        return [x[-limit:] for x in full]

    def _texts(self, chunk: list[list[int]]) -> list[Reply | JudgeCallError]:
        rows = self.backend.generate(chunk, 1, sampling_for(0.0, self.cfg.max_new_tokens))
        return [Reply(self.tokenizer.decode(row[0].token_ids, skip_special_tokens=True)) for row in rows]

    def _first_tokens(self, chunk: list[list[int]]) -> list[Reply | JudgeCallError]:
        """The alternatives at the position after each prompt: score prompt + one (any) token, read the last
        position's top-n. Tokens that decode to the same text are one alternative (their mass summed)."""
        filler = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        scored = self.backend.score_tokens([p + [filler] for p in chunk], TOP_N)
        replies: list[Reply | JudgeCallError] = []
        for positions in scored:
            top: dict[str, float] = {}
            for token_id, logprob in positions[-1][1]:
                text = self.tokenizer.decode([token_id])
                top[text] = math.log(math.exp(top[text]) + math.exp(logprob)) if text in top else logprob
            best = max(top, key=top.__getitem__) if top else ""
            replies.append(Reply(best, top))
        return replies


def judge_backend(cfg: JudgeConfig, tokenizer, seed: int) -> tuple[Backend, str]:
    """(the backend that serves the judge's model, its name): vLLM, or HF where vLLM cannot start and
    `engine.fallback_to_hf` allows it."""
    from asyncrlhf.sampling.factory import create_backend

    if cfg.engine.backend == "vllm":
        try:
            return create_backend(_engine_config(cfg, "vllm", seed), tokenizer), "vllm"
        except Exception as err:  # not installed, cannot serve this model, or the engine did not start
            if not cfg.engine.fallback_to_hf:
                raise
            log.warning("the judge's vLLM engine did not start (%s: %s): judging with transformers instead "
                        "(set the judge's engine.fallback_to_hf=false to fail)", type(err).__name__, err)
    return create_backend(_engine_config(cfg, "hf", seed), tokenizer), "hf"


def _engine_config(cfg: JudgeConfig, backend: str, seed: int) -> Config:
    """A run config whose `model` and `generator` are the judge's engine (no weight routes offered)."""
    e = cfg.engine
    generator = GeneratorConfig(
        backend=backend, device=e.device, threads=e.threads, collective=False, data_channel=False,
        vllm=VLLMConfig(gpu_memory_utilization=e.gpu_memory_utilization, kv_cache_gib=e.kv_cache_gib,
                        max_model_len=e.max_model_len))
    return Config(run=RunConfig(seed=seed), model=cfg.model, generator=generator)
