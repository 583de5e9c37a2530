"""`asyncrlhf sft --config X [overrides]`: supervised fine-tuning on prompt/completion pairs.

Data: `sft.data` (JSONL or a `datasets` directory with `sft.prompt_field` / `sft.completion_field`), or, when
unset, the seed's best-of-n data: `sft.best_of_n` samples of the base model per train prompt
(`generator.sampling`), the best by the gold reward (`evaluator.gold`) kept, written to
`<run.dir>/sft_data.jsonl`. Prompts get the chat template (as every other stage sees them); the loss is the
token-mean negative log-likelihood of the completion tokens only (EOS appended). With a tools task
(`task.env.kind: tools`) each prompt is rendered as an episode's first context, tools included: the data can
be tool calls (`configs/data/calculator_calls.jsonl`), a warm start for the episodes. Full fine-tuning or LoRA
(`sft.lora`, merged into the weights on save). Writes an HF directory (`sft.output`) that
`model.name_or_path` can point at.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from asyncrlhf import algorithms as A
from asyncrlhf.config import Config
from asyncrlhf.envs import base
from asyncrlhf.envs.episode import opening_ids
from asyncrlhf.envs.loading import EnvFactory
from asyncrlhf.models import encode_prompts, is_lora, load_policy, load_tokenizer, wrap_lora
from asyncrlhf.rewards import Item, build_reward
from asyncrlhf.sampling.offline import PolicySampler
from asyncrlhf.stages.common import (
    StageError,
    log_stage,
    read_records,
    run_path,
    run_stage,
    take,
    write_jsonl,
)
from asyncrlhf.tasks import load_task
from asyncrlhf.training.supervised import make_engine, right_pad, step_batches, steps_per_run, train_step

log = logging.getLogger("asyncrlhf.sft")
DATA_FILE = "sft_data.jsonl"


def gold_scorer(cfg: Config):
    """The gold reward alone (no proxy scorers, no missing-EOS penalty)."""
    only_gold = {"scorers": [cfg.evaluator.gold], "missing_eos_penalty": None}
    return build_reward(cfg.reward.model_copy(update=only_gold), cfg.model)


def best_of_n_data(cfg: Config, policy, tokenizer) -> list[dict]:
    """For each train prompt, the best of `sft.best_of_n` samples by the gold reward."""
    prompts = take(load_task(cfg.task).train, cfg.sft.num_prompts)
    sampler = PolicySampler(cfg, tokenizer, "hf", cfg.generator.device, cfg.generator.batch_prompts)
    samples = sampler.generate(
        policy,
        prompts,
        encode_prompts(tokenizer, prompts, cfg.model),
        cfg.sft.best_of_n,
        cfg.generator.sampling,
    )
    gold = gold_scorer(cfg)
    rows = []
    for prompt, group in zip(prompts, samples, strict=True):
        scores = gold.score([Item(prompt, g.completion) for g in group]).scores
        best = max(range(len(group)), key=lambda i: scores[i])
        rows.append({"prompt": prompt, "completion": group[best].completion, "gold_reward": scores[best]})
    return rows


def prompt_ids(cfg: Config, tokenizer, prompts: Sequence) -> list[list[int]]:
    """The prompts as the policy will see them: with a tools task (`task.env.kind: tools`), as an episode's
    first context (system prompt, question and the tools' signatures), so a warm start on tool calls trains
    on the very context its episodes begin with; otherwise through the chat template."""
    if cfg.task.env.kind != "tools":
        return encode_prompts(tokenizer, prompts, cfg.model)
    factory = EnvFactory(cfg.task.env)
    try:
        tools = base.tools_of(factory())
    finally:
        factory.close()
    system = cfg.model.system_prompt or ""
    return [opening_ids(tokenizer, [{"role": "user", "content": p}], tools, system) for p in prompts]


def tokenize(cfg: Config, tokenizer, rows: Sequence[dict]) -> list[tuple[list[int], int]]:
    """(prompt + completion + EOS ids, prompt length) per example, cut to `sft.max_length`."""
    sc = cfg.sft
    prompts = prompt_ids(cfg, tokenizer, [r[sc.prompt_field] for r in rows])
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for row, prompt in zip(rows, prompts, strict=True):
        completion = tokenizer(row[sc.completion_field], add_special_tokens=False)["input_ids"] + eos
        ids = (prompt + completion)[: sc.max_length]
        if len(ids) > len(prompt):
            out.append((ids, len(prompt)))
    if not out:
        raise StageError(f"no example has completion tokens within sft.max_length={sc.max_length}")
    return out


def completion_nll(
    model, examples: Sequence[tuple[list[int], int]], pad_id: int, denominator: float | None = None
) -> tuple[torch.Tensor, float]:
    """NLL of the completion tokens, summed / `denominator` (default: their count), and that count."""
    ids, attention = right_pad([e[0] for e in examples], pad_id)
    ids, attention = ids.to(model.device), attention.to(model.device)
    labels_mask = attention.clone()
    for row, (_, prompt_len) in enumerate(examples):
        labels_mask[row, :prompt_len] = 0
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    logps = A.token_logprobs(logits, ids[:, 1:])
    mask = labels_mask[:, 1:]
    return A.token_mean(-logps, mask, denominator), float(mask.sum())


def train(cfg: Config, policy, tokenizer, examples: list[tuple[list[int], int]]):
    sc = cfg.sft
    if sc.lora.enabled:
        policy = wrap_lora(policy, sc.lora)
    engine = make_engine(
        policy,
        cfg,
        lr=sc.lr,
        micro_batch_size=sc.micro_batch_size,
        total_steps=steps_per_run(len(examples), sc.batch_size, sc.epochs),
        lora=sc.lora,
    )
    engine.eval()  # dropout off: the model we save is the one the loss describes
    losses = []
    for epoch, indices in step_batches(len(examples), sc.batch_size, sc.epochs, cfg.run.seed):
        batch = [examples[i] for i in indices]
        tokens = float(sum(len(ids) - p for ids, p in batch))

        def micro_loss(chunk, batch=batch, tokens=tokens):
            loss, _ = completion_nll(engine, [batch[i] for i in chunk], tokenizer.pad_token_id, tokens)
            return loss, {}

        stats = train_step(engine, list(range(len(batch))), sc.micro_batch_size, micro_loss)
        losses.append(stats["loss"])
        log.info("epoch %d step %d loss %.4f", epoch, len(losses), stats["loss"])
    return engine.module, losses


def save(model, tokenizer, out) -> None:
    if is_lora(model):
        model = model.merge_and_unload()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def run(cfg: Config, log_: logging.Logger, flags: dict) -> int:
    sc, started = cfg.sft, time.time()
    torch.manual_seed(cfg.run.seed)
    base = cfg.model.model_copy(update={"name_or_path": sc.base}) if sc.base else cfg.model
    tokenizer = load_tokenizer(base)
    policy = load_policy(base)
    if sc.data:
        rows = read_records(sc.data, [sc.prompt_field, sc.completion_field])
    else:
        rows = best_of_n_data(cfg.model_copy(update={"model": base}), policy, tokenizer)
        write_jsonl(cfg.run.path / DATA_FILE, rows)
        policy.requires_grad_(True)  # the sampler froze it
    examples = tokenize(cfg.model_copy(update={"model": base}), tokenizer, rows)
    model, losses = train(cfg, policy, tokenizer, examples)
    out = run_path(cfg, sc.output)
    save(model, tokenizer, out)
    summary = log_stage(
        cfg,
        "sft",
        examples=len(examples),
        steps=len(losses),
        first_loss=losses[0],
        last_loss=losses[-1],
        seconds=time.time() - started,
        output=str(out),
    )
    log_.info("SFT done: %s", summary)
    return 0


def main(argv: Sequence[str]) -> int:
    return run_stage(run, argv, "sft")
