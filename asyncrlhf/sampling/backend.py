"""What every sampling backend is: the `Backend` protocol and the `Completion` it returns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from asyncrlhf.config import SamplingConfig
from asyncrlhf.sampling.hops.hop import EngineHop
from asyncrlhf.weights.target import WeightTarget

Finish = Literal["stop", "length"]
# One position of a scored sequence: (log p(token_t | prefix), the top-n (id, log p) at t, most likely first).
TokenScore = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class Completion:
    """One sampled completion.

    token_ids: the completion, EOS included when the model emitted it, nothing after it.
    logprobs: the behaviour log-prob of each token, log mu(token_t | prefix), mu the distribution it was
        drawn from: softmax(logits / temperature) truncated to the top-k, then to the top-p nucleus, and
        renormalised (`asyncrlhf.sampling.hf.sampling_log_softmax`; vLLM's processed log-probs). Both
        backends return this. With top_k=0 and top_p=1 (the defaults) it is log softmax(logits /
        temperature), what the learner's `token_logprobs` recomputes; with truncation the importance ratio
        pi/mu is the one to the distribution actually sampled.
    finish: "stop" when EOS ended it, "length" when it hit max_new_tokens.
    versions: the policy step that sampled each token, when weights changed mid-sample (continuous mode);
        empty when one version sampled them all (batch mode: the version the caller holds).
    continued_from: how many leading tokens another generator sampled before it handed the sample on.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish: Finish
    versions: tuple[int, ...] = ()
    continued_from: int = 0


class Backend(WeightTarget, Protocol):
    """What the generator loop, the WeightSync receiver and `/v1/completions` need from a sampler: a
    `WeightTarget` (pushed weights are applied with `apply_weights`) that generates and scores."""

    @property
    def version(self) -> int:
        """The step of the policy version of the live weights (0: none received yet)."""

    @property
    def hop(self) -> EngineHop | None:
        """How a verified push reaches an inference engine the backend drives (`asyncrlhf.sampling.hops`);
        None: the backend's own module takes it (HF)."""

    @property
    def context_length(self) -> int | None:
        """The longest sequence (prompt + completion) the engine holds; None when the model does not say."""

    def generate(self, prompts: Sequence[Sequence[int]], k: int,
                 sampling: SamplingConfig) -> list[list[Completion]]:
        """k completions of each prompt: `out[i][j]` is the j-th sample of `prompts[i]`."""

    def score_tokens(self, sequences: Sequence[Sequence[int]], top_n: int) -> list[list[TokenScore]]:
        """`out[i][t - 1]` for each position t >= 1 of `sequences[i]`: (log p(token_t | prefix), the top_n
        most likely (id, log p) at t), p = softmax(logits): the model's own distribution, with no temperature
        and no truncation (vLLM's prompt log-probs ignore the sampling parameters, so both backends use this
        definition; it is also what vLLM's own server reports by default)."""

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        """Name -> tensor (shape, dtype) that a weight push may update: the full state dict, or the LoRA
        adapter tensors in a LoRA run; names as in the learner's (PEFT-wrapped) model."""
