"""The collective route (`Route.COLLECTIVE`) received by an inference engine's worker itself: the worker (a
vLLM worker process, on its GPU) is the weight group's member, so a version goes from the learner to the
engine in one broadcast, never through the generator's process (the hop: `worker_round.py`).

Two halves, one per process:

- `WorkerRounds`, in the engine worker: it listens on a local socket (an abstract Unix socket, so no file;
  authenticated by a key the generator gave when it started it; `line.py`: a deadline on every message, so a
  stalled peer fails its own request and holds up no other) for the rounds the generator is pushed. For
  each it joins the round with a `CollectiveMember` of its own (`collective_member.py`: the same group,
  rendezvous and timeouts as a generator process), and copies every bucket as it is received into one
  staging buffer of the whole version (`StagedRound`), keeping the XXH3-64 of each bucket computed on it as
  received. At the commit, `take` checks each tensor's bucket checksum and the tensor's own XXH3-64 against
  what the learner sent over gRPC, and only then hands back the tensors: the worker loads nothing it has
  not verified, and a refused push leaves the old version serving.
- `EngineMember`, in the generator, in place of a `CollectiveMember`: `round(slot)` sends the slot to the
  worker and returns once the worker has said it is here. The receiver checks each tensor message as on
  every route (name, shape, dtype, order, version, token) and stages a placeholder (`staging.Elsewhere`,
  describing each tensor to the round). At the commit the receiver first waits, on the control line, until
  the worker has staged every bucket (`EngineRound.arrived`), and only then hands the push to the target,
  whose `apply_weights` takes the generator's engine (paused, in continuous mode) and asks the worker,
  through the hop (`worker_round.WorkerRound`), to verify and load the round (`held`: what it asks for):
  the engine waits for the load, never for the broadcast. A worker that does not answer in time fails that
  round (`collective_unavailable`: the pusher streams to the generator) and the line is dialled anew for
  the next.

The generator's receiver and the learner do not change: the learner sees one member per generator, and the
gRPC control, version order, token and refusals are those of every route. A push refused by the generator
before its commit still leaves the worker's round to drain (it receives every bucket whatever happens), so
it never stalls the others. One worker per engine (tensor parallelism 1): each member of a group is one
rank of the learner's broadcast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import AuthenticationError

import numpy as np
import torch
import xxhash
from google.protobuf.message import DecodeError

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.sampling.hops.line import LINE_S, Line, listener
from asyncrlhf.weights.codec import FROM_WIRE, nbytes_of
from asyncrlhf.weights.collective import JOIN_TIMEOUT_S
from asyncrlhf.weights.collective_member import CollectiveMember, MemberRound
from asyncrlhf.weights.routes import HeldBytes
from asyncrlhf.weights.vocabulary import PushRejected, Reason

log = logging.getLogger(__name__)

# (name, wire dtype, shape, bucket, offset in the bucket, tensor XXH3-64, bucket XXH3-64): one tensor of a
# round as the learner described it over gRPC; plain values, so it crosses vLLM's RPC as it is
Place = tuple[str, int, tuple[int, ...], int, int, int, int]
# A worker's refusal travels as text (vLLM's RPC re-raises a worker's error as its message): tagged with the
# `Reason`, which the generator reads back (`refusal`)
_TAG = re.compile(r"\[asyncrlhf-reason=([a-z_]+)\]")
TAKE_MARGIN_S = 5.0  # the worker waits for a round's last bucket this long beyond the group's timeout
# What the generator asks its worker over the control line (a kind byte, then the round's slot); the answer
# is empty (done) or the refusal's reason and message, NUL between
JOIN, ARRIVED = b"J", b"A"


def tagged(err: PushRejected) -> str:
    return f"[asyncrlhf-reason={err.reason.value}] {_message(err)}"


def _message(err: PushRejected) -> str:
    return str(err).removeprefix(f"{err.reason.value}: ")


def refusal(err: BaseException) -> PushRejected:
    """A worker's error, as it reached the generator, as the refusal it was (`collective_unavailable` when it
    names none: the worker failed)."""
    found = _TAG.search(str(err))
    reason = Reason(found.group(1)) if found else Reason.COLLECTIVE_UNAVAILABLE
    return PushRejected(reason, f"the engine's worker refused the round: {err}")


class StagedRound:
    """Every bucket of one round, copied as received into `stage` (the whole version), on a thread of its own
    (after the round before it: they share the buffer)."""

    def __init__(self, round_: MemberRound, stage: np.ndarray, previous: StagedRound | None):
        self.round, self.stage = round_, stage
        sizes = round_.sizes
        self.starts = tuple(int(s) for s in np.cumsum((0, *sizes[:-1]))) if sizes else ()
        self.checksums: list[int] = []
        self.error: PushRejected | None = None
        self._previous = previous
        self._done = threading.Event()
        threading.Thread(target=self._run, name="weight-engine-round", daemon=True).start()

    def _run(self) -> None:
        try:
            if self._previous is not None:
                self._previous.wait()
                self._previous = None
            for k, start in enumerate(self.starts):
                held, checksum = self.round.bucket(k)
                self.stage[start:start + held.size] = held
                self.checksums.append(checksum)
        except PushRejected as err:
            self.error = err
        finally:
            self.round.close()
            self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def settled(self) -> None:
        """Wait until every bucket is staged (the group's timeout and `TAKE_MARGIN_S` at most); raises
        `PushRejected` when they did not all arrive."""
        timeout = self.round.group.timeout_s + TAKE_MARGIN_S
        if not self.wait(timeout):
            raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE, f"round {self.round.slot.round}: the buckets "
                                                              f"did not all arrive within {timeout:.0f} s")
        if self.error is not None:
            raise self.error

    def tensors(self, places: Sequence[Place]) -> dict[str, torch.Tensor]:
        """The round's tensors, each checked (its bucket's XXH3-64 as received, then its own), as views of
        the staging buffer; raises `PushRejected` before returning any."""
        self.settled()
        out: dict[str, torch.Tensor] = {}
        for name, dtype, shape, k, offset, checksum, bucket_checksum in places:
            wire = FROM_WIRE.get(dtype)  # type: ignore[call-overload]  # an int, off the RPC
            if wire is None or k >= len(self.starts):
                raise PushRejected(Reason.BAD_OFFSET, f"`{name}`: bucket {k} or dtype {dtype} is not the "
                                                      "round's")
            nbytes = int(np.prod(shape, dtype=np.int64)) * wire.itemsize
            if offset + nbytes > self.round.sizes[k]:
                raise PushRejected(Reason.BAD_OFFSET, f"`{name}`: {nbytes} bytes at {offset} of bucket {k} "
                                                      "lie outside it")
            if self.checksums[k] != bucket_checksum:
                raise PushRejected(Reason.BAD_CHECKSUM,
                                   f"`{name}`: bucket {k} as the worker received it has XXH3-64 "
                                   f"{self.checksums[k]:#018x}, the learner packed {bucket_checksum:#018x}")
            data = self.stage[self.starts[k] + offset:self.starts[k] + offset + nbytes]
            got = xxhash.xxh3_64_intdigest(memoryview(data))  # type: ignore[arg-type]
            if got != checksum:
                raise PushRejected(Reason.BAD_CHECKSUM, f"`{name}`: XXH3-64 {got:#018x} in the worker, "
                                                        f"expected {checksum:#018x}")
            out[name] = torch.from_numpy(data).view(wire).reshape(shape) if nbytes else \
                torch.empty(shape, dtype=wire)
        return out


class WorkerRounds:
    """The engine worker's half (see the module): serves the generator's requests on `address`, each
    connection (its key challenge included) on a thread of its own, every message bounded by `LINE_S`."""

    def __init__(self, device: str, authkey: bytes):
        self.member = CollectiveMember(device)
        self.address = f"\0asyncrlhf-rounds-{os.getpid()}-{secrets.token_hex(8)}"  # abstract: no file
        self._authkey = authkey
        self._listener = listener(self.address)
        self._last: StagedRound | None = None  # the round joined last: the only one a commit may take
        self._stage = np.empty(0, dtype=np.uint8)
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, name="weight-engine-rounds", daemon=True).start()

    @property
    def backends(self) -> tuple[str, ...]:
        return self.member.backends

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(Line(sock),), name="weight-engine-rounds-conn",
                             daemon=True).start()

    def _answer(self, line: Line) -> None:
        with line:
            try:
                line.accepted(self._authkey)
            except (OSError, EOFError, AuthenticationError) as err:  # a stranger, or a peer that stalled
                log.warning("a connection to the engine's weight rounds was refused: %s", err)
                return
            while True:
                try:
                    request = line.recv_bytes(idle=True)  # the generator keeps the line between rounds
                    line.send_bytes(self._reply(request))
                except (OSError, EOFError) as err:  # closed, or stalled mid-message: this line only
                    if not isinstance(err, EOFError):
                        log.warning("the generator's line to the engine's weight rounds failed: %s", err)
                    return

    def _reply(self, request: bytes) -> bytes:
        kind = request[:1]
        try:
            slot = pb.CollectiveSlot.FromString(request[1:])
            if kind == JOIN:
                self.join(slot)
            elif kind == ARRIVED:
                self.staged(slot.group, slot.round).settled()
            else:
                raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE, f"unknown request {kind!r}")
        except DecodeError as err:
            return f"{Reason.COLLECTIVE_UNAVAILABLE.value}\0not a round's slot: {err}".encode()
        except PushRejected as err:
            return f"{err.reason.value}\0{_message(err)}".encode()
        return b""

    def join(self, slot: pb.CollectiveSlot) -> None:
        """Take part in the round `slot` names, staging its buckets (raises `PushRejected`: not joined)."""
        round_ = self.member.round(slot)
        total = sum(slot.bucket_bytes)
        with self._lock:
            if self._last is not None and self._stage.size < total:
                self._last.wait()  # the buffer grows: the round before must be done with the old one
            if self._stage.size < total:
                self._stage = np.empty(total, dtype=np.uint8)
            self._last = StagedRound(round_, self._stage, self._last)

    def staged(self, group: bytes, round_id: int) -> StagedRound:
        """The round this worker joined last, if it is `round_id` of `group` (raises `PushRejected`)."""
        with self._lock:
            staged = self._last
        if staged is None or (staged.round.slot.group, staged.round.slot.round) != (group, round_id):
            raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE,
                               f"round {round_id} is not one this worker joined (it keeps only the last one)")
        return staged

    def take(self, group: bytes, round_id: int, places: Sequence[Place]) -> dict[str, torch.Tensor]:
        """The verified tensors of a round this worker joined (views of the staging buffer, valid until the
        next round is joined); raises `PushRejected`."""
        return self.staged(group, round_id).tensors(places)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept: a close alone would not
        self._listener.close()
        self.member.close()


class EngineRound:
    """A round as the generator sees it when its engine's worker receives the bytes: the tensors' places."""

    def __init__(self, member: EngineMember, slot: pb.CollectiveSlot):
        self.member, self.slot = member, slot
        self.places: dict[str, Place] = {}

    def arrived(self) -> None:
        """Wait until the worker staged every bucket (raises `PushRejected`): asked at the commit, before the
        generator takes its engine, so the engine is paused for the load alone, not for the broadcast."""
        self.member.ask(ARRIVED, self.slot, self.slot.timeout_ms / 1000 + TAKE_MARGIN_S + LINE_S)

    def payload(self, header: pb.WeightChunk) -> HeldBytes:
        """The tensor's bytes, which stay with the worker."""
        return HeldBytes(nbytes_of(header), self)

    def describe(self, header: pb.WeightChunk) -> None:
        where = header.collective
        self.places[header.name] = (header.name, header.dtype, tuple(header.shape), where.bucket,
                                    where.bucket_offset, header.checksum, where.bucket_checksum)

    def close(self) -> None:
        """Nothing to drain here: the worker stages every bucket."""


