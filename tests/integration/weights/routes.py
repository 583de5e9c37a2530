"""The routes of the contract suite, as the learner drives them, and the faults planted on their last hop.

A route is injected, never chosen by patching: `Direct(route)` is a pusher given the `Sender` its
registration makes (`RouteSpec.sender`, from the learner's config: `LEARNER`) and the route of last resort to
fall back to; `Relayed()` is a learner pushing to a fresh relaying generator whose relay forwards to the
generator under test. A `Fault` is planted by wrapping the last hop's sender (`Faulty`): in
the snapshot it sends (what a relay forwards), or in the messages of its PushWeights call.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.config import load_config
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import ClientAccess
from asyncrlhf.weights.codec import Snapshot, decode_chunk, encode_chunk
from asyncrlhf.weights.collective_sender import CollectiveSender, CollectiveTransfer
from asyncrlhf.weights.pusher import PushOutcome, RelayPlan, WeightPusher
from asyncrlhf.weights.relay import Relay
from asyncrlhf.weights.routes import SenderSettings, last_resort, spec_of
from asyncrlhf.weights.stream import StreamSender
from asyncrlhf.weights.vocabulary import Reason, Route
from tests.integration.weights.helpers import CHUNK, TOKEN, Generator

Messages = list[tuple[pb.WeightChunk, memoryview]]
BUCKET = 48 << 10  # the tiny model in several buckets, some tensors larger than one (a bucket of their own)


def _same(x):
    return x


@dataclass(frozen=True)
class Fault:
    """What a receiver must refuse with `reason`, planted in the snapshot or in the messages of a push."""

    reason: Reason
    name: str
    snapshot: Callable[[Snapshot], Snapshot] = _same
    messages: Callable[[Messages], Messages] = _same


class FaultyTransfer:
    def __init__(self, transfer, fault: Fault):
        self.transfer, self.fault = transfer, fault

    def send_weights(self, call, address, commit):
        def planted(requests):
            messages = self.fault.messages([decode_chunk(r) for r in requests])
            return call(iter([encode_chunk(h, d) for h, d in messages]))

        return self.transfer.send_weights(planted, address, commit)

    def close(self):
        self.transfer.close()


class Faulty:
    """A `Sender` that plants `fault` in what `sender` sends; `begun` counts its transfers."""

    def __init__(self, sender, fault: Fault):
        self.sender, self.fault, self.route, self.begun = sender, fault, sender.route, 0

    def accepts(self, address, status):
        return self.sender.accepts(address, status)

    def forget(self, address):
        self.sender.forget(address)

    def begin(self, push, targets):
        self.begun += 1
        return FaultyTransfer(self.sender.begin(self.fault.snapshot(push), targets), self.fault)

    def close(self):
        self.sender.close()


# the learner's config for every route's sender: the collective route on, the tiny model in several buckets
LEARNER = ["learner.collective=true", f"learner.collective_bucket_bytes={BUCKET}", "learner.device=cpu"]


def sender(route: Route, access: ClientAccess | None = None):
    """`route`'s learner end as its registration makes it, or None where this machine cannot take it."""
    settings = SenderSettings(access or ClientAccess(TOKEN), CHUNK, 30.0, load_config([], LEARNER))
    return spec_of(route).sender(settings)


class _Flipping(CollectiveTransfer):
    """Packs one byte of bucket 1 wrong: after the learner hashed the bucket, before it is broadcast."""

    def pack(self, bucket: int, out: np.ndarray) -> None:
        super().pack(bucket, out)
        if bucket == 1:
            out[5] ^= 0xFF


class FlippingSender(CollectiveSender):
    """A collective sender whose rounds broadcast bucket 1 with a byte other than the one it hashed."""

    def begin(self, push, targets):
        self.round_lock.acquire()
        return _Flipping(self, push, targets)


class Direct:
    """The learner pushes over `route` (its generators offer a data channel only on `Route.DATA`, weight
    groups only on `Route.COLLECTIVE`: joined by an engine's worker when `engine`; `ends`: their standing end
    of another route, by its name)."""

    def __init__(self, route: Route, engine: bool = False, **ends):
        self.route, self.engine, self.ends = route, engine, ends
        self.last: Faulty | None = None

    def generator(self) -> Generator:
        return Generator(data=self.route == Route.DATA, collective=self.route == Route.COLLECTIVE,
                         engine=self.engine, **self.ends)

    def push(self, gen: Generator, push: Snapshot, fault: Fault | None = None,
             token: str | None = TOKEN) -> PushOutcome:
        access = ClientAccess(token)
        made = sender(self.route, access)
        assert made is not None, f"the {self.route} route cannot be taken on this machine"
        if fault is not None:
            made = self.last = Faulty(made, fault)
        fallback = [StreamSender(CHUNK)] if self.route != last_resort() else []
        with WeightPusher(access, chunk_bytes=CHUNK, timeout_s=30, route_senders=[made, *fallback]) as by:
            (outcome,) = by.send(push, [gen.target_id])
        return outcome


