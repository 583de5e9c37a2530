"""The collective route (gloo) beyond the contract suite: several members in one broadcast, a generator that
dies or joins between pushes (the group is rebuilt, the others never wait on it), a bucket whose bytes change
after the learner hashed them, and a pusher that takes the route only where it is offered; each with
generators that receive the buckets themselves, and with some whose engine's worker does."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import ClientAccess
from asyncrlhf.weights.codec import Snapshot, prepare
from asyncrlhf.weights.collective import here_key
from asyncrlhf.weights.collective_sender import CollectiveSender
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.stream import StreamSender
from asyncrlhf.weights.vocabulary import Reason, Route
from tests.integration.weights.helpers import (
    CHUNK,
    TOKEN,
    Generator,
    same,
    serve_collective_generator,
    snapshot,
    tiny_model,
)
from tests.integration.weights.routes import BUCKET, FlippingSender

pytestmark = pytest.mark.integration


def pushed(model, step: int) -> Snapshot:
    return Snapshot(PolicyVersion(1, step), prepare(model.state_dict()))


def collective_pusher(sender: CollectiveSender | None = None) -> WeightPusher:
    sender = sender or CollectiveSender(bucket_bytes=BUCKET, timeout_s=20.0)
    return WeightPusher(ClientAccess(TOKEN), chunk_bytes=CHUNK, timeout_s=30,
                        route_senders=[sender, StreamSender(CHUNK)])


@pytest.fixture(params=[False, True], ids=["generators", "engines-among-them"])
def members(request):
    """Three members of a group; with `engines-among-them` the first and last join through an inference
    engine's worker (`EngineHeld`), the middle one itself: the learner cannot tell them apart."""
    gens = [Generator(seed=i, data=False, collective=True, engine=request.param and i != 1) for i in range(3)]
    yield gens
    for gen in gens:
        gen.stop()


def test_one_broadcast_reaches_every_member_bit_exact(members):
    model = tiny_model(seed=7)
    with collective_pusher() as pusher:
        outcomes = pusher.send(pushed(model, 1), [g.target_id for g in members])
        kept = pusher.routes.senders[Route.COLLECTIVE].groups._groups  # type: ignore[attr-defined]
        members_of, group = next(iter(kept.items()))
    assert [(o.status, o.route) for o in outcomes] == [("ok", Route.COLLECTIVE)] * 3, outcomes
    assert group.rounds == 1 and len(members_of) == 3
    assert all(same(snapshot(g.model), snapshot(model)) for g in members)


def test_a_generator_that_died_costs_one_round_and_the_others_still_get_every_version(members):
    alive, dead = members[:2], members[2]
    targets = [g.target_id for g in members]
    with collective_pusher() as pusher:
        assert all(o.route == Route.COLLECTIVE for o in pusher.send(pushed(tiny_model(7), 1), targets))
        dead.stop()  # as if killed: its server and its group's connections close
        newer = tiny_model(seed=8)
        first = pusher.send(pushed(newer, 2), targets)  # the round is abandoned: streamed instead
        assert [(o.status, o.route) for o in first[:2]] == [("ok", Route.STREAM)] * 2, first
        assert first[2].status == "unreachable"
        assert all(same(snapshot(g.model), snapshot(newer)) for g in alive)  # streamed, not waiting on it
        newest = tiny_model(seed=9)
        second = pusher.send(pushed(newest, 3), targets)  # a group without the dead one
    assert [(o.status, o.route) for o in second[:2]] == [("ok", Route.COLLECTIVE)] * 2, second
    assert second[2].status == "unreachable"
    assert all(same(snapshot(g.model), snapshot(newest)) for g in alive)


