"""Weight sync over real gRPC: bit-exact round trips; every rejection keeps the old weights; fan-out."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf._proto import weights_pb2_grpc as pb_grpc
from asyncrlhf.weights import (
    ModuleTarget,
    PushTarget,
    WeightPusher,
    WeightReceiver,
    chunks,
    prepare,
    serve,
)

pytestmark = pytest.mark.integration

TOKEN = "s3cret"
CHUNK = 8 << 10  # small, so every tensor of the tiny model spans several chunks


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Generator:
    """A receiver-side stand-in for the generator service: a live model behind a WeightSync server."""

    def __init__(self, seed: int = 1, token: str | None = TOKEN, names=None):
        self.model = tiny_model(seed)
        self.target = ModuleTarget(self.model, names)
        self.receiver = WeightReceiver(self.target)
        self.server, self.port = serve(self.receiver, token=token)
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture
def generator():
    gen = Generator()
    yield gen
    gen.stop()


@pytest.fixture
def learner() -> torch.nn.Module:
    return tiny_model(seed=0)


def push(pusher: WeightPusher, state, version, gen: Generator, **kw):
    (outcome,) = pusher.push(state, version, [PushTarget("g0", gen.address)], **kw)
    return outcome


def test_fp32_push_is_bit_exact(generator, learner):
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        outcome = push(pusher, learner.state_dict(), 1, generator)
        assert (outcome.status, outcome.version) == ("ok", 1), outcome.detail
        assert same(snapshot(generator.model), snapshot(learner))
        assert pusher.get_status(generator.address).version == 1
        assert outcome.bytes == sum(t.numel() * 4 for t in learner.state_dict().values())


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_push_is_within_rounding(generator, learner, dtype, torch_dtype):
    with WeightPusher(TOKEN, chunk_bytes=CHUNK, dtype=dtype) as pusher:
        assert push(pusher, learner.state_dict(), 1, generator).status == "ok"
    got, want = snapshot(generator.model), snapshot(learner)
    for name in want:
        assert got[name].dtype == torch.float32  # the live dtype is kept
        # exactly the fp32 value rounded to the push dtype, so within half an ulp of it
        assert torch.equal(got[name], want[name].to(torch_dtype).to(torch.float32)), name
    tol = torch.finfo(torch_dtype).eps
    assert all(torch.allclose(got[n], want[n], rtol=tol, atol=1e-6) for n in want)


def test_partial_push_updates_only_the_named_tensors(learner):
    names = [n for n in learner.state_dict() if n.endswith("q_proj.weight")]
    gen = Generator(names=names)
    try:
        before = snapshot(gen.model)
        subset = {n: learner.state_dict()[n] for n in names}
        with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
            assert push(pusher, subset, 1, gen, partial=True).status == "ok"
        after = snapshot(gen.model)
        assert all(torch.equal(after[n], subset[n]) for n in names)
        assert all(torch.equal(after[n], before[n]) for n in after if n not in names)
    finally:
        gen.stop()


def test_push_waits_for_the_generation_batch(generator, learner):
    """The generator holds the target's lock while it generates: the swap lands after, never during."""
    generator.target.lock.acquire()
    results = []
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        def push_v1():
            results.append(push(pusher, learner.state_dict(), 1, generator))

        thread = threading.Thread(target=push_v1)
        thread.start()
        time.sleep(0.5)
        assert not results and not same(snapshot(generator.model), snapshot(learner))
        generator.target.lock.release()
        thread.join(30)
    assert results[0].status == "ok" and same(snapshot(generator.model), snapshot(learner))


# ---------------------------------------------------------------------------------------------------------
# Rejections: each one leaves the previous version served, bit for bit.


def good_stream(learner, version: int = 2) -> list[pb.WeightChunk]:
    return list(chunks(prepare(learner.state_dict()), version, CHUNK))


def first_of(messages, name_suffix: str) -> int:
    return next(i for i, m in enumerate(messages) if m.name.endswith(name_suffix))


def rename(messages):
    messages[0].name = "model.layers.9.mlp.up_proj.weight"
    return messages


def reshape(messages):
    i = first_of(messages, "q_proj.weight")
    for m in messages:
        if m.name == messages[i].name:
            m.shape[:] = [32, 128]
    return messages


def retype(messages):
    for m in messages:
        if m.name == messages[0].name:
            m.dtype = pb.DTYPE_INT32
    return messages


def corrupt(messages):
    messages[1].data = bytes([messages[1].data[0] ^ 1]) + messages[1].data[1:]
    return messages


def truncate(messages):
    return messages[:-1]  # no commit


def cut_mid_tensor(messages):
    i = first_of(messages, "q_proj.weight")
    return messages[:i + 1] + [messages[-1]]  # first chunk of q_proj, then commit


def skip_chunk(messages):
    i = first_of(messages, "q_proj.weight")
    return messages[:i] + messages[i + 1:]


