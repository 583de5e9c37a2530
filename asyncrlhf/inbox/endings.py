"""Where a group ends for the learner: trained, dropped, filtered or dead-lettered, each in one place.

An ending is its consumed-log row (fsynced first), the ack of its entries, its metric, and its credits,
released under one token per ending, so a retried release frees them once. A trained step's credits wait
for its push: they are held (`unreleased`) until `release_trained`. Dead-lettered groups of this run end
here too, as the learner finds them in the dead-letter stream (`reap_dead_letters`). What a trained row
records beyond the ids is `trained_row`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncrlhf.consumed import Kind
from asyncrlhf.inbox.feed import PromptFeed
from asyncrlhf.inbox.metrics import InboxMetrics
from asyncrlhf.inbox.recovery import Recovery
from asyncrlhf.inbox.strategy import StepBatch
from asyncrlhf.streams import DEAD_LETTER, FLOW, LEARNER_DEAD_LETTER_CURSOR, Delivery, RunStreams
from asyncrlhf.streams.consumer import Consumer


class Endings:
    def __init__(self, streams: RunStreams, consumer: Consumer, feed: PromptFeed, recovery: Recovery,
                 metrics: InboxMetrics, lineage: int):
        self.streams, self.client, self.consumer, self.feed = streams, streams.client, consumer, feed
        self.recovery, self.metrics, self.lineage = recovery, metrics, lineage
        self.consumed = recovery.consumed  # the log every ending is written to first
        self.unreleased: list[str] = []  # trained, credits freed by `release_trained` after the push
        self._dlq_cursor_key = streams.key(LEARNER_DEAD_LETTER_CURSOR)

    def end(self, kind: Kind, version: int, group_ids: list[str], acked: Sequence[Delivery] = (),
            **row) -> None:
        """The one place groups end (trained, dropped, filtered, dead-lettered): the consumed-log row (fsynced
        first), the ack of `acked`, the metric, and the credits, released under one token per ending (a
        trained step's after its push, by `release_trained`)."""
        self.consumed.append(kind, version, group_ids, **row)
        self.recovery.retrain.difference_update(group_ids)
        if acked:
            self.consumer.ack(list(acked))
        self.metrics.groups.labels(kind).inc(len(group_ids))
        if kind is Kind.TRAINED:
            self.unreleased = list(group_ids)
        else:
            self._free(kind, group_ids)

    def release_trained(self) -> None:
        """Free the credits of the trained step (held since `end`) once its push completed."""
        self._free(Kind.TRAINED, self.unreleased)
        self.unreleased = []

    def reap_dead_letters(self, version: int) -> None:
        """Dead-lettered groups of this run will never arrive: they end, freeing their credits."""
        cursor = self.client.get(self._dlq_cursor_key)
        # redis-py's stub says bytes | str; without decode_responses GET returns bytes
        entries = self.streams.dead_letters(count=1000, after=cursor)  # type: ignore[arg-type]
        if not entries:
            return
        streams = {spec.name for spec, _ in FLOW}
        lost = [d.identity for d in entries
                if d.stream in streams and d.identity not in self.consumed.ids
                and self.feed.enqueued(d.identity)]
        lost = list(dict.fromkeys(lost))  # one group dead-lettered twice (two copies) ends once
        if lost:
            self.end(Kind.DEAD_LETTERED, version, lost)
        self.client.set(self._dlq_cursor_key, entries[-1].entry_id)
        self.metrics.dead_letters.set(self.client.xlen(self.streams.key(DEAD_LETTER)))

    def _free(self, kind: Kind, group_ids: list[str]) -> None:
        """Count the groups finished and free their credits, once per token (see `PromptCredits.release`): the
        ending's kind, the lineage and its first group id, since each group ends once per lineage."""
        if group_ids:
            token = f"{kind}:{self.lineage}:{group_ids[0]}"
            self.metrics.in_flight.set(self.feed.credits.release(len(group_ids), token,
                                                                 finished_key=self.recovery.finished_key))


def trained_row(batch: StepBatch) -> dict:
    """What a trained row records beyond the ids: each group's staleness, and its continued samples."""
    row: dict = {"staleness": [s.staleness for s in batch.decisions]}
    if continued := continued_of(batch):
        row["continued"] = continued
    return row


def continued_of(batch: StepBatch) -> dict[str, list[int]]:
    """Group id -> [samples continued from tokens sampled elsewhere, those tokens] for each group of `batch`
    that has any (continuous generation after a hand-on or a save): what the audit counts as continued."""
    out = {}
    for d in batch.deliveries:
        carried = [s.continued_from for s in d.message.samples if s.continued_from]
        if carried:
            out[d.identity] = [len(carried), sum(carried)]
    return out
