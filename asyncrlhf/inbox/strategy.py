"""How the inbox collects a step: the interface of its two strategies, and what they see of the inbox.

`Bounded` (`learner.staleness_mode: bound`) takes admitted groups as they come, within the credit bound.
`Windowed` (`exact`, `paper`) holds groups back until the step that their generating version is due.
A strategy reads and waits; the inbox admits, ends groups and keeps house (`Desk`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Protocol

from asyncrlhf.algorithms import StalenessDecision
from asyncrlhf.inbox.admission import Verdict
from asyncrlhf.streams import Delivery
from asyncrlhf.training.batch import TrainGroup

WhileWaiting = Callable[[], None]


@dataclass
class StepBatch:
    """The deliveries of one step, each with the staleness decision that admitted it; with dynamic sampling,
    how many groups the step filtered (each refilled by a further group) and whether it reached the cap."""

    deliveries: list[Delivery] = field(default_factory=list)
    decisions: list[StalenessDecision] = field(default_factory=list)
    filtered: int = 0
    capped: bool = False

    def groups(self) -> list[TrainGroup]:
        return [TrainGroup(d.message, s) for d, s in zip(self.deliveries, self.decisions, strict=True)]

    def ids(self) -> list[str]:
        return [d.identity for d in self.deliveries]

    def sorted(self) -> StepBatch:
        """In group-id order, so a step's batch does not depend on arrival order."""
        order = sorted(range(len(self.deliveries)), key=lambda i: self.deliveries[i].identity)
        return StepBatch([self.deliveries[i] for i in order], [self.decisions[i] for i in order],
                         self.filtered, self.capped)


class Desk(Protocol):
    """The inbox as a strategy uses it."""

    @property
    def in_flight(self) -> int: ...

    @property
    def exhausted(self) -> bool: ...

    def tick(self, version: int, while_waiting: WhileWaiting) -> None: ...

    def read(self, n: int) -> list[Delivery]: ...

    def keep(self, deliveries: Sequence[Delivery]) -> None: ...

    def receive(self, delivery: Delivery, version: int, window: int | None = None,
                held: Set[str] = frozenset(), filtering: bool = True) -> Verdict: ...


class Strategy(Protocol):
    def enqueues(self, version: int) -> bool:
        """Whether prompts may be enqueued while `version` is current."""

    def holding(self) -> Set[str]:
        """Ids of groups admitted and not trained yet (present, though Redis may have lost their entries)."""

    def collect(self, desk: Desk, version: int, stop: threading.Event,
                while_waiting: WhileWaiting) -> StepBatch | None:
        """A step's worth of admitted groups; None when stopped or the prompt set is exhausted."""

    def settle(self, desk: Desk, version: int, trained: int, stop: threading.Event,
               while_waiting: WhileWaiting) -> None:
        """Before the push of the version after `version` (`trained` groups trained, their credits not yet
        freed)."""
