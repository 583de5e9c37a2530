"""`learner.staleness_mode: bound`: a step takes admitted groups as they arrive; the credit bound keeps every
group within `max_staleness` versions of the learner by construction, and admission checks it again."""

from __future__ import annotations

import logging
import threading
from collections.abc import Set

from asyncrlhf.config.learner import LearnerBase
from asyncrlhf.inbox.admission import Action
from asyncrlhf.inbox.strategy import Desk, StepBatch, WhileWaiting

log = logging.getLogger("asyncrlhf.learner")


class Bounded:
    def __init__(self, lc: LearnerBase):
        self.lc = lc
        self._batch = StepBatch()  # the step being collected

    def enqueues(self, version: int) -> bool:
        return True

    def holding(self) -> Set[str]:
        return set(self._batch.ids())

    def collect(self, desk: Desk, version: int, stop: threading.Event,
                while_waiting: WhileWaiting) -> StepBatch | None:
        """Read scored groups until a step's worth is admitted."""
        wanted = self.lc.groups_per_step
        batch = self._batch = StepBatch()
        while len(batch.deliveries) < wanted:
            if stop.is_set():
                return None
            desk.tick(version, while_waiting)
            if desk.exhausted and desk.in_flight == 0 and not batch.deliveries:
                log.info("the prompt set is exhausted (learner.data_epochs=%d)", self.lc.data_epochs)
                return None
            for delivery in desk.read(wanted - len(batch.deliveries)):
                # an entry of this batch read again (a collect longer than redis.claim_idle_ms re-claims the
                # learner's own pending entries), or another entry of a group already in it: held, not
                # trained twice in one step (a chaos run under load trained g85 twice in one step)
                verdict = desk.receive(delivery, version, held=frozenset(batch.ids()))
                if verdict.action is Action.TRAIN and verdict.decision is not None:
                    batch.deliveries.append(delivery)
                    batch.decisions.append(verdict.decision)
            desk.keep(batch.deliveries)  # not re-claimed (nor dead-lettered as undeliverable) while we wait
        self._batch = StepBatch()
        return batch.sorted()

    def settle(self, desk: Desk, version: int, trained: int, stop: threading.Event,
               while_waiting: WhileWaiting) -> None:
        """Nothing to wait for: groups generated across a push are within the bound."""
