"""Episodes in the continuous engine (`generator.mode: continuous` with `task.env`) on a real vLLM engine (its
CPU build here): the token bookkeeping of batch episodes holds (trained ids are the sampled ids, turn after
turn; environment tokens masked; a version per token), a hung environment ends only its own episodes while
the engine finishes the others, and a stopped generator's partial episodes are continued by another from
their transcript, with their earlier tokens unchanged and a clean audit."""

from __future__ import annotations

import itertools
import time

import pytest

from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.audit import audit_run
from asyncrlhf.chat_format import observation_text
from asyncrlhf.envs.continuous import Episodes, Slot, episodes_of
from asyncrlhf.envs.episode import EpisodeLimits, EpisodeRunner
from asyncrlhf.envs.rollouts import episode_group
from asyncrlhf.models import load_policy, load_tokenizer
from asyncrlhf.sampling.continuous import ContinuousSampler, GroupPrompt
from asyncrlhf.sampling.vllm_stepping import VLLMStepEngine
from asyncrlhf.serving.gate import BackendGate
from asyncrlhf.streams import FEED_CURSOR, GENERATOR_GROUP, PROMPTS, ROLLOUTS, RunStreams
from asyncrlhf.training.batch import TrainGroup, build_batch, validate_group
from asyncrlhf.version import PolicyVersion
from services.generator.continuous import ContinuousLoop
from services.generator.episodes import EpisodeGroups
from services.generator.loop import LoopContext, PromptIO
from services.generator.metrics import GeneratorMetrics
from services.generator.server import WeightSwap
from tests.integration.vllm.helpers import vllm_config
from tests.unit.envs import scripted
from tests.unit.generator.peaked import perturbed_state_dict

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

LIMITS = EpisodeLimits(max_turns=4, max_episode_tokens=200, max_turn_tokens=6, step_timeout_s=10.0,
                       max_positions=256)
VERSION_EVERY = 4  # the version each engine step records changes every few steps (as pushes would)


class Recording:
    """The real step engine, with what each turn was asked to continue and what it sampled, by key."""

    def __init__(self, engine: VLLMStepEngine):
        self.engine, self.contexts, self.sampled = engine, {}, {}

    def add(self, key, prompt_ids, max_tokens, sampling):
        self.contexts[key] = list(prompt_ids)
        self.sampled[key] = []
        self.engine.add(key, prompt_ids, max_tokens, sampling)

    def step(self):
        deltas = self.engine.step()
        for d in deltas:
            self.sampled.setdefault(d.key, []).extend(d.token_ids)
        return deltas

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from asyncrlhf.sampling.vllm import VLLMBackend

    cfg = vllm_config(tmp_path_factory.mktemp("vllm-cache"), "generator.mode=continuous",
                      "generator.samples_per_prompt=2", "generator.sampling.max_new_tokens=6",
                      "task.env.kind=class", "task.env.path=tests/unit/envs/scripted.py:Counter",
                      "task.env.max_turns=4", "task.env.max_episode_tokens=200")
    tokenizer = load_tokenizer(cfg.model)
    backend = VLLMBackend.from_config(cfg, tokenizer)
    weights = perturbed_state_dict(load_policy(cfg.model), seed=31, scale=0.2)
    backend.apply_weights(weights, PolicyVersion(1, 1))
    driver = VLLMStepEngine(backend)
    backend.driver = driver
    yield cfg, tokenizer, backend, driver
    backend.close()


def episodes(engine, tokenizer, make_env, cfg, limits=LIMITS) -> ContinuousSampler[str, Slot]:
    """The continuous sampler of episodes in the environments `make_env` makes, as the loop runs it."""
    return ContinuousSampler(engine, Episodes(EpisodeRunner(tokenizer, make_env, limits)),
                             cfg.generator.sampling)


