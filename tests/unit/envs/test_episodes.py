"""Episodes on the tiny model's real HF backend: exact token bookkeeping across turns, environment tokens
masked out of every loss, and environments that fail ending only their own episode."""

from __future__ import annotations

import itertools

import pytest
import torch

from asyncrlhf import algorithms as A
from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.chat_format import observation_text
from asyncrlhf.config import load_config
from asyncrlhf.envs.episode import EpisodeLimits, EpisodeRunner
from asyncrlhf.envs.rollouts import episode_group
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.sampling import Completion, create_backend
from asyncrlhf.training.batch import TrainGroup, build_batch, validate_group
from asyncrlhf.training.objectives import OBJECTIVES, Totals, make_objective
from asyncrlhf.version import PolicyVersion
from tests.unit.envs import scripted
from tests.unit.generator.peaked import peaked_state_dict

pytestmark = pytest.mark.unit
LIMITS = EpisodeLimits(max_turns=4, max_episode_tokens=200, max_turn_tokens=6, step_timeout_s=2.0,
                       max_positions=512)


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(["configs/tiny.yaml"], ["generator.device=cpu"])
    tokenizer = load_tokenizer(cfg.model)
    backend = create_backend(cfg, tokenizer)
    backend.apply_weights(load_policy(cfg.model).state_dict(), version=PolicyVersion(0, 3))
    return cfg, tokenizer, backend


class Recorder:
    """The backend's turns, as the generator calls it, and every completion it returned."""

    def __init__(self, cfg, backend):
        self.cfg, self.backend, self.turns = cfg, backend, []

    def __call__(self, contexts, max_tokens):
        sampling = self.cfg.generator.sampling.model_copy(update={"max_new_tokens": max_tokens})
        out = [group[0] for group in self.backend.generate(contexts, 1, sampling)]
        self.turns.append((contexts, out))
        return out, self.backend.version


def run(tiny, env_cls, prompts=("hi",), k=2):
    cfg, tokenizer, backend = tiny
    recorder = Recorder(cfg, backend)
    groups = EpisodeRunner(tokenizer, env_cls, LIMITS).run([(p, None) for p in prompts], k, recorder)
    return groups, recorder


def test_trained_ids_are_the_sampled_ids_across_turns(tiny):
    """Every model token the learner trains on is an id the backend sampled, in order, with its log-prob
    and version; between turns sit the observations' ids, tokenised once; nothing is re-tokenised."""
    _, tokenizer, _ = tiny
    (episodes,), recorder = run(tiny, scripted.Counter)
    assert [e.turns for e in episodes] == [3, 3] and {str(e.end) for e in episodes} == {"done"}
    group = episode_group(PromptGroup(group_id="g", prompt="hi", k=2), episodes, PolicyVersion(0, 3), "gen",
                          0.0, 0.0, tokenizer.decode)
    for sample in group.samples:
        sample.reward = 0.0
    assert validate_group(group, 2) is None
    batch = build_batch([TrainGroup(group)], pad_id=tokenizer.pad_token_id)
    for j, sample in enumerate(group.samples):
        sampled = [recorder.turns[t][1][j] for t in range(3)]  # this episode's completion at each turn
        n = len(sample.completion_token_ids)
        ids, mask = batch.labels[j, :n].tolist(), batch.mask[j, :n].tolist()
        model_ids = [i for i, m in zip(ids, mask, strict=True) if m == 1]
        assert model_ids == [i for c in sampled for i in c.token_ids]
        model_lps = [lp for lp, m in zip(sample.logprobs, mask, strict=True) if m == 1]
        assert model_lps == pytest.approx([lp for c in sampled for lp in c.logprobs])
        assert set(sample.token_versions) == {3}
        # the episode's tokens, walked turn by turn: sampled ids, then (EOS closing a turn cut by length)
        # and the observation's ids, which are exactly what the next turn's context continued with
        walked, lead = [], batch.input_ids[j, -batch.completion_width - len(group.prompt.prompt_token_ids):]
        for t, c in enumerate(sampled):
            walked += c.token_ids
            if t < 2:
                closing = [] if c.finish == "stop" else [tokenizer.eos_token_id]
                obs = tokenizer(observation_text(tokenizer, [{"role": "tool", "content": f"obs {t + 1}"}]),
                                add_special_tokens=False)["input_ids"]
                walked += closing + obs
                assert recorder.turns[t + 1][0][j] == list(group.prompt.prompt_token_ids) + walked
        assert ids == walked and sample.turns == 3 and sample.env_reward == 1.0
        assert sum(mask) == sum(len(c.token_ids) for c in sampled) < n  # the observations are masked
        assert lead.numel() > 0


