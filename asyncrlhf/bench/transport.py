"""`asyncrlhf bench transport [--json]`: our transport against the bare loop, side by side, on loopback.

1. Groups/s through producer -> consumer group -> ack, with realistic RolloutGroups (k=4 samples of 64
   tokens and their log-probs), against the same loop in bare redis-py (XADD / XREADGROUP / XACK, the same
   protobuf encode and decode). Ours also de-duplicates, deletes acked entries, and checks re-claims.
   Target: ours >= 0.7x bare.
2. Weight push GB/s of a 100M-parameter fp32 state dict to one WeightSync receiver across hosts (as there:
   no shared memory; cast, checksum, stage, verify, apply): over its data channel, the path such a push
   takes (`push_gbps`), and over the gRPC byte stream, the path without one (`stream_push_gbps`); against
   bare gRPC client-streaming of the same bytes in chunks of the same size. Target: ours >= 0.8x bare. In the
   same run, the collective route (`collective_push_gbps`: a gloo broadcast in 64 MiB buckets to the same
   receiver, control over gRPC) against the data channel, and against a bare gloo broadcast of the same bytes
   in the same buckets (`bare_gloo_gbps`, `bench.gloo`): reported.
3. The same-host path (`bench.weightplane`): the shared-memory push to one generator process against one
   memcpy of the same bytes (target >= 0.5x), a push to two generator processes against one (<= 1.2x), and
   `step_to_serve_s`: from a finished step's weights to both generators serving them.
4. The relay (`bench.relayplane`): versions pushed through the relay tree (fanout 2) to 16 light receivers
   on loopback, the pusher seeing no shared memory, as across hosts: `relay_learner_bytes_ratio`, the
   learner's tensor bytes per version over the model's (target <= 2, whatever the number of receivers), and
   `relay_last_commit_s`, from the push's start to the last receiver's commit (every receiver shares this
   machine's cores: on a small machine the bytes are the figure that holds).

Each pair runs alternating; the median of `--repeats` is reported. Both weight receivers (ours and the bare
byte sink) run in one child process and the pushers in this one, as a generator and the learner do.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import redis
import torch

from asyncrlhf._proto.rollout_pb2 import FINISH_REASON_STOP, PromptGroup, RolloutGroup, Sample
from asyncrlhf.bench.gloo import bare_gloo_gbps
from asyncrlhf.bench.relayplane import bench_relay
from asyncrlhf.bench.weightplane import Tensors, bench_local, state_dict
from asyncrlhf.config import RedisConfig
from asyncrlhf.inbox.ids import group_id
from asyncrlhf.redis_server import EmbeddedRedis
from asyncrlhf.streams import ID_FIELD, PAYLOAD_FIELD, REWARD_GROUP, ROLLOUTS, RunStreams, connect
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import GRPC_OPTIONS, ClientAccess, ServerAccess
from asyncrlhf.weights.channel_read import DataListener
from asyncrlhf.weights.collective_member import CollectiveMember
from asyncrlhf.weights.collective_sender import CollectiveSender
from asyncrlhf.weights.pusher import PushStatus, PushTarget, WeightPusher
from asyncrlhf.weights.receiver import NO_VERSION, WeightReceiver
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.stream import StreamSender
from asyncrlhf.weights.vocabulary import Route

K, COMPLETION_TOKENS, PROMPT_TOKENS = 4, 64, 32
COLLECTIVE_BUCKET_BYTES = 64 << 20  # the route's default (learner.collective_bucket_bytes)


def rollout_group(i: int) -> RolloutGroup:
    prompt = PromptGroup(group_id=group_id(i), prompt="Write a cheerful review of the movie.",
                         prompt_token_ids=list(range(PROMPT_TOKENS)), k=K, enqueued_at=time.time())
    samples = [Sample(completion_token_ids=[(i + j + t) % 50_000 for t in range(COMPLETION_TOKENS)],
                      logprobs=[-0.5 - 0.01 * t for t in range(COMPLETION_TOKENS)],
                      finish_reason=FINISH_REASON_STOP,
                      text="a generated completion of about sixty-four tokens " * 6) for j in range(K)]
    return RolloutGroup(group_id=prompt.group_id, prompt=prompt, samples=samples, policy_version=3,
                        generator_id="gen-0", generated_at=time.time())


def ours_groups_per_s(client: redis.Redis, groups: Sequence[RolloutGroup], batch: int, run: str) -> float:
    streams = RunStreams(client, run, RedisConfig(block_ms=1))
    producer, consumer = streams.producer(ROLLOUTS), streams.consumer(ROLLOUTS, REWARD_GROUP, "r0")
    start = time.perf_counter()
    for i in range(0, len(groups), batch):
        producer.add_many(groups[i:i + batch])
        got = consumer.read(batch)
        consumer.ack(got)
    elapsed = time.perf_counter() - start
    assert consumer.seen(groups[-1].group_id), "benchmark loop lost a group"
    return len(groups) / elapsed


def bare_groups_per_s(client: redis.Redis, groups: Sequence[RolloutGroup], batch: int, run: str) -> float:
    key, group = f"bench:{run}:bare", REWARD_GROUP
    client.xgroup_create(key, group, id="0", mkstream=True)
    start = time.perf_counter()
    for i in range(0, len(groups), batch):
        pipe = client.pipeline(transaction=False)
        for g in groups[i:i + batch]:
            pipe.xadd(key, {ID_FIELD: g.group_id, PAYLOAD_FIELD: g.SerializeToString()}, maxlen=100_000,
                      approximate=True)
        pipe.execute()
        res = client.xreadgroup(group, "r0", {key: ">"}, count=batch)
        # redis-py's stub gives the RESP3 dict; this RESP2 client returns [[stream, entries]]
        entries: list[tuple[bytes, dict[bytes, bytes]]] = res[0][1]  # type: ignore[index, assignment]
        for _, fields in entries:
            RolloutGroup.FromString(fields[PAYLOAD_FIELD])
        client.xack(key, group, *[eid for eid, _ in entries])
    elapsed = time.perf_counter() - start
    client.delete(key)
    return len(groups) / elapsed


def ours_push_gbps(
    pusher: WeightPusher, state: Mapping[str, torch.Tensor], address: str, version: int
) -> float:
    start = time.perf_counter()
    (outcome,) = pusher.push(state, PolicyVersion(0, version), [PushTarget("bench", address)])
    elapsed = time.perf_counter() - start
    if outcome.status != PushStatus.OK:
        raise RuntimeError(f"bench push failed: {outcome}")
    return outcome.bytes / elapsed / 1e9


_BARE_METHOD = "/bench.Bytes/Stream"


def _bare_server() -> tuple[grpc.Server, int]:
    def stream(request_iterator, context):
        return sum(len(chunk) for chunk in request_iterator).to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler("bench.Bytes", {
        "Stream": grpc.stream_unary_rpc_method_handler(stream),  # bytes in, bytes out: no (de)serializers
    })
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def bare_grpc_gbps(channel: grpc.Channel, total_bytes: int, chunk_bytes: int) -> float:
    call = channel.stream_unary(_BARE_METHOD)
    chunk = bytes(chunk_bytes)
    n_full, rest = divmod(total_bytes, chunk_bytes)

    def chunks():
        for _ in range(n_full):
            yield chunk
        if rest:
            yield chunk[:rest]

    start = time.perf_counter()
    got = int.from_bytes(call(chunks(), timeout=600), "little")
    elapsed = time.perf_counter() - start
    assert got == total_bytes
    return total_bytes / elapsed / 1e9


def bench_streams(groups: int, batch: int, repeats: int) -> tuple[float, float]:
    data = [rollout_group(i) for i in range(groups)]
    ours, bare = [], []
    with EmbeddedRedis() as server:
        client = connect(RedisConfig(), server.url)
        for r in range(repeats):
            bare.append(bare_groups_per_s(client, data, batch, f"bench{r}"))
            ours.append(ours_groups_per_s(client, data, batch, f"bench{r}"))
    return statistics.median(ours), statistics.median(bare)


def _receivers(params: int, conn) -> None:
    """The receiving process: our WeightSync server and the bare byte sink, until the parent says stop."""
    torch.set_num_threads(1)
    data, collective = DataListener(), CollectiveMember()
    receiver = WeightReceiver(Tensors({k: torch.zeros_like(v) for k, v in state_dict(params).items()}),
                              NO_VERSION, data=data, collective=collective)
    server, port = serve(receiver, access=ServerAccess("bench"))
    bare_server, bare_port = _bare_server()
    conn.send((port, bare_port))
    conn.recv()
    server.stop(0).wait(10)  # exiting while gRPC still shuts down can abort the process
    bare_server.stop(0).wait(10)
    data.close()
    collective.close()


def bench_push(params: int, chunk_bytes: int, repeats: int) -> tuple[float, float, float, float]:
    """Pusher here, receivers in a child process, as the learner and a generator are: GB/s over the data
    channel, over the gRPC stream, bare gRPC, and over the collective route (gloo)."""
    state = state_dict(params)
    total = sum(t.numel() * t.element_size() for t in state.values())
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receivers, args=(params, child), daemon=True)
    proc.start()
    ours, streamed, bare, broadcast = [], [], [], []
    try:
        if not parent.poll(120):
            raise RuntimeError("bench receiver process did not start within 120 s")
        port, bare_port = parent.recv()
        address = f"127.0.0.1:{port}"
        access = ClientAccess("bench")
        collective = CollectiveSender(bucket_bytes=COLLECTIVE_BUCKET_BYTES, timeout_s=600)
        with WeightPusher(access, chunk_bytes=chunk_bytes, dtype="float32", timeout_s=600,
                          routes=(Route.DATA, Route.STREAM)) as pusher, \
                WeightPusher(access, chunk_bytes=chunk_bytes, dtype="float32", timeout_s=600,
                             routes=(Route.STREAM,)) as stream_pusher, \
                WeightPusher(access, chunk_bytes=chunk_bytes, dtype="float32", timeout_s=600,
                             route_senders=[collective, StreamSender(chunk_bytes)]) \
                as collective_pusher, \
                grpc.insecure_channel(f"127.0.0.1:{bare_port}", options=GRPC_OPTIONS) as channel:
            target = [PushTarget("bench", address)]
            if pusher.probe(target) != [Route.DATA] or collective_pusher.probe(target) != [Route.COLLECTIVE]:
                raise RuntimeError("bench pushes do not take the data channel and the collective route")
            for r in range(repeats):
                bare.append(bare_grpc_gbps(channel, total, chunk_bytes))
                ours.append(ours_push_gbps(pusher, state, address, version=3 * r + 1))
                streamed.append(ours_push_gbps(stream_pusher, state, address, version=3 * r + 2))
                broadcast.append(ours_push_gbps(collective_pusher, state, address, version=3 * r + 3))
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    # the first push allocates staging
    return (statistics.median(ours[1:]), statistics.median(streamed[1:]), statistics.median(bare[1:]),
            statistics.median(broadcast[1:]))


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrlhf bench transport", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--groups", type=int, default=5000, help="rollout groups per streams run")
    parser.add_argument("--batch", type=int, default=32, help="groups per XADD pipeline / read / ack")
    parser.add_argument("--params", type=int, default=100_000_000, help="parameters in the pushed state dict")
    parser.add_argument("--chunk-bytes", type=int, default=4 << 20,
                        help="WeightChunk size (and the bare chunk size)")
    parser.add_argument("--relay-params", type=int, default=10_000_000,
                        help="parameters in the state dict pushed through the relay tree")
    parser.add_argument("--relay-receivers", type=int, default=16, help="light receivers in the relay tree")
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs of each side, at least 2; the median is reported (pushes: not the first)")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (the first weight push, which allocates, is not counted)")

    groups_per_s, bare_groups = bench_streams(args.groups, args.batch, args.repeats)
    push_gbps, stream_gbps, bare_gbps, collective_gbps = bench_push(args.params, args.chunk_bytes,
                                                                    args.repeats)
    total = sum(t.numel() * t.element_size() for t in state_dict(args.params).values())
    bare_gloo = bare_gloo_gbps(total, COLLECTIVE_BUCKET_BYTES, args.repeats)
    local = bench_local(args.params, args.repeats)
    relay = bench_relay(args.relay_params, min(args.repeats, 3), args.relay_receivers)
    result = {"groups_per_s": groups_per_s, "bare_groups_per_s": bare_groups,
              "push_gbps": push_gbps, "stream_push_gbps": stream_gbps, "bare_grpc_gbps": bare_gbps,
              "collective_push_gbps": collective_gbps, "bare_gloo_gbps": bare_gloo,
              "shm_push_gbps": local.shm_push_gbps, "memcpy_gbps": local.memcpy_gbps,
              "two_generators_time_ratio": local.two_generators_time_ratio,
              "step_to_serve_s": local.step_to_serve_s,
              "relay_learner_bytes_ratio": relay.learner_bytes_ratio,
              "relay_last_commit_s": relay.last_commit_s}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"streams   ours {groups_per_s:10.0f} groups/s   bare redis-py {bare_groups:10.0f} groups/s   "
          f"ratio {groups_per_s / bare_groups:.2f} (target >= 0.70)")
    print(f"weights   ours {push_gbps:10.2f} GB/s       bare gRPC     {bare_gbps:10.2f} GB/s       "
          f"ratio {push_gbps / bare_gbps:.2f} (target >= 0.80; gRPC stream, no data channel: "
          f"{stream_gbps:.2f} GB/s, {stream_gbps / bare_gbps:.2f})")
    print(f"broadcast collective (gloo) {collective_gbps:6.2f} GB/s   data channel {push_gbps:6.2f} GB/s   "
          f"ratio {collective_gbps / push_gbps:.2f} (reported; bare gloo broadcast {bare_gloo:.2f} GB/s, "
          f"ours / bare {collective_gbps / bare_gloo:.2f})")
    shm_ratio = local.shm_push_gbps / local.memcpy_gbps
    print(f"same host ours {local.shm_push_gbps:10.2f} GB/s       memcpy        "
          f"{local.memcpy_gbps:10.2f} GB/s"
          f"       ratio {shm_ratio:.2f} (target >= 0.50)")
    print(f"fan-out   two generators / one: {local.two_generators_time_ratio:.2f} (target <= 1.20)   "
          f"step_to_serve_s {local.step_to_serve_s:.3f}")
    print(f"relay     {args.relay_receivers} receivers: learner bytes / model "
          f"{relay.learner_bytes_ratio:.2f} (target <= 2.00)   last commit {relay.last_commit_s:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
