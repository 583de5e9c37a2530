"""`asyncrlhf train-rm --config X [overrides]`: a Bradley-Terry reward model on preference pairs.

Pairs: `rm.data`, else `relabel.output` (JSONL {prompt, chosen, rejected}). The model is
`load_score_model(rm.base or model.name_or_path)`: the causal LM's backbone with a 1-output head. It reads
`prompt + completion` exactly as the reward service's `model` scorer does (`asyncrlhf.rewards.model`), and
is trained with −log σ(r_chosen − r_rejected) on the learner's DeepSpeed engine. `rm.eval_fraction` of the
pairs are held out; their accuracy (r_chosen > r_rejected) is logged after every epoch. The result, an HF
directory at `rm.output`, is a reward scorer: `reward.scorers: [{kind: model, path: <rm.output>}]`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

import torch

from asyncrlhf import algorithms as A
from asyncrlhf.config import Config
from asyncrlhf.models import load_score_model, load_tokenizer
from asyncrlhf.stages.common import StageError, log_stage, read_records, run_path, run_stage
from asyncrlhf.training.supervised import make_engine, right_pad, step_batches, steps_per_run, train_step

log = logging.getLogger("asyncrlhf.train_rm")
Pair = tuple[list[int], list[int]]  # token ids of prompt + chosen, prompt + rejected


def tokenize_pairs(rows: Sequence[dict], tokenizer, max_length: int) -> list[Pair]:
    """The reward scorer's input: the plain text `prompt + completion`, its last `max_length` tokens."""

    def encode(text: str) -> list[int]:
        return tokenizer(text)["input_ids"][-max_length:] or [tokenizer.pad_token_id]

    return [(encode(r["prompt"] + r["chosen"]), encode(r["prompt"] + r["rejected"])) for r in rows]


def pair_scores(model, pairs: Sequence[Pair], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) rewards of the chosen and of the rejected sides, in one forward pass."""
    ids, attention = right_pad([p[0] for p in pairs] + [p[1] for p in pairs], pad_id)
    device = next(model.parameters()).device
    rewards = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits[:, 0]
    return rewards[: len(pairs)], rewards[len(pairs) :]


@torch.no_grad()
def accuracy(model, pairs: Sequence[Pair], pad_id: int, batch_size: int) -> float | None:
    if not pairs:
        return None
    model.eval()
    right = 0.0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        _, acc = A.bradley_terry_loss(*pair_scores(model, chunk, pad_id))
        right += float(acc) * len(chunk)
    return right / len(pairs)


def split(pairs: list[Pair], fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    held = int(len(pairs) * fraction)
    return [pairs[i] for i in order[held:]], [pairs[i] for i in order[:held]]


def train(cfg: Config, model, pad_id: int, train_pairs: list[Pair], held_out: list[Pair]) -> dict:
    rc = cfg.rm
    engine = make_engine(
        model,
        cfg,
        lr=rc.lr,
        micro_batch_size=rc.micro_batch_size,
        total_steps=steps_per_run(len(train_pairs), rc.batch_size, rc.epochs),
    )
    engine.eval()
    losses: list[float] = []
    eval_batch = rc.micro_batch_size * 2
    for epoch, indices in step_batches(len(train_pairs), rc.batch_size, rc.epochs, cfg.run.seed):
        batch = [train_pairs[i] for i in indices]

        def micro_loss(chunk, batch=batch):
            loss, _ = A.bradley_terry_loss(
                *pair_scores(engine, [batch[i] for i in chunk], pad_id), denominator=len(batch)
            )
            return loss, {}

        losses.append(train_step(engine, list(range(len(batch))), rc.micro_batch_size, micro_loss)["loss"])
        if len(losses) % steps_per_run(len(train_pairs), rc.batch_size, 1) == 0:
            log.info(
                "epoch %d loss %.4f held-out accuracy %s",
                epoch,
                losses[-1],
                accuracy(engine.module, held_out, pad_id, eval_batch),
            )
    return {
        "steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "train_accuracy": accuracy(engine.module, train_pairs, pad_id, eval_batch),
        "heldout_accuracy": accuracy(engine.module, held_out, pad_id, eval_batch),
        "model": engine.module,
    }


def run(cfg: Config, log_: logging.Logger, flags: dict) -> int:
    rc, started = cfg.rm, time.time()
    torch.manual_seed(cfg.run.seed)
    data = rc.data or str(run_path(cfg, cfg.relabel.output))
    rows = read_records(data, ["prompt", "chosen", "rejected"])
    base = cfg.model.model_copy(update={"name_or_path": rc.base}) if rc.base else cfg.model
    tokenizer = load_tokenizer(base)
    model = load_score_model(base)
    pairs = tokenize_pairs(rows, tokenizer, rc.max_length)
    train_pairs, held_out = split(pairs, rc.eval_fraction, cfg.run.seed)
    if not train_pairs:
        raise StageError(
            f"no training pairs left in {data} after holding out rm.eval_fraction={rc.eval_fraction}"
        )
    result = train(cfg, model, model.config.pad_token_id, train_pairs, held_out)
    out = run_path(cfg, rc.output)
    result.pop("model").save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    summary = {
        "pairs": len(train_pairs),
        "heldout_pairs": len(held_out),
        **result,
        "seconds": time.time() - started,
        "output": str(out),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2))
    log_stage(cfg, "train-rm", **summary)
    print(json.dumps(summary))
    return 0


def main(argv: Sequence[str]) -> int:
    return run_stage(run, argv, "train-rm")
