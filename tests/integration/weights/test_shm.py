"""The same-host data plane over real gRPC: bytes through one /dev/shm segment per version, gRPC carrying the
control; the same guarantees as the byte stream, and no segment left behind, whatever happened."""

from __future__ import annotations

import mmap
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
from asyncrlhf.weights import pusher as pusher_module
from asyncrlhf.weights import receiver as receiver_module
from asyncrlhf.weights import shm
from asyncrlhf.weights.codec import prepare
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from tests.integration.weights.helpers import CHUNK, TOKEN, Generator, push, same, snapshot, tiny_model

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not shm.shm_host(), reason="no writable /dev/shm on this machine")]


def segments() -> set[str]:
    return {p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}*")}


def own_segments() -> set[str]:
    """This process's: other pushers on the host (another test run, a training run) come and go meanwhile."""
    return {p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}{os.getpid()}-*")}


class Counting(shm.ShmPublication):
    created: list[str] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        Counting.created.append(self.name)


@pytest.fixture
def counting(monkeypatch):
    Counting.created = []
    monkeypatch.setattr(pusher_module, "ShmPublication", Counting)
    return Counting.created


def test_local_pushes_go_through_one_segment_rewritten_per_version(generator, learner, counting):
    before = own_segments()
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        outcome = push(pusher, learner.state_dict(), 1, generator)
        assert (outcome.status, outcome.version) == ("ok", 1), outcome.detail
        assert pusher.get_status(generator.address).shm_host == shm.shm_host()
        assert same(snapshot(generator.model), snapshot(learner))
        with torch.no_grad():
            for t in learner.parameters():
                t.add_(1.0)
        assert push(pusher, learner.state_dict(), 2, generator).status == "ok"
        assert same(snapshot(generator.model), snapshot(learner))
        assert len(own_segments() - before) == 1  # one segment, kept for the next version
    assert len(counting) == 2 and len(set(counting)) == 1  # two versions written into the same segment
    assert own_segments() == before  # removed with its pusher


def test_two_local_generators_map_the_same_segment(learner, counting):
    gens = [Generator(seed=1), Generator(seed=2)]
    try:
        with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
            targets = [PushTarget(f"g{i}", g.address) for i, g in enumerate(gens)]
            assert [o.status for o in pusher.push(learner.state_dict(), 1, targets)] == ["ok", "ok"]
        assert all(same(snapshot(g.model), snapshot(learner)) for g in gens)
        assert len(counting) == 1
    finally:
        for g in gens:
            g.stop()


def test_rejected_local_push_keeps_the_old_version_and_leaves_no_segment(generator, counting):
    before, old = own_segments(), snapshot(generator.model)
    other = tiny_model(seed=0)
    other.model.layers[0].self_attn.q_proj.weight.data = other.model.layers[0].self_attn.q_proj.weight[:32]
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        outcome = push(pusher, other.state_dict(), 1, generator)
    assert (outcome.status, outcome.code) == ("rejected", "INVALID_ARGUMENT")
    assert outcome.detail.startswith("shape_mismatch")
    assert same(snapshot(generator.model), old) and generator.receiver.version == 0
    assert len(counting) == 1 and own_segments() == before


def _control_stream(learner, version: int, tamper=None):
    """A hand-made same-host push: a publication and its control messages (optionally tampered with)."""
    tensors = prepare(learner.state_dict())
    publication = shm.ShmPublication(tensors, version, shm.ShmSegment(shm.layout(tensors)[1]))
    messages = [publication.control(i, 10) for i in range(len(tensors))]
    if tamper is not None:
        tamper(publication, messages)
    messages.append(pb.WeightChunk(version=version, commit=True, tensor_count=len(tensors)))
    return publication, messages


def flip_a_byte(publication, messages):
    with open(publication.segment.path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[messages[1].shm_offset] ^= 1


def escape(publication, messages):
    messages[0].shm_segment = "../../etc/passwd"


def missing(publication, messages):
    publication.segment.path.unlink()


def past_the_end(publication, messages):
    messages[-1].shm_offset = os.path.getsize(publication.segment.path)


@pytest.mark.parametrize("tamper, code, reason", [
    (flip_a_byte, grpc.StatusCode.DATA_LOSS, "bad_checksum"),
    (escape, grpc.StatusCode.FAILED_PRECONDITION, "shm_unavailable"),
    (missing, grpc.StatusCode.FAILED_PRECONDITION, "shm_unavailable"),
    (past_the_end, grpc.StatusCode.INVALID_ARGUMENT, "bad_offset"),
])
def test_bad_control_messages_are_rejected_and_the_old_version_serves(generator, learner, tamper, code,
                                                                     reason):
    old = snapshot(generator.model)
    publication, messages = _control_stream(learner, 1, tamper)
    try:
        stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(generator.address))
        with pytest.raises(grpc.RpcError) as err:
            stub.PushWeights(iter(messages), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)
        assert err.value.code() == code and err.value.details().startswith(reason)
    finally:
        publication.finish()
        publication.segment.close()
    assert same(snapshot(generator.model), old) and generator.receiver.version == 0


def test_a_receiver_that_cannot_see_the_segment_gets_the_byte_stream(generator, learner, monkeypatch,
                                                                     tmp_path):
    blind = lambda: shm.SegmentReader(tmp_path)  # noqa: E731 - a private /dev/shm, as in another container
    monkeypatch.setattr(receiver_module, "SegmentReader", blind)
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        assert push(pusher, learner.state_dict(), 1, generator).status == "ok"
        assert pusher._local[generator.address] is False
        assert push(pusher, learner.state_dict(), 2, generator).status == "ok"
    assert same(snapshot(generator.model), snapshot(learner))


def _publish_and_hang(conn) -> None:
    tensors = prepare(tiny_model(seed=0).state_dict())
    publication = shm.ShmPublication(tensors, 7, shm.ShmSegment(shm.layout(tensors)[1]))
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
        WeightPusher(TOKEN).close()  # a new pusher (the restarted learner) sweeps
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