class EngineMember:
    """The generator's half (see the module), a `CollectiveMember` to its receiver: it joins each round
    through the worker at `address` (`WorkerRounds`), which offers `backends`. Every request waits a bounded
    time for its answer: a worker that stalls fails that round (the pusher streams to this generator) and the
    line is dialled anew for the next."""

    def __init__(self, address: str, authkey: bytes, backends: Sequence[str]):
        self.address, self.backends = address, tuple(backends)
        self._authkey = authkey
        self._line: Line | None = None
        self._last: EngineRound | None = None
        self._lock = threading.Lock()

    def round(self, slot: pb.CollectiveSlot) -> EngineRound:
        if slot.backend not in self.backends:
            raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE, f"backend {slot.backend!r} is not one the "
                                                              f"engine offers ({', '.join(self.backends)})")
        self.ask(JOIN, slot, JOIN_TIMEOUT_S)  # later than that the learner has abandoned the round
        self._last = EngineRound(self, slot)
        return self._last

    def ask(self, kind: bytes, slot: pb.CollectiveSlot, timeout_s: float) -> None:
        """Send the worker a request about `slot` and wait `timeout_s` at most for its answer; raises
        `PushRejected` (its refusal, or `collective_unavailable`: unreachable, or no answer in time)."""
        with self._lock:
            try:
                if self._line is None:
                    self._line = Line.connect(self.address, self._authkey)
                self._line.send_bytes(kind + slot.SerializeToString())
                answer = self._line.recv_bytes(timeout_s=timeout_s)
            except (OSError, EOFError, AuthenticationError) as err:
                self._hang_up()  # a late answer must not be read as the next request's
                why = f"cannot be reached or did not answer for round {slot.round}: {err}"
                raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE, f"the engine's worker {why}") from err
        if answer:
            reason, detail = answer.decode().split("\0", 1)
            raise PushRejected(Reason(reason), detail)

    def _hang_up(self) -> None:
        if self._line is not None:
            self._line.close()
            self._line = None

    def held(self, tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, int, list[Place]] | None:
        """What to ask the worker for when `tensors` are the staged placeholders of the last round (meta
        tensors, `HeldBytes`): (group, round, places), else None (the bytes are here)."""
        held = [t.is_meta for t in tensors.values()]
        if not any(held):
            return None
        if not all(held):
            raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE, "a push's tensors come all by the collective "
                                                              "route or none by it")
        last = self._last
        if last is None or set(tensors) - set(last.places):
            raise PushRejected(Reason.COLLECTIVE_UNAVAILABLE, "the staged tensors are not the last round's")
        return last.slot.group, last.slot.round, [last.places[name] for name in tensors]

    def close(self) -> None:
        with self._lock:
            self._hang_up()
