"""Held-out episodes for the gold evaluation of an episode task (`task.env`): each held-out prompt is one
episode, decoded as the evaluator decodes (greedy by default, `evaluator.max_new_tokens` a turn), run by the
generators' `EpisodeRunner` through the evaluator's backend, so a policy that learned to call its tools is
evaluated with them, not on a single completion that would end at its first call.

Each episode becomes one `Generation`: its completion is the episode's answer (its last model turn, when the
environment ended the episode on it; an episode cut by turns or tokens has none, an empty answer), what the
gold reward scores against the prompt's reference; its ids are the whole episode with the loss mask, so the
KL and perplexity measures count the model's tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from asyncrlhf.config import Config
from asyncrlhf.envs.base import EndKind
from asyncrlhf.envs.episode import Episode, EpisodeRunner, episode_limits
from asyncrlhf.envs.loading import EnvFactory
from asyncrlhf.sampling.backend import Completion
from asyncrlhf.sampling.offline import Generation, PolicySampler, sampling_for


class HeldOutEpisodes:
    """One episode per held-out prompt, with the environments of `task.env`."""

    def __init__(self, cfg: Config, tokenizer, sampler: PolicySampler):
        ec = cfg.evaluator
        self.cfg, self.tokenizer, self.sampler = cfg, tokenizer, sampler
        self.envs = EnvFactory(cfg.task.env)
        self.runner = EpisodeRunner(tokenizer, self.envs, episode_limits(cfg, ec.max_new_tokens),
                                    cfg.model.system_prompt or "")

    def generate(self, policy: nn.Module, prompts: Sequence[str], references: Sequence[str | None],
                 version: int = 1) -> list[Generation]:
        """One episode of each prompt (its reference for the environment's verifier), as a Generation."""
        backend = self.sampler.backend(policy, version)
        batch, temperature = self.sampler.batch_size, self.cfg.evaluator.temperature

        def turn(contexts: list[list[int]], max_tokens: int) -> tuple[list[Completion], int]:
            sampling = sampling_for(temperature, max_tokens)
            out: list[Completion] = []
            for start in range(0, len(contexts), batch):
                chunk = contexts[start : start + batch]
                out += [samples[0] for samples in backend.generate(chunk, 1, sampling)]
            return out, version

        groups = self.runner.run(list(zip(prompts, references, strict=True)), 1, turn)
        return [self._generation(prompt, group[0]) for prompt, group in zip(prompts, groups, strict=True)]

    def _generation(self, prompt: str, episode: Episode) -> Generation:
        return Generation(prompt, episode.prompt_ids, self.answer(episode), list(episode.token_ids),
                          episode.finish, list(episode.loss_mask))

    def answer(self, episode: Episode) -> str:
        """The episode's last model turn (the tokens after its last environment token), when the environment
        ended the episode on it; else empty."""
        if episode.end is None or episode.end.kind is not EndKind.DONE:
            return ""
        mask = episode.loss_mask
        start = len(mask) - mask[::-1].index(0) if 0 in mask else 0
        return self.tokenizer.decode(episode.token_ids[start:], skip_special_tokens=True)

    def close(self) -> None:
        self.envs.close()
