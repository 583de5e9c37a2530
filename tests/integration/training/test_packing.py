"""Sequence packing (`learner.packing`): a packed step gives the padded step's loss and gradients, for every
algorithm, and no attention crosses a sample boundary in a packed row (real DeepSpeed on CPU, tiny model)."""

import pytest
import torch

from asyncrlhf import algorithms as A
from asyncrlhf.config import load_config
from asyncrlhf.models import ReferencePolicy, load_policy, load_score_model
from asyncrlhf.training import engine, varlen
from asyncrlhf.training.batch import build_batch
from asyncrlhf.training.forward import Packed, Padded
from asyncrlhf.training.objectives import make_objective
from asyncrlhf.training.packing import pack
from asyncrlhf.training.policies import LearnerModels
from asyncrlhf.training.trainer import Trainer
from tests.integration.learner.groups import scored_groups, train_groups

pytestmark = pytest.mark.integration

ALGORITHMS = ["online_dpo", "best_of_n", "rloo", "grpo", "dr_grpo", "reinforce_pp", "ppo"]


def step_with_grads(algorithm: str, packing: bool, lora: bool = False, attention: str = "varlen"
                    ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step on fixed groups (two of them importance-corrected), and the gradients it applied: read from
    the engines' parameters just before their optimizer steps."""
    cfg = load_config(["configs/tiny.yaml"], [
        f"learner.algorithm={algorithm}", "learner.micro_batch_size=3", f"learner.packing={packing}",
        "learner.pack_tokens=24", f"learner.pack_attention={attention}", "learner.stale_policy=tis",
        "learner.kl.coef=0.1",
        f"learner.lora.enabled={str(lora).lower()}"])
    engine.init_distributed()
    objective = make_objective(cfg)
    torch.manual_seed(0)  # LoRA's adapters start from the global generator: the same in both runs
    policy = engine.initialize(load_policy(cfg.model, lora=cfg.learner.lora), cfg.learner)
    reference = ReferencePolicy(policy.module if lora else load_policy(cfg.model))
    value = engine.initialize(load_score_model(cfg.model), cfg.learner) if objective.needs_values else None
    trainer = Trainer(cfg, LearnerModels(policy, reference, value),
                      objective=objective, pad_id=0)
    grads: dict[str, torch.Tensor] = {}
    for name, eng in (("policy", policy), ("value", value)):
        if eng is not None:
            eng.step = _recording(eng, name, grads)
    groups = scored_groups(5, 2 if algorithm in ("online_dpo", "best_of_n") else 3, seed=3,
                           logprob=-4.0)
    stats = trainer.train_step(train_groups(groups, [True, False, False, True, False]))
    return stats, grads


def _recording(eng, name: str, grads: dict[str, torch.Tensor]):
    step = eng.step

    def recorded(*args, **kwargs):
        grads.update({f"{name}.{n}": p.grad.detach().clone()
                      for n, p in eng.module.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    return recorded


@pytest.mark.parametrize("algorithm, lora, attention",
                         [(a, False, "varlen") for a in ALGORITHMS]
                         + [("online_dpo", True, "varlen"), ("rloo", False, "mask"), ("ppo", False, "mask")])
def test_packed_and_padded_steps_give_the_same_loss_and_gradients(algorithm, lora, attention):
    # with LoRA the reference is the policy with its adapters off (packed rows go through peft too)
    padded, padded_grads = step_with_grads(algorithm, packing=False, lora=lora)
    packed, packed_grads = step_with_grads(algorithm, packing=True, lora=lora, attention=attention)
    assert abs(packed["loss"] - padded["loss"]) <= 1e-5
    assert padded_grads.keys() == packed_grads.keys() and padded_grads
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert packed["padding_share"] == 0.0  # packed rows hold real tokens only
    assert padded["padding_share"] == pytest.approx(padded["padding_share_unpacked"])
    assert padded["padding_share"] > 0.2
    assert packed["tokens"] == padded["tokens"]


def packed_logits(model, batch, attention="varlen"):
    """(N, V) logits at the packed row's completion positions (as the learner computes them), and the row."""
    forward = Packed(10_000, attention)
    row = pack(batch)
    with torch.no_grad():
        out = model(input_ids=row.input_ids, position_ids=row.position_ids, logits_to_keep=row.predict_at,
                    **forward._attention(model, row)).logits[0]
    return out, row


@pytest.mark.parametrize("attention", ["varlen", "mask"])
def test_no_attention_crosses_a_sample_boundary_in_a_packed_row(attention):
    model = load_policy(load_config(["configs/tiny.yaml"]).model).eval()
    assert varlen.enable(model)  # the tiny model (Llama) takes the varlen path where asked
    groups = scored_groups(3, 2, seed=5)
    batch = build_batch(train_groups(groups), pad_id=0)
    logits, row = packed_logits(model, batch, attention)
    # every sample's logits in the packed row are its logits computed alone (one sample: nothing to mask)
    for b in range(len(batch)):
        alone, _ = packed_logits(model, batch.rows([b]), attention)
        torch.testing.assert_close(logits[row.grid_rows == b], alone, atol=1e-5, rtol=1e-5)
    # changing the tokens of the first sample changes no other sample's logits
    changed = build_batch(train_groups(groups), pad_id=0)
    first = changed.attention_mask[0].bool()
    changed.input_ids[0][first] = (changed.input_ids[0][first] + 7) % 250 + 3
    after, _ = packed_logits(model, changed, attention)
    others = row.grid_rows != 0
    torch.testing.assert_close(after[others], logits[others], atol=0, rtol=0)
    assert not torch.allclose(after[~others], logits[~others])
    # the mask itself: a token attends exactly to its own sample's tokens up to itself
    allowed = row.attention_mask(torch.float32)[0, 0] == 0
    same = row.segments[:, None] == row.segments[None, :]
    assert torch.equal(allowed, same & torch.ones_like(same).tril())


def test_packed_log_probs_land_on_the_completion_grid_as_padded_ones_do():
    model = load_policy(load_config(["configs/tiny.yaml"]).model).eval()
    batch = build_batch(train_groups(scored_groups(4, 3, seed=2)), pad_id=0)
    width = batch.completion_width
    with torch.no_grad():
        padded = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits[:, -width - 1 : -1]
    expected = A.token_logprobs(padded, batch.labels) * batch.mask
    logits, row = packed_logits(model, batch)
    packed = row.scatter(A.token_logprobs(logits, row.labels), batch.mask.shape)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=1e-5)


def test_a_model_switched_to_varlen_attention_still_runs_padded_rows_with_their_mask():
    """The varlen function is plain SDPA without packed boundaries: a padded pass after a packed one (the
    padded frozen pass of another run, the evaluator's) gives the logits it gave before the switch."""
    model = load_policy(load_config(["configs/tiny.yaml"]).model).eval()
    batch = build_batch(train_groups(scored_groups(3, 2, seed=4)), pad_id=0)

    def padded():
        with torch.no_grad():
            return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids).logits

    before = padded()
    assert varlen.enable(model)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(padded()[real], before[real], atol=1e-5, rtol=1e-5)


def test_a_model_outside_the_attention_interface_takes_the_mask():
    assert not varlen.enable(torch.nn.Linear(2, 2))


def _tiny(architecture: str):
    """A tiny random model of `architecture` whose attention is more than causal: a sliding window of 3 tokens
    (shorter than every sample here) on all layers (Mistral) or every other one (Gemma 2, gpt-oss), Gemma 2's
    softcaps on attention scores and final logits, gpt-oss's attention sinks (drawn away from 0, so they
    matter)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    shape = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3)
    torch.manual_seed(0)
    if architecture == "mistral":
        return MistralForCausalLM(MistralConfig(**shape)).eval()
    if architecture == "gemma2":
        softcaps = dict(attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
        return Gemma2ForCausalLM(Gemma2Config(**shape, **softcaps, query_pre_attn_scalar=8)).eval()
    model = GptOssForCausalLM(GptOssConfig(**shape, num_local_experts=2, num_experts_per_tok=1)).eval()
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    return model


@pytest.mark.parametrize("architecture", ["mistral", "gemma2", "gpt_oss"])
def test_packed_log_probs_keep_sliding_windows_softcaps_and_attention_sinks(architecture):
    """Packed log-probs equal the padded path's (the model's own attention: SDPA for Mistral, eager for the
    others) on both attention paths; a model switched to varlen still runs padded rows as before (Gemma 2's
    softcap made the switched model refuse them)."""
    model = _tiny(architecture)
    batch = build_batch(train_groups(scored_groups(3, 2, seed=5)), pad_id=0)
    assert batch.attention_mask.sum(dim=1).min() > 3  # the window cuts into every sample

    def padded():
        with torch.no_grad():
            return Padded(8).logps(model, batch, 1.0)

    expected = padded()
    for attention in ("mask", "varlen"):  # mask first: it must not rely on an earlier switch
        with torch.no_grad():
            packed = Packed(10_000, attention).logps(model, batch, 1.0)
        torch.testing.assert_close(packed, expected, atol=1e-5, rtol=1e-5, msg=attention)
    torch.testing.assert_close(padded(), expected, atol=1e-5, rtol=1e-5)