class Recording(WeightPusher):
    """A relay's pusher that keeps the outcomes of what it forwarded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: list[PushOutcome] = []

    def send(self, push, targets, relay=None, routes=None):
        outcomes = super().send(push, targets, relay or RelayPlan(), routes)
        self.outcomes.extend(outcomes)
        return outcomes


class Relayed:
    """The learner pushes to a fresh generator that relays to the one under test; the relay's hop is the
    gRPC stream (the generator under test offers no data channel). The outcome is the relay's."""

    route = Route.RELAY

    def generator(self) -> Generator:
        return Generator(data=False)

    def push(self, gen: Generator, push: Snapshot, fault: Fault | None = None,
             token: str | None = TOKEN) -> PushOutcome:
        sender = StreamSender(CHUNK)
        relayed = Recording(ClientAccess(token), chunk_bytes=CHUNK, timeout_s=30, dtype=None,
                            route_senders=[Faulty(sender, fault) if fault is not None else sender])
        parent = Generator(seed=99, data=False, relay=Relay(relayed))
        try:
            with WeightPusher(ClientAccess(TOKEN), chunk_bytes=CHUNK, routes=(Route.STREAM,)) as learner:
                tree = RelayPlan({parent.target_id: [gen.target_id]}, 1)
                (first,) = learner.send(push, [parent.target_id], tree)
            assert first.status == "ok", first.detail
            deadline = time.monotonic() + 30
            while parent.relay.relaying:
                assert time.monotonic() < deadline, "the relay did not finish"
                time.sleep(0.01)
            (outcome,) = relayed.outcomes
            return outcome
        finally:
            parent.stop()


# --- faults: each changes one thing of a good push -------------------------------------------------------


def _runs(messages: Messages) -> list[list[int]]:
    """The indices of each tensor's messages, in order (the commit aside)."""
    runs: list[list[int]] = []
    for i, (header, _) in enumerate(messages):
        if header.commit:
            continue
        if not runs or messages[runs[-1][0]][0].name != header.name:
            runs.append([])
        runs[-1].append(i)
    return runs


def _each_of_tensor(messages: Messages, which: int, change: Callable[[pb.WeightChunk], None]) -> Messages:
    for i in _runs(messages)[which]:
        change(messages[i][0])
    return messages


def _rename(messages):
    return _each_of_tensor(messages, 0, lambda h: setattr(h, "name", "model.layers.9.mlp.up_proj.weight"))


def _reshape(messages):
    names = [messages[run[0]][0].name for run in _runs(messages)]
    q_proj = next(n for n, name in enumerate(names) if name.endswith("q_proj.weight"))
    return _each_of_tensor(messages, q_proj, lambda h: h.shape.__setitem__(slice(None), [32, 128]))


def _retype(messages):
    return _each_of_tensor(messages, 0, lambda h: setattr(h, "dtype", pb.DTYPE_INT32))


def _repeat_a_message(messages):
    last = _runs(messages)[0][-1]
    return [*messages[:last + 1], messages[last], *messages[last + 1:]]


def _send_a_tensor_twice(messages):
    first, second = _runs(messages)[:2]
    again = [messages[i] for i in first]
    return [*messages[:second[-1] + 1], *again, *messages[second[-1] + 1:]]


def _miscount(messages):
    messages[-1][0].tensor_count += 1
    return messages


def _leave_out_the_last_tensor(messages):
    left_out = set(_runs(messages)[-1])
    messages[-1][0].tensor_count -= 1
    return [m for i, m in enumerate(messages) if i not in left_out]


def _no_commit(messages):
    return messages[:-1]


def _stamped(step: int, lineage: int) -> Callable[[Messages], Messages]:
    def stamp(messages):
        for header, _ in messages:
            header.version, header.lineage = step, lineage
        return messages

    return stamp


def _wrong_checksum(push: Snapshot) -> Snapshot:
    tensors = list(push.tensors)
    t = tensors[1]
    tensors[1] = dataclasses.replace(t, checksum=xxhash.xxh3_64_intdigest(t.data) ^ 1)
    return dataclasses.replace(push, tensors=tensors)


SERVED = PolicyVersion(1, 1)  # what the generator under test serves before each refusal
REFUSALS = [
    Fault(Reason.UNKNOWN_TENSOR, "a tensor the model lacks", messages=_rename),
    Fault(Reason.SHAPE_MISMATCH, "another shape", messages=_reshape),
    Fault(Reason.DTYPE_MISMATCH, "an integer dtype", messages=_retype),
    Fault(Reason.BAD_OFFSET, "a message repeated", messages=_repeat_a_message),
    Fault(Reason.DUPLICATE_TENSOR, "a tensor sent twice", messages=_send_a_tensor_twice),
    Fault(Reason.TENSOR_COUNT, "a commit that miscounts", messages=_miscount),
    Fault(Reason.MISSING_TENSORS, "a tensor left out", messages=_leave_out_the_last_tensor),
    Fault(Reason.TRUNCATED, "no commit", messages=_no_commit),
    Fault(Reason.BAD_CHECKSUM, "a wrong checksum", snapshot=_wrong_checksum),
    Fault(Reason.STALE_VERSION, "the version served", messages=_stamped(SERVED.step, SERVED.lineage)),
    Fault(Reason.STALE_LINEAGE, "an older lineage", messages=_stamped(SERVED.step + 5, SERVED.lineage - 1)),
]


def _missing_segment(messages):
    for header, _ in messages:
        if header.shm_segment:
            header.shm_segment = "asyncrlhf-w-1-0123abcd"
    return messages


def _another_ticket(messages):
    second = _runs(messages)[1][0]
    messages[second][0].data_ticket = bytes(16)
    return messages


def _another_backend(messages):
    for header, _ in messages:
        if header.HasField("collective"):
            header.collective.backend = "mpi"
    return messages


# The refusals that make a route give way to the stream (`RouteSpec.fallbacks`), by route.
FALLING_BACK = {
    Route.COLLECTIVE: Fault(Reason.COLLECTIVE_UNAVAILABLE, "a backend the receiver does not offer",
                            messages=_another_backend),
    Route.SHM: Fault(Reason.SHM_UNAVAILABLE, "a segment the receiver cannot open", messages=_missing_segment),
    Route.DATA: Fault(Reason.CHANNEL_UNAVAILABLE, "a data connection never presented",
                      messages=_another_ticket),
}