@pytest.mark.parametrize("algorithm", sorted(OBJECTIVES))
def test_environment_tokens_get_no_gradient(tiny, algorithm):
    """Each algorithm's loss, from the trainer's log-probs (token_logprobs * mask) of a real forward pass
    over an episode batch: the gradient reaches the logits that predict model tokens, and is exactly 0 at
    every position that predicts an environment token."""
    cfg, tokenizer, _ = tiny
    groups, _ = run(tiny, scripted.Counter, prompts=("hi",), k=2)
    group = episode_group(PromptGroup(group_id="g", prompt="hi", k=2), groups[0], PolicyVersion(0, 3), "gen",
                          0.0, 0.0, tokenizer.decode)
    for j, sample in enumerate(group.samples):
        sample.reward = float(j)
    rows = build_batch([TrainGroup(group)], pad_id=tokenizer.pad_token_id)
    learner_cfg = load_config(["configs/tiny.yaml"], [f"learner.algorithm={algorithm}"])
    objective = make_objective(learner_cfg)
    model = load_policy(cfg.model)
    width = rows.completion_width
    logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask,
                   position_ids=rows.position_ids).logits[:, -width - 1 : -1]
    logits.retain_grad()
    logps = A.token_logprobs(logits.float(), rows.labels, 1.0) * rows.mask
    frozen = logps.detach()
    rows = rows.with_extras(old_logps=frozen, ref_logps=frozen - 0.1 * rows.mask,
                            old_values=torch.zeros_like(frozen))
    rows = objective.prepare(rows)
    values = torch.zeros_like(frozen, requires_grad=True) if objective.needs_values else None
    totals = Totals(tokens=float(rows.mask.sum()), items=len(rows) // objective.unit)
    out = objective.loss(rows, logps, values, totals)
    (out.policy + (out.value if out.value is not None else 0.0)).backward()
    grad = logits.grad.abs().sum(-1)  # (B, T)
    env = (rows.mask == 0) & (rows.attention_mask[:, -width:] == 1)
    assert env.any() and grad[env].max().item() == 0.0
    assert grad[rows.mask == 1].sum().item() > 0


@pytest.mark.parametrize("env_cls, reason", [
    (scripted.Raises, "error: step raised RuntimeError: the sandbox died"),
    (scripted.Hangs, "timeout: step ran past task.env.step_timeout_s=2"),
    (scripted.Garbage, "malformed: step returned dict"),
    (scripted.BadObservation, "malformed: step returned int '42'"),
])
def test_a_failing_environment_ends_only_its_own_episode(tiny, env_cls, reason):
    """One prompt's environment fails at its first step; the other prompt's episodes run to the end."""
    made = itertools.count()

    def make():  # the first two environments (prompt 0's k episodes) fail, the others count to three
        return env_cls() if next(made) < 2 else scripted.Counter()

    cfg, tokenizer, backend = tiny
    recorder = Recorder(cfg, backend)
    bad, good = EpisodeRunner(tokenizer, make, LIMITS).run([("a", None), ("b", None)], 2, recorder)
    assert all(str(e.end).startswith(reason) for e in bad), [e.end for e in bad]
    assert all(e.turns == 1 and sum(e.loss_mask) == len(e.token_ids) for e in bad)  # its sampled turn kept
    assert [(str(e.end), e.turns, e.reward) for e in good] == [("done", 3, 1.0)] * 2


def test_the_environment_steps_of_a_turn_run_at_once(tiny):
    """Four episodes whose steps each wait for the other three (a barrier): they can only finish if the
    runner steps them concurrently, not one after another."""
    (episodes,), _ = run(tiny, scripted.Together, k=4)
    assert [(str(e.end), e.turns) for e in episodes] == [("done", 3)] * 4


def test_a_turn_cut_by_length_is_closed_by_a_masked_eos(tiny):
    """The peaked model never ends a turn by itself (it always says token 7): each turn is cut at
    max_turn_tokens and the EOS that closes it is the environment's, masked, not a sampled token."""
    cfg, tokenizer, backend = tiny
    backend.apply_weights(peaked_state_dict(load_policy(cfg.model), 7), version=PolicyVersion(0, 4))
    try:
        (episodes,), _ = run(tiny, scripted.Counter, k=1)
    finally:
        backend.apply_weights(load_policy(cfg.model).state_dict(), version=PolicyVersion(0, 5))
    (e,) = episodes
    assert e.turns == 3 and str(e.end) == "done"
    eos_at = [i for i, t in enumerate(e.token_ids) if t == tokenizer.eos_token_id]
    assert eos_at and all(e.loss_mask[i] == 0 for i in eos_at)
    assert [t for t, m in zip(e.token_ids, e.loss_mask, strict=True) if m] == [7] * 18


def test_a_budget_ends_the_episode_by_length(tiny):
    cfg, tokenizer, backend = tiny
    tight = EpisodeLimits(max_turns=8, max_episode_tokens=10, max_turn_tokens=6, step_timeout_s=2.0,
                          max_positions=512)
    (episodes,) = EpisodeRunner(tokenizer, scripted.Counter, tight).run([("hi", None)], 1,
                                                                        Recorder(cfg, backend))
    (e,) = episodes
    assert str(e.end) in ("length", "done") and len(e.token_ids) <= 10
    assert isinstance(e.completion(), Completion)


def test_packed_and_padded_agree_on_an_episode_batch(tiny):
    """Packing lays each row's real tokens end to end: an episode's environment tokens sit between its
    model tokens, so the packed forward must predict every completion position and mask as the padded does."""
    from asyncrlhf.training.forward import Packed, Padded

    cfg, tokenizer, _ = tiny
    groups, _ = run(tiny, scripted.Counter, k=2)
    group = episode_group(PromptGroup(group_id="g", prompt="hi", k=2), groups[0], PolicyVersion(0, 3), "gen",
                          0.0, 0.0, tokenizer.decode)
    for sample in group.samples:
        sample.reward = 0.0
    rows = build_batch([TrainGroup(group)], pad_id=tokenizer.pad_token_id)
    assert ((rows.mask == 0) & (rows.attention_mask[:, -rows.completion_width:] == 1)).any()
    model = load_policy(cfg.model).eval()
    with torch.no_grad():
        padded = Padded(4).logps(model, rows, 1.0)
        packed = Packed(4096).logps(model, rows, 1.0)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
