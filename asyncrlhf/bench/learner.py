"""`asyncrlhf bench learner [--prompts N] [--config FILE ...] [key=value ...]`: sequence packing and dynamic
sampling in the learner, measured side by side in one run on real samples (default: configs/varlen.yaml).

1. Samples: the feed's first N prompts, `samples_per_prompt` completions each from the config's model with the
   library's sampling backend, scored by the config's reward and, apart, by its gold scorer (binary on the
   variable-length config: in band or not, so many groups tie).
2. Packing: the same steps (`groups_per_step` groups each, in the feed's order) trained padded, packed with
   varlen attention and packed with the block-diagonal mask (`learner.pack_attention`), each by a fresh
   learner built as the service builds it (same seed, same weights). Training tokens/s:
   completion tokens trained over `train_step` seconds, the first step of each untimed (warm-up); the losses
   side by side; the padding share each computed on.
3. Dynamic sampling: scored by the gold reward, the groups a run trains without dynamic sampling (every one)
   and with it (the ones admission keeps: rewards not all equal); the trained completions' lengths side by
   side (mean and quantiles), since refilling must not skew them (filtering could favour what is easy to
   score). A replay of admission's decision on the same stream of groups, not a second training run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from asyncrlhf import algorithms as A
from asyncrlhf._proto.rollout_pb2 import RolloutGroup
from asyncrlhf.config import Config, load_config
from asyncrlhf.learner import build_learner
from asyncrlhf.rewards import build_reward
from asyncrlhf.rewards.groups import items_of, scored
from asyncrlhf.sampling import create_backend
from asyncrlhf.sampling.rollouts import rollout_group
from asyncrlhf.stages.sft import gold_scorer
from asyncrlhf.training.batch import TrainGroup
from asyncrlhf.version import PolicyVersion

DEFAULT_CONFIG = "configs/varlen.yaml"


def sample_groups(cfg: Config, n: int, reward) -> list[RolloutGroup]:
    """The feed's first `n` prompt groups, sampled by the config's model and scored by `reward`."""
    parts = build_learner(cfg)
    prompts = [parts.prompts.group(i, 0) for i in range(n)]
    backend = create_backend(cfg, parts.tokenizer)
    g = cfg.generator
    groups = []
    for start in range(0, n, g.batch_prompts):
        batch = prompts[start : start + g.batch_prompts]
        completions = backend.generate([list(p.prompt_token_ids) for p in batch], g.samples_per_prompt,
                                       g.sampling)
        groups += [rollout_group(p, c, PolicyVersion(0, 0), "bench", time.time(), time.time(),
                                 parts.tokenizer.decode) for p, c in zip(batch, completions, strict=True)]
    close = getattr(backend, "close", None)
    if close is not None:
        close()
    return rescored(groups, reward, g.samples_per_prompt)


def rescored(groups: list[RolloutGroup], reward, k: int) -> list[RolloutGroup]:
    result = reward.score([item for group in groups for item in items_of(group)])
    return [scored(group, result, i * k, "bench") for i, group in enumerate(groups)]


@dataclass
class Timing:
    """One mode's steps: seconds and completion tokens of the timed ones, every trained step's loss and
    padding share."""

    seconds: float = 0.0
    tokens: float = 0.0
    losses: list[float] = field(default_factory=list)
    padding: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return {"tokens_per_s": self.tokens / max(self.seconds, 1e-9), "seconds": self.seconds,
                "tokens": self.tokens, "losses": self.losses,
                "padding_share": sum(self.padding) / max(1, len(self.padding))}


def train(cfgs: dict[str, Config], steps: list[list[RolloutGroup]]) -> dict[str, dict]:
    """Train `steps` with a fresh learner per config, a step of each in turn (the order alternating, so drift
    in the machine's load falls on both alike); per config its timing (the first step untimed), losses and
    padding share."""
    trainers = {name: build_learner(cfg).trainer for name, cfg in cfgs.items()}
    out = {name: Timing() for name in cfgs}
    for i, groups in enumerate(steps):
        for name in (list(trainers) if i % 2 == 0 else list(reversed(trainers))):
            started = time.perf_counter()
            stats = trainers[name].train_step([TrainGroup(g) for g in groups], step_seed=i)
            if stats.get("skipped_step"):  # every pair tied: nothing trained (the same steps in each mode)
                continue
            if i > 0:
                out[name].seconds += time.perf_counter() - started
                out[name].tokens += stats["tokens"]
            out[name].losses.append(stats["loss"])
            out[name].padding.append(stats["padding_share"])
    return {name: timing.summary() for name, timing in out.items()}


def lengths(groups: list[RolloutGroup]) -> dict:
    values = torch.tensor([len(s.completion_token_ids) for g in groups for s in g.samples], dtype=torch.float)
    q = torch.quantile(values, torch.tensor([0.25, 0.5, 0.75, 0.9])).tolist()
    return {"samples": len(values), "mean": float(values.mean()), "p25": q[0], "median": q[1], "p75": q[2],
            "p90": q[3], "max": float(values.max())}


def dynamic_sampling(groups: list[RolloutGroup], gold, k: int) -> dict:
    """Trained lengths without and with dynamic sampling on the gold-scored groups."""
    by_gold = rescored(groups, gold, k)
    rewards = torch.tensor([[s.reward for s in g.samples] for g in by_gold])
    kept = [g for g, tied in zip(groups, A.uninformative(rewards).tolist(), strict=True) if not tied]
    return {"groups": len(groups), "filtered": len(groups) - len(kept), "off": lengths(groups),
            "on": lengths(kept) if kept else None}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench learner")
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("--prompts", type=int, default=30, help="prompt groups to sample (default 30)")
    parser.add_argument("--pack-tokens", type=int, default=1024, help="learner.pack_tokens when packed")
    parser.add_argument("--json", help="also write the figures to this file")
    args, overrides = parser.parse_known_args(list(argv))
    cfg = load_config(args.config or [DEFAULT_CONFIG], overrides)
    k, per_step = cfg.generator.samples_per_prompt, cfg.learner.groups_per_step
    started = time.perf_counter()
    groups = sample_groups(cfg, args.prompts, build_reward(cfg.reward, cfg.model))
    print(f"sampled {len(groups)} groups x {k} in {time.perf_counter() - started:.0f} s")
    steps = [groups[i : i + per_step] for i in range(0, len(groups) - per_step + 1, per_step)]
    modes = {"padded": {"packing": False},
             "packed": {"packing": True, "pack_tokens": args.pack_tokens, "pack_attention": "varlen"},
             "packed_mask": {"packing": True, "pack_tokens": args.pack_tokens, "pack_attention": "mask"}}
    results = train({name: cfg.model_copy(update={"learner": cfg.learner.model_copy(update=update)})
                     for name, update in modes.items()}, steps)
    padded, packed = results["padded"], results["packed"]
    diffs = [abs(a - b) for mode in ("packed", "packed_mask")
             for a, b in zip(padded["losses"], results[mode]["losses"], strict=True)]
    figures = {"config": args.config or [DEFAULT_CONFIG], "steps": len(steps), **results,
               "speedup": packed["tokens_per_s"] / padded["tokens_per_s"],
               "speedup_mask": results["packed_mask"]["tokens_per_s"] / padded["tokens_per_s"],
               "max_loss_diff": max(diffs, default=0.0),
               "dynamic_sampling": dynamic_sampling(groups, gold_scorer(cfg), k)}
    print_figures(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


def print_figures(f: dict) -> None:
    for name in ("padded", "packed", "packed_mask"):
        r = f[name]
        print(f"{name:>11}: {r['tokens_per_s']:7.1f} training tokens/s ({r['tokens']:.0f} completion tokens "
              f"in {r['seconds']:.1f} s; {len(r['losses'])} steps trained, the first untimed), padding share "
              f"{r['padding_share']:.0%}")
    print(f"packed / padded: {f['speedup']:.2f}x (varlen attention), {f['speedup_mask']:.2f}x "
          f"(block-diagonal mask); largest loss difference {f['max_loss_diff']:.2e}")
    ds = f["dynamic_sampling"]
    print(f"dynamic sampling (gold reward): {ds['filtered']} of {ds['groups']} groups filtered")
    for name in ("off", "on"):
        r = ds[name]
        if r is not None:
            print(f"  {name:>3}: {r['samples']} samples, mean {r['mean']:.1f} tokens, p25 {r['p25']:.0f}, "
                  f"median {r['median']:.0f}, p75 {r['p75']:.0f}, p90 {r['p90']:.0f}, max {r['max']:.0f}")
    if ds["on"] is not None:
        print(f"  mean trained length on / off: {ds['on']['mean'] / ds['off']['mean']:.3f}")