def test_a_generator_joining_after_the_group_formed_gets_a_group_with_it(members):
    early = members[:2]
    with collective_pusher() as pusher:
        sender = pusher.routes.senders[Route.COLLECTIVE]
        assert all(o.route == Route.COLLECTIVE for o in pusher.send(pushed(tiny_model(7), 1),
                                                                    [g.target_id for g in early]))
        newer = tiny_model(seed=8)
        outcomes = pusher.send(pushed(newer, 2), [g.target_id for g in members])
        groups = list(sender.groups._groups)  # type: ignore[attr-defined]
    assert [(o.status, o.route) for o in outcomes] == [("ok", Route.COLLECTIVE)] * 3, outcomes
    assert [len(g) for g in groups] == [2, 3]
    assert all(same(snapshot(g.model), snapshot(newer)) for g in members)


def test_a_generator_killed_in_a_round_fails_it_and_its_peers_get_the_version_by_stream(members):
    """A member SIGKILLed once it is here for a round (mid-broadcast, or before the group is built): the
    learner's op fails or times out, its peers refuse the round and are streamed to; its call was unreachable,
    so the next round builds a group without it."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve_collective_generator, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "the generator process did not start"
        victim = PushTarget("victim", parent.recv())
        targets = [*[g.target_id for g in members[:2]], victim]
        sender = CollectiveSender(bucket_bytes=4 << 10, timeout_s=2.0)  # ~150 buckets: a round lasts a while
        with collective_pusher(sender) as pusher:
            assert [o.route for o in pusher.send(pushed(tiny_model(7), 1), targets)] == [Route.COLLECTIVE] * 3
            newer = tiny_model(seed=8)
            with ThreadPoolExecutor(1) as pool:
                round_2 = pool.submit(pusher.send, pushed(newer, 2), targets)
                ((members_of, group),) = [(m, g) for m, g in sender.groups._groups.items()
                                          if victim.address in m]
                rank = members_of.index(victim.address) + 1
                while not group.keys.check([here_key(2, rank)]):
                    time.sleep(0.001)
                proc.kill()
                outcomes = round_2.result()
            assert [o.status for o in outcomes] == ["ok", "ok", "unreachable"], outcomes
            assert all(same(snapshot(g.model), snapshot(newer)) for g in members[:2])
            newest = tiny_model(seed=9)
            after = pusher.send(pushed(newest, 3), targets)
        assert [(o.status, o.route) for o in after[:2]] == [("ok", Route.COLLECTIVE)] * 2, after
        assert all(same(snapshot(g.model), snapshot(newest)) for g in members[:2])
    finally:
        proc.kill()
        proc.join(10)


def test_a_bucket_changed_after_the_learner_hashed_it_is_refused_and_the_old_version_serves(members):
    gen = members[0]
    before = snapshot(gen.model)
    with collective_pusher(FlippingSender(bucket_bytes=BUCKET, timeout_s=20.0)) as pusher:
        (outcome,) = pusher.send(pushed(tiny_model(7), 1), [gen.target_id])
    assert (outcome.status, outcome.reason) == ("rejected", Reason.BAD_CHECKSUM), outcome.detail
    assert "bucket 1" in outcome.detail
    assert same(snapshot(gen.model), before)


def test_a_pusher_takes_the_route_only_to_generators_that_offer_it(members):
    plain = Generator(seed=5, data=False)
    try:
        with collective_pusher() as pusher:
            routes = pusher.probe([members[0].target_id, plain.target_id])
    finally:
        plain.stop()
    assert routes == [Route.COLLECTIVE, Route.STREAM]


def test_the_config_puts_the_route_before_the_others_only_when_asked():
    asked = load_config(["configs/tiny.yaml"], ["learner.collective=true",
                                                "learner.collective_bucket_bytes=4096"])
    with WeightPusher.from_config(asked) as pusher, \
            WeightPusher.from_config(load_config(["configs/tiny.yaml"])) as plain:
        sender = pusher.routes.senders[Route.COLLECTIVE]
        assert list(pusher.routes.senders)[0] == Route.COLLECTIVE
        assert isinstance(sender, CollectiveSender) and sender.bucket_bytes == 4096
        assert Route.COLLECTIVE not in plain.routes.senders
