"""Gold evaluation of a policy on the held-out prompts: what `asyncrlhf eval` and the evaluator service run.

For each policy: its completions (greedy by default) are scored with the *gold* reward (`evaluator.gold`),
compared prompt by prompt with reference completions (win rate, ties half; with `evaluator.judge`, also a
pairwise judge's win rate with its interval: `asyncrlhf.stages.judged_eval`), and their tokens are scored
by the policy and the reference policy (the run's initial model) for the KL estimate and perplexity
(`asyncrlhf.algorithms.evaluation`).

An episode task (`task.env`) is evaluated on held-out episodes (`asyncrlhf.stages.episode_eval`): the gold
reward scores each episode's answer, and KL and perplexity count the model's tokens only.

Reference completions: `evaluator.references_path` (a dataset's answers) or, by default, the initial
policy's greedy completions, generated once and cached in `<run.dir>/eval/references.jsonl`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from asyncrlhf import algorithms as A
from asyncrlhf.config import Config
from asyncrlhf.models import encode_prompts, load_policy
from asyncrlhf.rewards import Item, build_reward
from asyncrlhf.sampling.offline import Generation, PolicySampler, completion_token_logprobs, sampling_for
from asyncrlhf.stages.common import StageError, read_jsonl, read_records, take, write_jsonl
from asyncrlhf.stages.episode_eval import HeldOutEpisodes
from asyncrlhf.stages.judged_eval import JudgedWinRate
from asyncrlhf.tasks import load_task, plain_text

log = logging.getLogger(__name__)

EVAL_DIR = "eval"
REFERENCES = "references.jsonl"


def eval_dir(cfg: Config) -> Path:
    return cfg.run.path / EVAL_DIR


class GoldEvaluation:
    """Held-out prompts, the gold scorer, the reference policy and its completions, for one run."""

    def __init__(
        self, cfg: Config, tokenizer, sampler: PolicySampler | None = None, reference: nn.Module | None = None
    ):
        ec = cfg.evaluator
        self.cfg, self.tokenizer = cfg, tokenizer
        self.sampler = sampler or PolicySampler(cfg, tokenizer, ec.backend, ec.device, ec.batch_size)
        self.reference = (
            reference if reference is not None else load_policy(cfg.model, device=str(self.sampler.device))
        )
        self.reference.requires_grad_(False)
        # The gold scorer alone (no proxy scorers), with the evaluator's own missing-EOS penalty, on the
        # evaluator's device (a gold model is the evaluator's, wherever the reward service scores).
        self.gold = build_reward(cfg.reward.model_copy(update={
            "scorers": [ec.gold], "missing_eos_penalty": ec.missing_eos_penalty,
            "max_completion_tokens": None, "device": ec.device,
        }), cfg.model)
        self.dataset_references = self._dataset_references()
        self.labels: list[str | None] | None = None  # the task's reference answers (verifiable gold rewards)
        if self.dataset_references is not None:
            self.prompts = [g.prompt for g in self.dataset_references]
            self.prompt_ids = encode_prompts(tokenizer, self.prompts, cfg.model)
        else:
            task = load_task(cfg.task)
            if not task.eval:
                raise StageError("the task has no held-out prompts: set task.eval_path (task `jsonl`) or "
                                 "task.eval_split (task `hf`)")
            held_out = take(task.eval, ec.num_prompts)
            self.prompts = [plain_text(p) for p in held_out]
            self.prompt_ids = encode_prompts(tokenizer, held_out, cfg.model)  # chat prompts: the template
            self.labels = take(task.eval_references, ec.num_prompts) or None
        self._references: list[Generation] | None = None
        self._reference_scores: torch.Tensor | None = None
        self.episodes = (HeldOutEpisodes(cfg, tokenizer, self.sampler)
                         if cfg.task.env.kind != "none" and self.dataset_references is None else None)
        self.judged = JudgedWinRate(ec.judge, cfg.run.seed) if ec.judge is not None else None

    @property
    def sampling(self):
        return sampling_for(self.cfg.evaluator.temperature, self.cfg.evaluator.max_new_tokens)

    def generate(self, policy: nn.Module, version: int = 1) -> list[Generation]:
        """One completion per held-out prompt (one episode, for an episode task)."""
        if self.episodes is not None:
            references = self.labels or [None] * len(self.prompts)
            return self.episodes.generate(policy, self.prompts, references, version)
        rows = self.sampler.generate(policy, self.prompts, self.prompt_ids, 1, self.sampling, version)
        return [samples[0] for samples in rows]

    def initial_generations(self) -> list[Generation]:
        """The initial policy's completions: the cached references themselves unless a dataset gave them."""
        return self.generate(self.reference) if self.dataset_references else self.references()

    def references(self) -> list[Generation]:
        """The dataset's references, else the initial policy's greedy completions (cached on disk)."""
        if self._references is None:
            self._references = self.dataset_references or self._policy_references()
        return self._references

    def evaluate(self, policy: nn.Module, generations: Sequence[Generation]) -> dict[str, float]:
        """Gold reward, win rate, KL and perplexity of `policy`'s `generations` (one per held-out prompt)."""
        if [g.prompt for g in generations] != self.prompts:
            raise StageError(
                "the generations are not of this run's held-out prompts (task, evaluator.num_prompts "
                "or evaluator.references_path changed?); regenerate them"
            )
        scores = self.score(generations)
        if self._reference_scores is None:
            self._reference_scores = self.score(self.references())
        prompt_ids = [g.prompt_ids for g in generations]
        completion_ids = [g.completion_ids for g in generations]
        pad, batch = self.tokenizer.pad_token_id, self.cfg.evaluator.batch_size
        policy_logps, mask = completion_token_logprobs(policy, prompt_ids, completion_ids, pad, batch)
        reference_logps, _ = completion_token_logprobs(self.reference, prompt_ids, completion_ids, pad, batch)
        mask = mask * model_tokens(generations, mask.shape[1])
        judged = {} if self.judged is None else self.judged.measure(
            self.prompts, [g.completion for g in generations], [g.completion for g in self.references()],
            self.labels)
        return {
            "gold_reward": float(scores.mean()),
            "win_rate": float(A.win_rate(scores, self._reference_scores)),
            "kl": float(A.sequence_kl(policy_logps, reference_logps, mask).mean()),
            "perplexity": float(A.perplexity(reference_logps, mask).mean()),
            "n_prompts": len(generations),
            **judged,
        }

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        if self.judged is not None:
            self.judged.close()

    def score(self, generations: Sequence[Generation]) -> torch.Tensor:
        """(B,) gold rewards."""
        n = len(generations)
        labels = self.labels if self.labels and len(self.labels) == n else [None] * n
        items = [Item(g.prompt, g.completion, ended_with_eos=g.finish == "stop",
                      completion_tokens=len(g.completion_ids), label=label)
                 for g, label in zip(generations, labels, strict=True)]
        return torch.tensor(self.gold.score(items).scores, dtype=torch.float64)

    # -- references --------------------------------------------------------------------------------------

    def _dataset_references(self) -> list[Generation] | None:
        path = self.cfg.evaluator.references_path
        if not path:
            return None
        rows = take(read_records(path, ["prompt", "completion"]), self.cfg.evaluator.num_prompts)
        prompt_ids = encode_prompts(self.tokenizer, [r["prompt"] for r in rows], self.cfg.model)
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        return [
            Generation(
                r["prompt"],
                ids,
                r["completion"],
                self.tokenizer(r["completion"], add_special_tokens=False)["input_ids"] + eos,
                "stop",
            )
            for r, ids in zip(rows, prompt_ids, strict=True)
        ]

    def _policy_references(self) -> list[Generation]:
        path = eval_dir(self.cfg) / REFERENCES
        key = self._reference_key()
        if path.is_file():
            rows = read_jsonl(path)
            if (
                rows
                and all(r.get("key") == key for r in rows)
                and [r["prompt"] for r in rows] == self.prompts
            ):
                return [Generation.from_row(r) for r in rows]
            log.info("%s is for other prompts or settings; regenerating it", path)
        references = self.generate(self.reference, version=1)
        write_jsonl(path, [g.to_row(key=key) for g in references])
        log.info("reference completions of the initial policy written to %s", path)
        return references

    def _reference_key(self) -> str:
        """What the cached references depend on: model, decoding and prompts."""
        ec, mc = self.cfg.evaluator, self.cfg.model
        return (
            f"{mc.name_or_path}|{mc.gguf_file}|{mc.system_prompt}|{mc.max_prompt_tokens}|t={ec.temperature}"
            f"|n={ec.max_new_tokens}|seed={self.cfg.run.seed}|env={self.cfg.task.env.kind}"
        )


def model_tokens(generations: Sequence[Generation], width: int) -> torch.Tensor:
    """(B, width) 1 on the model's tokens: all of a single completion's, an episode's by its loss mask."""
    out = torch.ones((len(generations), width))
    for row, g in enumerate(generations):
        if g.loss_mask is not None:
            out[row, : len(g.loss_mask)] = torch.as_tensor(g.loss_mask, dtype=out.dtype)
    return out
