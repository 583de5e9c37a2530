"""A stand-in for generator + reward in learner tests: a real WeightSync receiver (the learner pushes to it
over gRPC and it heart-beats in the registry), and a thread that turns each prompt into a scored group
tagged with the version it holds. Completions are a deterministic function of the group id, so the same
groups can be rebuilt to feed the synchronous path. With `spanning=True` it stands in for continuous
generation: a group is finished once a push has landed since it was read (or after `HOLD_S`, when the learner
needs it before it can push again), its first tokens tagged with the version held when it was read and the
rest with the version held when it ends, so its samples span versions (`Sample.token_versions`)."""

from __future__ import annotations

import hashlib
import threading
import time

import redis
import torch

from asyncrlhf._proto.rollout_pb2 import FINISH_REASON_STOP, PromptGroup, RolloutGroup, Sample
from asyncrlhf.config import Config
from asyncrlhf.models import load_policy
from asyncrlhf.registry import Heartbeat, Registry
from asyncrlhf.streams import GENERATOR_GROUP, PROMPTS, SCORED, Delivery, RunStreams
from asyncrlhf.weights import ModuleTarget, WeightReceiver, serve

# Spanning: the longest a group waits for a push before it ends under the version it started. A background
# push frees the next window's prompts as it lands, so a group read then waits a whole training step (and
# the publish) for the next push: longer than that on a loaded host, or no group would span one.
HOLD_S = 3.0


def spanning_group(prompt: PromptGroup, started: int, ended: int) -> RolloutGroup:
    """The scored group as continuous generation leaves it: each sample's first half of tokens sampled by
    `started`, the rest by `ended`; the group's policy_version is the oldest, `started`."""
    group = scored_group(prompt, started)
    for sample in group.samples:
        n = len(sample.completion_token_ids)
        sample.token_versions.extend([started] * (n // 2) + [ended] * (n - n // 2))
    return group


def scored_group(prompt: PromptGroup, version: int) -> RolloutGroup:
    seed = int(hashlib.sha256(prompt.group_id.encode()).hexdigest(), 16) % (2**31)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(prompt.k):
        length = int(torch.randint(2, 6, (1,), generator=g))
        ids = torch.randint(3, 259, (length,), generator=g).tolist()
        reward = float(torch.rand((), generator=g))
        samples.append(Sample(completion_token_ids=ids, logprobs=[-2.0] * length,
                              finish_reason=FINISH_REASON_STOP, reward=reward))
    return RolloutGroup(group_id=prompt.group_id, prompt=prompt, samples=samples, policy_version=version,
                        generator_id="actor", generated_at=time.time())


class Actor:
    def __init__(self, cfg: Config, redis_url: str, *, version_offset=lambda group_id: 0,
                 answers=lambda version: True, spanning: bool = False, tied=lambda group_id: False):
        self.cfg = cfg
        self.client = redis.Redis.from_url(redis_url)
        self.streams = RunStreams(self.client, cfg.run.name, cfg.redis)
        self.model = load_policy(cfg.model, lora=cfg.learner.lora)
        names = [n for n in self.model.state_dict() if "lora_" in n] if cfg.learner.lora.enabled else None
        self.receiver = WeightReceiver(ModuleTarget(self.model, names))
        self.server, port = serve(self.receiver, "127.0.0.1", 0)
        self.heartbeat = Heartbeat(Registry(self.client, cfg.run.name, ttl_s=5), "actor", f"127.0.0.1:{port}",
                                   lambda: self.receiver.version, period_s=0.2).start()
        self.version_offset = version_offset
        self.answers = answers  # whether it answers prompts now, holding weights of `version`
        self.tied = tied  # whether a group's samples all get the same reward (no signal: dynamic sampling)
        self.prompts: dict[str, PromptGroup] = {}  # every prompt group it answered, by id
        self.generated_by: dict[str, int] = {}  # the version each group was tagged with, by id
        self.spanning = spanning
        self.token_versions: dict[str, list[list[int]]] = {}  # spanning: each sample's token versions, by id
        self._started: list[tuple[Delivery, int, float]] = []  # spanning: groups read, the version, when
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Actor:
        self.thread.start()
        return self

    def _run(self) -> None:
        consumer = self.streams.consumer(PROMPTS, GENERATOR_GROUP, "actor")
        out = self.streams.producer(SCORED)
        while not self.stop.is_set():
            step = self.receiver.version.step
            if step < 1 or not self.answers(step):  # no weights yet
                time.sleep(0.02)
                continue
            deliveries = consumer.read(8, block_ms=50)
            version = self.receiver.version.step  # read again: a push may land while the read blocks
            if self.spanning:
                self._finish_round(consumer, out, deliveries, version)
                continue
            groups = [scored_group(d.message, max(0, version - self.version_offset(d.identity)))
                      for d in deliveries]
            self._emit(consumer, out, deliveries, groups)

    def _finish_round(self, consumer, out, deliveries, version: int) -> None:
        """Spanning: end the groups a push reached since they started (or held `HOLD_S`), start these."""
        now = time.monotonic()
        done = [(d, at, t) for d, at, t in self._started if version > at or now - t > HOLD_S]
        self._started = [s for s in self._started if s not in done] + [(d, version, now) for d in deliveries]
        if done:
            groups = [spanning_group(d.message, at, version) for d, at, _ in done]
            self.token_versions.update({g.group_id: [list(s.token_versions) for s in g.samples]
                                        for g in groups})
            self._emit(consumer, out, [d for d, _, _ in done], groups)

    def _emit(self, consumer, out, deliveries, groups: list[RolloutGroup]) -> None:
        for g in groups:
            if self.tied(g.group_id):
                for sample in g.samples:
                    sample.reward = 0.5
        consumer.ack(deliveries, groups, to=out)
        self.prompts.update({d.identity: d.message for d in deliveries})
        self.generated_by.update({g.group_id: g.policy_version for g in groups})

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():  # also closes an actor that was never started
            self.thread.join(timeout=5)
        self.heartbeat.stop()
        self.server.stop(0)
