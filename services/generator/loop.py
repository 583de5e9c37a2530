"""The generation loops' common ground, and the batch loop.

A loop reads prompt groups and writes one RolloutGroup per prompt. What a group is, is a `GroupKind`: k
single-turn samples (`services.generator.samples.SingleTurn`) or k episodes
(`services.generator.episodes.EpisodeGroups`). How the loop runs is batch mode (`BatchLoop`, here) or
continuous mode (`services.generator.continuous.ContinuousLoop`); both are given a `LoopContext`, and take
the steps every loop takes (admission, the wait for the first push, the pending gauge) from it.

Batch mode:

    read <= batch_prompts PromptGroups (consumer group `generators`) -> sample k each under the gate
    -> XADD the RolloutGroups and XACK the prompts in one atomic step

Nothing is generated before the first weight push (version 0 is "no version"), so every group carries the
version of weights the learner actually sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup
from asyncrlhf.config import Config
from asyncrlhf.cores import CoreShare
from asyncrlhf.sampling.continuous import GroupRun, SampleKind
from asyncrlhf.stalls import Wait
from asyncrlhf.streams import Consumer, Delivery, PartialStore, Producer
from services.generator.server import WeightSwap

log = logging.getLogger(__name__)

MAX_GROUP_SAMPLES = 256  # a larger k is a malformed entry, not a request to honour


def prompt_token_ids(prompt: PromptGroup, tokenizer, max_prompt_tokens: int) -> list[int]:
    """The ids to sample from: the group's own, else its text encoded (left-truncated). Raises ValueError
    for a prompt that cannot be sampled (empty, too long, or ids outside the vocabulary)."""
    ids = list(prompt.prompt_token_ids)
    if not ids and prompt.prompt:
        ids = tokenizer(prompt.prompt, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
    if not ids:
        raise ValueError(f"prompt group {prompt.group_id!r} has neither prompt_token_ids nor prompt text")
    if len(ids) > max_prompt_tokens:  # the learner never enqueues more; sampling it could exhaust memory
        raise ValueError(f"prompt group {prompt.group_id!r} has {len(ids)} prompt token ids, more than "
                         f"model.max_prompt_tokens={max_prompt_tokens}")
    vocab = len(tokenizer)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"prompt group {prompt.group_id!r} has token ids outside the vocabulary "
                         f"[0, {vocab}): {bad[:5]}")
    return ids


class Work(NamedTuple):
    """A group admitted to be sampled: its delivery, its prompt's ids and its k."""

    delivery: Delivery[PromptGroup]
    ids: list[int]
    k: int


def model_tokens(groups: Sequence[RolloutGroup]) -> int:
    """The model's tokens in `groups` (an episode's environment tokens, loss mask 0, are not sampled)."""
    return sum(sum(s.loss_mask) if s.loss_mask else len(s.completion_token_ids)
               for g in groups for s in g.samples)


@dataclass(frozen=True)
class PromptIO:
    """Where prompt groups come from (`consumer`; `pending`: how many wait) and rollouts go (`producer`);
    in continuous mode also where unfinished groups go back (`handon`: the prompts stream) and where samples
    in flight are saved (`partials`)."""

    consumer: Consumer[PromptGroup]
    producer: Producer[RolloutGroup]
    pending: Callable[[], int] = lambda: 0
    handon: Producer[PromptGroup] | None = None
    partials: PartialStore | None = None


class GroupKind(Protocol):
    """What a prompt group is to this generator: k single-turn samples or k episodes. Batch mode calls
    `generate`; continuous mode runs the library's kind (`continuous`) in its sampler and `observe`s the
    groups it writes."""

    noun: str  # what a group's k are, as the logs say it: "samples" or "episodes"

    def generate(self, work: list[Work]) -> list[RolloutGroup]:
        """Batch mode: each admitted group sampled, as the rollouts stream carries it (in `work`'s order).
        Raises when the backend fails (the loop retries the groups)."""

    def continuous(self) -> SampleKind[Any]:
        """Continuous mode: what one of a group's samples is, for the continuous sampler."""

    def observe(self, runs: Sequence[GroupRun[Any, Any]]) -> None:
        """Continuous mode: the metrics of groups about to be written."""

    def close(self) -> None:
        """Release what the kind holds beyond the service (episodes: their environments)."""


