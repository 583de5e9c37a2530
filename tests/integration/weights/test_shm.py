"""The same-host data plane over real gRPC: bytes through one /dev/shm segment per version, gRPC carrying the
control; the same guarantees as the byte stream, and no segment left behind, whatever happened."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights import shm, shm_read
from asyncrlhf.weights.codec import Snapshot, prepare
from asyncrlhf.weights.pusher import PushTarget
from asyncrlhf.weights.vocabulary import Reason, Route, refusal_reason
from tests.integration.weights.helpers import AUTH, Generator, push, pusher, same, snapshot, tiny_model

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not shm.shm_host(), reason="no writable /dev/shm on this machine")]


def at(step: int) -> PolicyVersion:
    return PolicyVersion(0, step)


def segments() -> set[str]:
    return {p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}*")}


def own_segments() -> set[str]:
    """This process's: other pushers on the host (another test run, a training run) come and go meanwhile."""
    return {p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}{os.getpid()}-*")}


class Counting(shm.ShmPublication):
    created: list[str] = []
    publications: list[shm.ShmPublication] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        Counting.created.append(self.name)
        Counting.publications.append(self)


@pytest.fixture
def counting(monkeypatch):
    Counting.created, Counting.publications = [], []
    monkeypatch.setattr(shm, "ShmPublication", Counting)  # counted, not chosen: the route is the pusher's
    return Counting.created


def backing_file(tensor: torch.Tensor) -> str:
    """The file this process maps at the tensor's storage ("" for anonymous memory), from /proc/self/maps."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 else ""
    return ""


def writable_elsewhere(name: str) -> bool:
    """Whether another open description of segment `name` could write-lock all of it (no receiver holds any
    of its bytes): what the pusher's claim asks."""
    fd = os.open(shm.SHM_DIR / name, os.O_RDWR)
    try:
        return shm.range_lock(fd, fcntl.F_WRLCK, 0, 0)
    finally:
        os.close(fd)


def test_local_pushes_are_adopted_in_place_and_versions_alternate_between_two_segments(generator, learner,
                                                                                      counting):
    before = own_segments()
    weight = lambda: generator.model.model.layers[0].mlp.up_proj.weight  # noqa: E731
    with pusher() as by:
        for step in (1, 2, 3):
            with torch.no_grad():
                for t in learner.parameters():
                    t.add_(1.0)
            outcome = push(by, learner.state_dict(), step, generator)
            assert (outcome.status, outcome.version, outcome.route) == ("ok", at(step), Route.SHM)
            assert same(snapshot(generator.model), snapshot(learner))
            # the live weight is the segment's bytes, not a copy of them
            assert backing_file(weight()) == str(shm.SHM_DIR / counting[-1])
            assert not writable_elsewhere(counting[-1])  # held while served: the pusher cannot rewrite it
            if step > 1:
                assert writable_elsewhere(counting[-2])  # released once the generator moved on
        assert len(own_segments() - before) == 2
    first, second, third = counting
    assert first != second and third == first  # two segments, each rewritten once no one held it
    assert own_segments() == before  # removed with their pusher


def test_a_segment_a_generator_still_serves_from_is_never_rewritten(learner, counting):
    """Generator b stays on version 1 while a moves on: version 3 cannot go into b's segment, so a third is
    made, and b's weights stay those of version 1 bit for bit; knowing two receivers, the pusher keeps three
    segments (one each, one to write into), so versions that b skips need no new one."""
    a, b = Generator(seed=1), Generator(seed=2)
    before = own_segments()
    try:
        with pusher() as by:
            only_a = [PushTarget("a", a.address)]
            both = [*only_a, PushTarget("b", b.address)]
            assert [o.status for o in by.push(learner.state_dict(), at(1), both)] == ["ok", "ok"]
            served_by_b = snapshot(learner)
            for step in (2, 3):
                with torch.no_grad():
                    for t in learner.parameters():
                        t.mul_(0.5)
                assert [o.status for o in by.push(learner.state_dict(), at(step), only_a)] == ["ok"]
                assert same(snapshot(a.model), snapshot(learner))
                assert same(snapshot(b.model), served_by_b)
            assert len(set(counting)) == 3
            assert [o.status for o in by.push(learner.state_dict(), at(4), both)] == ["ok", "ok"]
            assert same(snapshot(b.model), snapshot(learner))
            assert len(own_segments() - before) == 3  # one per receiver, and one to write the next into
            for step in (5, 6, 7, 8):  # b skips every other version: no segment is made anew for it
                some = both[:2 - step % 2]
                outcomes = by.push(learner.state_dict(), at(step), some)
                assert [o.status for o in outcomes] == ["ok"] * len(some)
            assert len(set(counting)) == 3 and len(own_segments() - before) == 3
    finally:
        a.stop()
        b.stop()


