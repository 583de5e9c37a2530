"""`learner.staleness_mode: bound`: a step takes admitted groups as they arrive; the credit bound keeps every
group within `max_staleness` versions of the learner by construction, and admission checks it again.

With `learner.dynamic_sampling` a group without reward signal is filtered as it is admitted: it ends at once,
so its credit is freed and the feed enqueues another prompt in its place while the step is still collecting
(the refill needs no new window, and in flight never exceeds the bound, so the staleness bound holds as
without it). The step reads on until it holds `groups_per_step` informative groups, or `refill_cap` of them
were filtered."""

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
        # filtered groups a step may read past (dynamic sampling); at least one, so a cap of 0 < x < 1 bites
        self.refill_cap = max(1, round(lc.dynamic_sampling.refill_cap * lc.groups_per_step))

    def enqueues(self, version: int) -> bool:
        return True

    def holding(self) -> Set[str]:
        return set(self._batch.ids())

    def collect(self, desk: Desk, version: int, stop: threading.Event,
                while_waiting: WhileWaiting) -> StepBatch | None:
        """Read scored groups until a step's worth is admitted. With dynamic sampling, a filtered group ends
        at once (its credit is freed, so the feed enqueues a refill within the bound) and the step reads on;
        at `refill_cap` filtered groups it stops filtering: it trains what it has, or, with nothing yet,
        fills up with the next groups as they come."""
        wanted = self.lc.groups_per_step
        batch = self._batch = StepBatch()
        train_what_it_has = False  # the cap was reached with informative groups in hand
        while len(batch.deliveries) < wanted and not train_what_it_has:
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
                verdict = desk.receive(delivery, version, held=frozenset(batch.ids()),
                                       filtering=not batch.capped)
                if verdict.action is Action.FILTER:
                    batch.filtered += 1
                    if batch.filtered == self.refill_cap:
                        batch.capped, train_what_it_has = True, bool(batch.deliveries)
                        self._log_cap(version, batch)
                elif verdict.action is Action.TRAIN and verdict.decision is not None:
                    batch.deliveries.append(delivery)
                    batch.decisions.append(verdict.decision)
            desk.keep(batch.deliveries)  # not re-claimed (nor dead-lettered as undeliverable) while we wait
        self._batch = StepBatch()
        return batch.sorted()

    def _log_cap(self, version: int, batch: StepBatch) -> None:
        has = len(batch.deliveries)
        then = (f"training the {has} informative groups it has" if has
                else "it stops filtering and fills up with the next groups")
        log.warning("step at version %d filtered %d groups (learner.dynamic_sampling.refill_cap %g x "
                    "groups_per_step %d): %s", version, batch.filtered, self.lc.dynamic_sampling.refill_cap,
                    self.lc.groups_per_step, then)

    def settle(self, desk: Desk, version: int, trained: int, stop: threading.Event,
               while_waiting: WhileWaiting) -> None:
        """Nothing to wait for: groups generated across a push are within the bound."""