def run_all(sampler: ContinuousSampler, limit_s: float = 120) -> list:
    ended, steps, deadline = [], 0, time.monotonic() + limit_s
    while sampler.groups:
        assert time.monotonic() < deadline, "the episodes did not end"
        sampler.settle(0.05)
        ended += sampler.step(1 + steps // VERSION_EVERY)
        # every episode not ended is in the engine or waits on its environment: what fills the slots
        assert sampler.running_samples == sum(not s.ended for run in sampler.groups for s in run.samples)
        steps += 1
    return ended


def test_continuous_episodes_train_the_ids_they_sampled_with_environment_tokens_masked(engine):
    cfg, tokenizer, _, driver = engine
    recording = Recording(driver)
    sampler = episodes(recording, tokenizer, scripted.Counter, cfg)
    for i, prompt in enumerate(["hi", "a longer prompt than that"]):
        sampler.start(f"t{i}", f"g{i}", GroupPrompt(text=prompt), 2, lineage=1)
    ended = run_all(sampler)
    sampler.close()
    assert sorted(run.group_id for run in ended) == ["g0", "g1"]
    for run in ended:
        eps = episodes_of(run)
        assert [(str(e.end), e.turns, e.turn_rewards) for e in eps] == [("done", 3, [0.0, 0.0, 1.0])] * 2
        group = episode_group(PromptGroup(group_id=run.group_id, prompt=run.prompt.text, k=2), eps,
                              PolicyVersion(1, 1), "gen", 0.0, 0.0, tokenizer.decode)
        for sample in group.samples:
            sample.reward = 0.0
        assert validate_group(group, 2) is None
        batch = build_batch([TrainGroup(group)], pad_id=tokenizer.pad_token_id)
        for j, (sample, e) in enumerate(zip(group.samples, eps, strict=True)):
            # this episode's turns: the engine sequences whose context was exactly its tokens so far
            turns = [key for key in recording.contexts if key.startswith(f"{run.group_id}/{j}#")]
            assert len(turns) == 3
            n = len(sample.completion_token_ids)
            ids, mask = batch.labels[j, :n].tolist(), batch.mask[j, :n].tolist()
            sampled = [t for key in turns for t in recording.sampled[key]]
            assert [i for i, m in zip(ids, mask, strict=True) if m] == sampled
            walked = []
            for t, key in enumerate(turns):
                assert recording.contexts[key] == e.prompt_ids + walked  # as sampled, never re-tokenised
                walked += recording.sampled[key]
                if t < 2:
                    closing = [] if walked[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id]
                    text = observation_text(tokenizer, [{"role": "tool", "content": f"obs {t + 1}"}])
                    walked += closing + tokenizer(text, add_special_tokens=False)["input_ids"]
            lead = len(sample.completion_token_ids) - len(e.token_ids)
            assert ids[lead:] == walked and mask[:lead] == [0] * lead
            assert sum(mask) < n  # the observations are in the sequence, masked
            assert list(sample.turn_rewards) == [0.0, 0.0, 1.0] and sample.env_reward == 1.0
            assert [mask[end - 1] for end in sample.turn_ends] == [1, 1, 1]
            assert list(sample.token_versions) == sorted(sample.token_versions)  # one per token, in order
        assert len(group.samples[0].token_versions) == len(group.samples[0].completion_token_ids)


def test_a_hung_environment_ends_only_its_episodes_while_the_engine_finishes_the_others(engine):
    cfg, tokenizer, _, driver = engine
    limits = EpisodeLimits(max_turns=4, max_episode_tokens=200, max_turn_tokens=6, step_timeout_s=10.0,
                           max_positions=256)
    sampler = episodes(driver, tokenizer, scripted.Picky, cfg, limits)
    sampler.start("hung", "hang", GroupPrompt(text="hang"), 2, lineage=1)
    sampler.start("good", "good", GroupPrompt(text="fine"), 2, lineage=1)
    ended = run_all(sampler)
    sampler.close()
    assert [run.group_id for run in ended] == ["good", "hang"]  # the good group was not kept waiting
    good, hung = ended
    assert [(str(e.end), e.turns) for e in episodes_of(good)] == [("done", 3)] * 2
    assert all(str(e.end).startswith("timeout: step ran past") and e.turns == 1 for e in episodes_of(hung))


def test_a_group_whose_episode_cannot_open_fails_alone(engine):
    """Making the environment raises (not an environment's step failing, which ends only its episode): that
    group is handed back to the caller to retry, and the other goes on."""
    cfg, tokenizer, _, driver = engine
    made = itertools.count()

    def make():
        if next(made) < 2:
            raise OSError("the sandbox image is missing")
        return scripted.Counter()

    sampler = episodes(driver, tokenizer, make, cfg)
    sampler.start("bad", "bad", GroupPrompt(text="hi"), 2, lineage=1)
    sampler.start("good", "good", GroupPrompt(text="hi"), 2, lineage=1)
    ended = run_all(sampler)
    sampler.close()
    assert [run.group_id for run in ended] == ["good"]
    ((failed, reason),) = sampler.take_failed()
    assert failed.group_id == "bad" and reason == "OSError: the sandbox image is missing"


def test_an_episode_stopped_while_its_replay_runs_hands_its_transcript_on_again(engine):
    cfg, tokenizer, _, driver = engine
    first = episodes(driver, tokenizer, scripted.Counter, cfg)
    first.start("t", "g", GroupPrompt(text="hi"), 1, lineage=1)
    while not any(s.episode and s.episode.turns and s.turn.token_ids
                  for r in first.groups for s in r.samples):
        first.settle(0.05)
        first.step(1)
    (run,) = first.stop_all()
    first.close()
    handed = run.samples[0].partial()
    assert handed.turn_ends and handed.episode_context_ids
    second = episodes(driver, tokenizer, scripted.Opening, cfg)
    second.start("t", "g", GroupPrompt(text="hi"), 1, lineage=1, partial=[handed])
    (run,) = second.stop_all()  # stopped while the replay waits on the environment's reset
    try:
        assert run.samples[0].partial() == handed  # handed on again as it came, not lost
    finally:
        scripted.Opening.released.set()
        second.close()


def _loop(cfg, backend, driver, tokenizer, client, name):
    streams = RunStreams(client, cfg.run.name, cfg.redis)
    swap = WeightSwap(backend, BackendGate(), GeneratorMetrics(name))
    swap.served = PolicyVersion(1, 1)
    io = PromptIO(streams.consumer(PROMPTS, GENERATOR_GROUP, name), streams.producer(ROLLOUTS),
                  handon=streams.producer(PROMPTS), partials=streams.partials())
    ctx = LoopContext(cfg, swap, io, tokenizer, name)
    return ContinuousLoop(ctx, EpisodeGroups(ctx), driver)


def _stream(client, cfg, spec):
    from asyncrlhf.streams import PAYLOAD_FIELD, run_key

    return [spec.message_type.FromString(f[PAYLOAD_FIELD])
            for _, f in client.xrange(run_key(cfg.run.name, spec.name))]


def test_a_stopped_generators_partial_episodes_are_continued_by_another_with_a_clean_audit(
        engine, redis_client, redis_url, run_name, tmp_path):
    base, tokenizer, backend, driver = engine
    cfg = base.model_copy(update={
        "run": base.run.model_copy(update={"name": run_name, "dir": str(tmp_path)}),
        "redis": base.redis.model_copy(update={"url": redis_url, "block_ms": 50})})
    streams = RunStreams(redis_client, run_name, cfg.redis)
    streams.producer(PROMPTS).add(PromptGroup(group_id="g00000000", prompt="hi", k=2,
                                              enqueued_at=time.time()))
    redis_client.set(streams.key(FEED_CURSOR), 1)
    a = _loop(cfg, backend, driver, tokenizer, redis_client, "gen-a")
    deadline = time.monotonic() + 120
    # until an episode is into its second turn: a turn ended, its step returned, the next turn sampling
    while not any(s.episode and s.episode.turns >= 1 and s.turn.token_ids
                  for run in a.sampler.groups for s in run.samples):
        assert time.monotonic() < deadline
        a.step()
    run = a.sampler.groups[0]
    earlier = [(list(s.token_ids), [*(s.episode.loss_mask if s.episode else []),
                                    *[1] * len(s.turn.token_ids)]) for s in run.samples]
    assert a.hand_on() == 1  # what SIGTERM does
    a.sampler.close()
    handed = _stream(redis_client, cfg, PROMPTS)[-1]
    assert handed.handoffs == 1 and all(p.episode_context_ids for p in handed.partial_samples)
    assert audit_run(cfg, redis_client).ok  # handed on: in flight, not lost

    b = _loop(cfg, backend, driver, tokenizer, redis_client, "gen-b")
    while not _stream(redis_client, cfg, ROLLOUTS):
        assert time.monotonic() < deadline
        b.step()
    b.sampler.close()
    (rollout,) = _stream(redis_client, cfg, ROLLOUTS)
    continued = 0
    for sample, (ids, mask) in zip(rollout.samples, earlier, strict=True):
        # every episode opened alike (the group's prompt is their whole first context): no lead
        assert list(sample.completion_token_ids)[:len(ids)] == ids  # the earlier tokens, unchanged
        assert list(sample.loss_mask)[:len(mask)] == mask
        assert sample.episode_end == "done" and sample.turns == 3 and list(sample.turn_rewards) == [0, 0, 1]
        continued += sample.continued_from > 0
    assert continued >= 1 and b.metrics.continued_samples._value.get() >= 1
    audit = audit_run(cfg, redis_client)
    assert audit.ok and not audit.lost, audit.summary()


def test_a_killed_generators_episodes_are_continued_from_their_last_save(engine, redis_client, redis_url,
                                                                           run_name, tmp_path):
    """SIGKILL: nothing is handed on; the group stays pending, is re-claimed, and continues from the
    transcript saved every `save_every_tokens` (the tokens since the save are sampled again)."""
    base, tokenizer, backend, driver = engine
    save_every = 8
    cfg = base.model_copy(update={
        "run": base.run.model_copy(update={"name": run_name, "dir": str(tmp_path)}),
        "redis": base.redis.model_copy(update={"url": redis_url, "block_ms": 50, "claim_idle_ms": 200}),
        "generator": base.generator.model_copy(update={"save_every_tokens": save_every})})
    streams = RunStreams(redis_client, run_name, cfg.redis)
    streams.producer(PROMPTS).add(PromptGroup(group_id="g00000000", prompt="hi", k=2,
                                              enqueued_at=time.time()))
    redis_client.set(streams.key(FEED_CURSOR), 1)
    a = _loop(cfg, backend, driver, tokenizer, redis_client, "gen-a")
    deadline = time.monotonic() + 120
    while not any(s.episode and s.episode.turns >= 1 for run in a.sampler.groups for s in run.samples) \
            or a.sampler.groups[0].saved_tokens < save_every:
        assert time.monotonic() < deadline
        a.step()
    driver.abort(list(a.sampler._sequences))  # SIGKILL: nothing handed on, no ack
    a.sampler.close()

    (save,) = streams.partials().further([PromptGroup(group_id="g00000000")])
    saved = [len(p.completion_token_ids) if not p.finish_reason else 0 for p in save.partial_samples]
    assert sum(saved) >= save_every

    time.sleep(0.3)  # past claim_idle_ms: the entry is re-claimed from the dead consumer
    b = _loop(cfg, backend, driver, tokenizer, redis_client, "gen-b")
    while not _stream(redis_client, cfg, ROLLOUTS):
        assert time.monotonic() < deadline
        b.step()
    b.sampler.close()
    (rollout,) = _stream(redis_client, cfg, ROLLOUTS)
    assert [s.continued_from for s in rollout.samples] == saved  # every saved unfinished episode carried on
    assert all(s.episode_end == "done" for s in rollout.samples)
    assert audit_run(cfg, redis_client).ok