def drop_tensor(messages):
    name = messages[0].name
    kept = [m for m in messages if m.name != name]
    kept[-1].tensor_count -= 1
    return kept


def miscount(messages):
    messages[-1].tensor_count += 1
    return messages


def stale(messages):
    for m in messages:
        m.version = 1  # the generator already serves version 1
    return messages


REJECTIONS = [
    (rename, grpc.StatusCode.NOT_FOUND, "unknown_tensor"),
    (reshape, grpc.StatusCode.INVALID_ARGUMENT, "shape_mismatch"),
    (retype, grpc.StatusCode.INVALID_ARGUMENT, "dtype_mismatch"),
    (corrupt, grpc.StatusCode.DATA_LOSS, "bad_checksum"),
    (truncate, grpc.StatusCode.DATA_LOSS, "truncated"),
    (cut_mid_tensor, grpc.StatusCode.DATA_LOSS, "truncated"),
    (skip_chunk, grpc.StatusCode.INVALID_ARGUMENT, "bad_offset"),
    (drop_tensor, grpc.StatusCode.INVALID_ARGUMENT, "missing_tensors"),
    (miscount, grpc.StatusCode.INVALID_ARGUMENT, "tensor_count"),
    (stale, grpc.StatusCode.FAILED_PRECONDITION, "stale_version"),
]


@pytest.fixture
def served_v1(generator, learner):
    """The generator serves version 1 (the learner's weights); returns its exact state."""
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        assert push(pusher, learner.state_dict(), 1, generator).status == "ok"
    return snapshot(generator.model)


@pytest.mark.parametrize("tamper, code, reason", REJECTIONS,
                         ids=[f"{reason}:{tamper.__name__}" for tamper, _, reason in REJECTIONS])
def test_rejected_push_keeps_serving_the_old_version(generator, served_v1, tamper, code, reason):
    new = tiny_model(seed=7)  # different weights, so a partial apply would show
    messages = tamper(good_stream(new))
    stub = pb_grpc.WeightSyncStub(grpc.insecure_channel(generator.address))
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushWeights(iter(messages), timeout=30, metadata=auth)
    assert err.value.code() == code
    assert err.value.details().startswith(reason), err.value.details()
    assert same(snapshot(generator.model), served_v1)
    assert stub.GetStatus(pb.GetStatusRequest(), metadata=auth).version == 1


@pytest.mark.parametrize("token", [None, "wrong"], ids=["missing_token", "wrong_token"])
def test_unauthenticated_push_keeps_serving_the_old_version(generator, served_v1, token):
    with WeightPusher(token, chunk_bytes=CHUNK) as pusher:
        outcome = push(pusher, tiny_model(seed=7).state_dict(), 2, generator)
        assert (outcome.status, outcome.code) == ("rejected", "UNAUTHENTICATED")
        assert "token" in outcome.detail
    assert same(snapshot(generator.model), served_v1)
    assert generator.receiver.version == 1


def test_rejected_then_good_push_recovers(generator, served_v1):
    new = tiny_model(seed=7)
    with WeightPusher(TOKEN, chunk_bytes=CHUNK) as pusher:
        assert push(pusher, new.state_dict(), 1, generator).status == "rejected"  # stale
        assert push(pusher, new.state_dict(), 2, generator).status == "ok"
    assert same(snapshot(generator.model), snapshot(new))


def test_serve_refuses_a_public_bind_without_token(generator):
    with pytest.raises(ValueError, match="without a token"):
        serve(generator.receiver, host="0.0.0.0", token=None)


# ---------------------------------------------------------------------------------------------------------
# Fan-out


def test_fan_out_updates_live_targets_and_reports_dead_ones_within_the_deadline(learner):
    live = [Generator(seed=1), Generator(seed=2)]
    closed = Generator(seed=3)
    closed.stop()  # nothing listens on its port any more
    hung = socket.socket()  # accepts TCP connections, never speaks HTTP/2: a hung generator
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    targets = [PushTarget("g0", live[0].address), PushTarget("g1", closed.address),
               PushTarget("g2", live[1].address), PushTarget("g3", f"127.0.0.1:{hung.getsockname()[1]}")]
    deadline_s = 3.0
    try:
        with WeightPusher(TOKEN, chunk_bytes=CHUNK, timeout_s=deadline_s) as pusher:
            start = time.perf_counter()
            outcomes = pusher.push(learner.state_dict(), 5, targets)
            elapsed = time.perf_counter() - start
        assert [o.target.id for o in outcomes] == ["g0", "g1", "g2", "g3"]
        assert [o.status for o in outcomes] == ["ok", "unreachable", "ok", "unreachable"]
        assert outcomes[1].code == "UNAVAILABLE" and outcomes[3].code == "DEADLINE_EXCEEDED"
        assert elapsed < deadline_s + 2.0  # the dead ones did not hold up the push past the deadline
        for gen in live:
            assert gen.receiver.version == 5 and same(snapshot(gen.model), snapshot(learner))
    finally:
        hung.close()
        for gen in live:
            gen.stop()