class Loop(Protocol):
    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set."""

    def step(self) -> int:
        """One round; the groups written."""

    def close(self) -> None:
        """Release what the loop holds beyond the service."""


class LoopContext:
    """What every loop is given (config, weights, streams, tokenizer, its id, this host's cores) and the steps
    every loop takes alike with it."""

    def __init__(self, cfg: Config, swap: WeightSwap, io: PromptIO, tokenizer, generator_id: str,
                 cores: CoreShare | None = None):
        """`swap`: the backend, its gate and metrics, and the version the weights are (`swap.served`)."""
        self.cfg, self.swap, self.io, self.tokenizer = cfg, swap, io, tokenizer
        self.backend, self.gate, self.metrics = swap.backend, swap.gate, swap.metrics
        self.generator_id = generator_id
        self.cores = cores  # this host's shared cores (asyncrlhf up on CPU), or fixed threads
        self._next_pending_check = 0.0

    def busy(self) -> AbstractContextManager[Any]:
        """Hold this host's shared cores while computing (no-op with fixed threads)."""
        return self.cores.busy() if self.cores else nullcontext()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def admit(self, deliveries: list[Delivery[PromptGroup]]) -> list[Work]:
        """The groups that can be sampled; the others are dead-lettered."""
        work: list[Work] = []
        for d in deliveries:
            try:
                k = d.message.k or self.cfg.generator.samples_per_prompt
                if k > MAX_GROUP_SAMPLES:
                    raise ValueError(f"prompt group {d.message.group_id!r} asks for k={k} samples, more than "
                                     f"{MAX_GROUP_SAMPLES}")
                ids = prompt_token_ids(d.message, self.tokenizer, self.cfg.model.max_prompt_tokens)
                work.append(Work(d, ids, k))
            except ValueError as err:
                log.warning("dead-lettering a prompt that cannot be sampled: %s", err)
                self.io.consumer.dead_letter(d, str(err))
        return work

    def no_weights_yet(self, wait: Callable[[float], object]) -> bool:
        """Nothing is generated before the first push: `wait` a little for it (counted as idle)."""
        if self.backend.version != 0:
            return False
        start = time.monotonic()
        self.metrics.waiting.wait(Wait.WEIGHTS)
        wait(self.cfg.redis.block_ms / 1000)
        self.metrics.idle_seconds.inc(time.monotonic() - start)
        return True

    def update_pending(self) -> None:
        """The prompts-pending gauge, at most once a second."""
        now = time.monotonic()
        if now >= self._next_pending_check:
            self._next_pending_check = now + 1.0
            self.metrics.prompts_pending.set(self.io.pending())


class BatchLoop:
    """Batch mode: `batch_prompts` groups at a time, written when the batch's last sample (or episode) ends;
    a push lands between two batches (or between two model turns of episodes), under the gate."""

    def __init__(self, ctx: LoopContext, kind: GroupKind):
        self.ctx, self.kind = ctx, kind

    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set; the batch in progress finishes first."""
        while not stop.is_set():
            self.step()

    def close(self) -> None:
        self.kind.close()

    def step(self) -> int:
        """One read-generate-write round; returns the groups written (0 when idle)."""
        ctx, metrics = self.ctx, self.ctx.metrics
        ctx.update_pending()
        start = time.monotonic()
        if ctx.no_weights_yet(ctx.swap.arrived.wait):
            return 0
        deliveries = ctx.io.consumer.read(ctx.cfg.generator.batch_prompts)
        if not deliveries:
            metrics.waiting.wait(Wait.PROMPTS)
            metrics.idle_seconds.inc(time.monotonic() - start)
            return 0
        metrics.waiting.work()
        return self._generate(deliveries)

    def _generate(self, deliveries: list[Delivery[PromptGroup]]) -> int:
        ctx, metrics = self.ctx, self.ctx.metrics
        work = ctx.admit(deliveries)
        if not work:
            return 0
        start = time.perf_counter()
        try:
            groups = self.kind.generate(work)
        except Exception as err:  # a failing batch must not kill the service; its prompts are retried
            log.exception("batch of %d groups (%s) failed", len(work), self.kind.noun)
            for w in work:
                ctx.io.consumer.fail(w.delivery, f"{type(err).__name__}: {err}")
            metrics.failed_groups.inc(len(work))
            return 0
        seconds = time.perf_counter() - start
        ctx.io.consumer.ack([w.delivery for w in work], groups, to=ctx.io.producer)
        tokens = model_tokens(groups)
        metrics.tokens.inc(tokens)
        metrics.written_tokens.inc(tokens)
        metrics.groups.inc(len(groups))
        metrics.batch_seconds.observe(seconds)
        metrics.tokens_per_second.set(tokens / seconds if seconds > 0 else 0.0)
        return len(groups)