def _serve_and_hang(conn) -> None:
    generator = Generator(seed=1)
    conn.send(generator.address)
    signal.pause()


def test_a_killed_generator_holds_nothing(learner, counting):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_and_hang, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "the generator process did not start"
        address = parent.recv()
        with pusher() as by:
            (outcome,) = by.push(learner.state_dict(), at(1), [PushTarget("g", address)])
            assert outcome.status == "ok", outcome.detail
            assert not writable_elsewhere(counting[-1])
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            assert writable_elsewhere(counting[-1])  # the kernel dropped its locks with it
    finally:
        if proc.is_alive():
            proc.kill()


def test_a_write_into_a_live_view_never_reaches_the_segment(generator, learner, counting):
    name = "model.layers.0.mlp.up_proj.weight"
    with pusher() as by:
        assert push(by, learner.state_dict(), 1, generator).status == "ok"
        publication = Counting.publications[-1]
        live = generator.model.get_parameter(name)
        with torch.no_grad():
            live.add_(1.0)  # the receiver's mapping is private: the pages written are copied for it alone
        start = publication.offsets[[t.name for t in publication.tensors].index(name)]
        raw = bytearray((shm.SHM_DIR / publication.name).read_bytes()[start:start + live.numel() * 4])
        in_segment = torch.frombuffer(raw, dtype=torch.float32).view_as(live)
        assert torch.equal(in_segment, learner.get_parameter(name))
        assert torch.equal(live, learner.get_parameter(name) + 1.0)
        # version 3 goes into the same segment again; the receiver's kept mapping still has its own copy of
        # the pages written above, so the tensor fails its checksum there and is read through a fresh mapping
        for step in (2, 3):
            with torch.no_grad():
                for t in learner.parameters():
                    t.mul_(0.5)
            assert push(by, learner.state_dict(), step, generator).status == "ok"
        assert Counting.publications[-1].name == publication.name
        assert same(snapshot(generator.model), snapshot(learner))


def mapped_segments() -> list[str]:
    """The segment files this process maps (several times for several mappings), from /proc/self/maps."""
    return [line.split(maxsplit=5)[5] for line in Path("/proc/self/maps").read_text().splitlines()
            if shm.PREFIX in line]


def test_the_receiver_maps_each_segment_once_and_unmaps_the_ones_its_pusher_closed(generator, learner,
                                                                                 counting):
    with pusher() as by:
        for step in (1, 2, 3, 4):
            assert push(by, learner.state_dict(), step, generator).status == "ok"
        first = set(counting)
        assert len(first) == 2
        receiver_maps = generator.receiver.ends[Route.SHM].names()
        assert sorted(receiver_maps) == sorted(first)  # one mapping each, kept from version to version
    assert not segments() & first  # removed with their pusher: mapped still, until the next push
    with pusher() as by:
        assert push(by, learner.state_dict(), 5, generator).status == "ok"
    still = [m for m in mapped_segments() if any(name in m for name in first)]
    assert still == [], still  # the closed segments' memory went back with the next push


def test_a_segment_a_relay_reads_is_not_given_back_before_the_relay_ends(generator, learner, counting):
    with pusher() as by:
        assert push(by, learner.state_dict(), 1, generator).status == "ok"
        first = counting[-1]
        generator.receiver.hold()  # a relay forwards version 1's bytes
        assert push(by, learner.state_dict(), 2, generator).status == "ok"
        assert counting[-1] != first
        assert not writable_elsewhere(first)  # no live tensor views it, but the relay still reads it
        generator.receiver.release()
        assert writable_elsewhere(first)


def test_two_local_generators_map_the_same_segment(learner, counting):
    gens = [Generator(seed=1), Generator(seed=2)]
    try:
        with pusher() as by:
            targets = [PushTarget(f"g{i}", g.address) for i, g in enumerate(gens)]
            assert [o.status for o in by.push(learner.state_dict(), at(1), targets)] == ["ok", "ok"]
        assert all(same(snapshot(g.model), snapshot(learner)) for g in gens)
        assert len(counting) == 1
    finally:
        for g in gens:
            g.stop()


def test_rejected_local_push_keeps_the_old_version_and_leaves_no_segment(generator, counting):
    before, old = own_segments(), snapshot(generator.model)
    other = tiny_model(seed=0)
    other.model.layers[0].self_attn.q_proj.weight.data = other.model.layers[0].self_attn.q_proj.weight[:32]
    with pusher() as by:
        outcome = push(by, other.state_dict(), 1, generator)
    assert (outcome.status, outcome.reason) == ("rejected", Reason.SHAPE_MISMATCH)
    assert same(snapshot(generator.model), old) and generator.receiver.version.step == 0
    assert len(counting) == 1 and own_segments() == before


