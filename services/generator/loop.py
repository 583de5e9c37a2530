"""The generation loop: prompt groups in, one RolloutGroup per prompt out, weights swapped between batches.

    read <= batch_prompts PromptGroups (consumer group `generators`) -> sample k each under the gate
    -> XADD the RolloutGroups and XACK the prompts in one atomic step

Nothing is generated before the first weight push (version 0 is "no version"), so every group carries the
version of weights the learner actually sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import groupby

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup
from asyncrlhf.config import Config
from asyncrlhf.cores import CoreShare
from asyncrlhf.sampling import Completion
from asyncrlhf.sampling.rollouts import rollout_group
from asyncrlhf.stalls import Wait
from asyncrlhf.streams import Consumer, Delivery, PartialStore, Producer
from asyncrlhf.version import PolicyVersion
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


Work = tuple[Delivery[PromptGroup], list[int], int]  # a group to sample: its delivery, prompt ids and k


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


class GeneratorLoop:
    def __init__(self, cfg: Config, swap: WeightSwap, io: PromptIO, tokenizer, generator_id: str,
                 cores: CoreShare | None = None):
        """`swap`: the backend, its gate and metrics, and the version the weights are (`swap.served`)."""
        self.cfg, self.swap, self.tokenizer = cfg, swap, tokenizer
        self.backend, self.gate, self.metrics = swap.backend, swap.gate, swap.metrics
        self.consumer, self.producer, self.pending = io.consumer, io.producer, io.pending
        self.generator_id = generator_id
        self._next_pending_check = 0.0
        self.cores = cores  # this host's shared cores (asyncrlhf up on CPU), or fixed threads

    def run(self, stop: threading.Event) -> None:
        """Step until `stop` is set; the batch in progress finishes first."""
        while not stop.is_set():
            self.step()

    def close(self) -> None:
        """Release what the loop holds beyond the service (episode loops: their environments)."""

    def step(self) -> int:
        """One read-generate-write round; returns the groups written (0 when idle)."""
        self._update_pending()
        start = time.monotonic()
        if self._no_weights_yet():
            return 0
        deliveries = self.consumer.read(self.cfg.generator.batch_prompts)
        if not deliveries:
            self.metrics.waiting.wait(Wait.PROMPTS)
            self.metrics.idle_seconds.inc(time.monotonic() - start)
            return 0
        self.metrics.waiting.work()
        return self._generate(deliveries)

    def _no_weights_yet(self) -> bool:
        """Nothing is generated before the first push: wait a little for it (counted as idle)."""
        if self.backend.version != 0:
            return False
        start = time.monotonic()
        self.metrics.waiting.wait(Wait.WEIGHTS)
        self._await_weights(self.cfg.redis.block_ms / 1000)
        self.metrics.idle_seconds.inc(time.monotonic() - start)
        return True

    def _await_weights(self, timeout_s: float) -> None:
        self.swap.arrived.wait(timeout_s)

    def _admit(self, deliveries: list[Delivery[PromptGroup]]) -> list[Work]:
        """(delivery, prompt ids, k) of each group that can be sampled; the others are dead-lettered."""
        work: list[Work] = []
        for d in deliveries:
            try:
                k = d.message.k or self.cfg.generator.samples_per_prompt
                if k > MAX_GROUP_SAMPLES:
                    raise ValueError(f"prompt group {d.message.group_id!r} asks for k={k} samples, more than "
                                     f"{MAX_GROUP_SAMPLES}")
                ids = prompt_token_ids(d.message, self.tokenizer, self.cfg.model.max_prompt_tokens)
                work.append((d, ids, k))
            except ValueError as err:
                log.warning("dead-lettering a prompt that cannot be sampled: %s", err)
                self.consumer.dead_letter(d, str(err))
        return work

    def _generate(self, deliveries: list[Delivery[PromptGroup]]) -> int:
        work = self._admit(deliveries)
        if not work:
            return 0
        started_at, start = time.time(), time.perf_counter()
        try:
            with self.gate.generating(), (self.cores.busy() if self.cores else nullcontext()):
                version, lineage = self.backend.version, self.swap.lineage  # both change under the gate only
                completions = self._sample(work)
        except Exception as err:  # a failing batch must not kill the service; its prompts are retried
            log.exception("generation batch of %d groups failed", len(work))
            for d, _, _ in work:
                self.consumer.fail(d, f"{type(err).__name__}: {err}")
            self.metrics.failed_groups.inc(len(work))
            return 0
        seconds, generated_at = time.perf_counter() - start, time.time()
        groups = [rollout_group(d.message, c, PolicyVersion(lineage, version), self.generator_id,
                                started_at, generated_at, self._decode)
                  for (d, _, _), c in zip(work, completions, strict=True)]
        self.consumer.ack([d for d, _, _ in work], groups, to=self.producer)
        self._record(completions, seconds)
        return len(groups)

    def _sample(self, work: list[tuple[Delivery[PromptGroup], list[int], int]]) -> list[list[Completion]]:
        """Completions per work item, in order; one backend call per distinct k (usually just one)."""
        out: list[list[Completion] | None] = [None] * len(work)
        order = sorted(range(len(work)), key=lambda i: work[i][2])
        for k, same_k in groupby(order, key=lambda i: work[i][2]):
            idx = list(same_k)
            generated = self.backend.generate([work[i][1] for i in idx], k, self.cfg.generator.sampling)
            for i, comps in zip(idx, generated, strict=True):
                out[i] = comps
        return out  # type: ignore[return-value]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _record(self, completions: list[list[Completion]], seconds: float) -> None:
        tokens = sum(len(c.token_ids) for group in completions for c in group)
        self.metrics.tokens.inc(tokens)
        self.metrics.written_tokens.inc(tokens)
        self.metrics.groups.inc(len(completions))
        self.metrics.batch_seconds.observe(seconds)
        self.metrics.tokens_per_second.set(tokens / seconds if seconds > 0 else 0.0)

    def _update_pending(self) -> None:
        now = time.monotonic()
        if now >= self._next_pending_check:
            self._next_pending_check = now + 1.0
            self.metrics.prompts_pending.set(self.pending())