def _control_stream(learner, step: int, tamper=None):
    """A hand-made same-host push: a publication and its control messages (optionally tampered with)."""
    push = Snapshot(at(step), prepare(learner.state_dict()))
    publication = shm.ShmPublication(push, shm.ShmSegment(shm.layout(push.tensors)[1]))
    messages = [publication.control(i, 10) for i in range(len(push.tensors))]
    if tamper is not None:
        tamper(messages)
    messages.append(pb.WeightChunk(version=step, commit=True, tensor_count=len(push.tensors)))
    return publication, messages


def _refusal(generator, messages) -> grpc.RpcError:
    stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(generator.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.PushWeights(iter(messages), metadata=AUTH, timeout=30)
    return err.value


def test_a_segment_named_outside_dev_shm_is_never_opened(generator, learner):
    old = snapshot(generator.model)
    publication, messages = _control_stream(learner, 1, lambda ms: setattr(ms[0], "shm_segment",
                                                                            "../../etc/passwd"))
    try:
        assert refusal_reason(_refusal(generator, messages)) == Reason.SHM_UNAVAILABLE
    finally:
        publication.finish()
        publication.segment.close()
    assert same(snapshot(generator.model), old) and generator.receiver.version.step == 0


def test_a_push_whose_segment_a_newer_version_is_rewriting_is_refused(generator, learner):
    """A late push (its pusher gave up on it and claimed the segment for a newer version) must not be
    verified against bytes being overwritten: the receiver cannot read-lock them, refuses, keeps its
    version."""
    old = snapshot(generator.model)
    publication, messages = _control_stream(learner, 1)
    publication.finish()
    assert publication.segment.claim()  # a newer version is being written into it
    try:
        refused = _refusal(generator, messages)
        assert refusal_reason(refused) == Reason.STALE_VERSION and "being rewritten" in refused.details()
    finally:
        publication.segment.close()
    assert same(snapshot(generator.model), old) and generator.receiver.version.step == 0


def test_a_receiver_that_cannot_see_the_segment_gets_the_bytes_over_the_network(generator, learner,
                                                                               tmp_path):
    # a private /dev/shm, as in a container
    generator.receiver.ends[Route.SHM] = shm_read.SegmentMaps(tmp_path)
    with pusher() as by:
        outcome = push(by, learner.state_dict(), 1, generator)
        assert (outcome.status, outcome.route) == ("ok", Route.STREAM)  # this push: the fallback
        assert by.routes.route(generator.address) == Route.DATA  # its data channel from now on, not shm
        assert push(by, learner.state_dict(), 2, generator).status == "ok"
    assert same(snapshot(generator.model), snapshot(learner))


def _publish_and_hang(conn) -> None:
    push = Snapshot(at(7), prepare(tiny_model(seed=0).state_dict()))
    publication = shm.ShmPublication(push, shm.ShmSegment(shm.layout(push.tensors)[1]))
    conn.send(publication.name)
    signal.pause()


def test_a_pusher_killed_mid_push_leaves_nothing_once_a_new_pusher_starts():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_publish_and_hang, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(120), "the publishing process did not start"
    name = parent.recv()
    assert name in segments()
    mine = shm.ShmSegment(64)  # a live pusher's segment survives the sweep
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        pusher().close()  # a new pusher (the restarted learner) sweeps
        assert name not in segments()
        assert mine.name in segments()
    finally:
        mine.close()
    assert mine.name not in segments()


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_the_lock_not_the_pid_says_a_segment_is_alive(tmp_path):
    """Across PID namespaces (a learner container sharing the host's /dev/shm) the pid in a name means
    nothing: CI's compose learner once swept a live host pusher's segment and died on the unlink. A segment
    whose lock is held survives whatever its name says; once its holder dies, it is swept."""
    segment = tmp_path / f"{shm.PREFIX}999999999-0a1b2c3d"  # a pid that exists nowhere here
    segment.write_bytes(b"\0" * 64)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(segment)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert shm.sweep_stale(tmp_path) == [] and segment.exists()
    finally:
        holder.kill()
        holder.wait()
    assert shm.sweep_stale(tmp_path) == [segment.name] and not segment.exists()


def test_a_segment_this_process_may_not_remove_is_left_and_the_sweep_goes_on(tmp_path, monkeypatch):
    theirs = tmp_path / f"{shm.PREFIX}1-00000000"
    orphan = tmp_path / f"{shm.PREFIX}2-00000000"
    theirs.write_bytes(b"")
    orphan.write_bytes(b"")
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self == theirs:  # another user's file in a sticky /dev/shm: EPERM
            raise PermissionError(1, "Operation not permitted", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    assert shm.sweep_stale(tmp_path) == [orphan.name]
    assert theirs.exists()


def test_a_new_segment_holds_its_lock_until_closed(tmp_path):
    segment = shm.ShmSegment(64, tmp_path)
    assert shm.sweep_stale(tmp_path) == [] and segment.path.exists()  # alive: this process holds the lock
    segment.close()
    assert not segment.path.exists()
