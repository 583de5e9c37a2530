"""Relays over real gRPC on loopback: a tree of receivers commits every version bit-exact while the pusher
streams it about once per root; a relay node that dies, a receiver that cannot be reached and a push that is
refused leave nobody on the old version; a push arriving mid-relay does not disturb the bytes being relayed.
Pushers here see no shared memory (as across hosts), except where a test says otherwise."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import pytest
import torch

from asyncrlhf.bench.weightplane import Tensors
from asyncrlhf.weights.access import ClientAccess, ServerAccess
from asyncrlhf.weights.pusher import PushTarget, RelayPlan, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.relay import Relay, TreePush, relay_pusher
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.shm import shm_host
from asyncrlhf.weights.vocabulary import Reason, Route
from tests.integration.weights.helpers import (
    ONLY,
    TOKEN,
    Gated,
    Generator,
    pusher,
    same,
    snapshot,
    tiny_model,
    version,
)

pytestmark = pytest.mark.integration
WAIT_S = 30


def across_hosts(**kw) -> WeightPusher:
    return pusher(routes=ONLY[Route.DATA], **kw)


def tree(by: WeightPusher, state, step: int, targets, fanout: int = 2):
    """The relay tree's push, as the learner's publisher runs it."""
    return TreePush(by, by.prepare(state, version(step)), fanout).run(targets)


@pytest.fixture
def generators():
    """g0..g6: with fanout 2 the tree is g0 -> (g1 -> g2, g3) and g4 -> (g5, g6)."""
    gens = [Generator(seed=10 + i) for i in range(7)]
    yield gens
    for g in gens:
        g.stop()


def targets_of(gens) -> list[PushTarget]:
    return [PushTarget(f"g{i}", g.address) for i, g in enumerate(gens)]


def model_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_tree_commits_every_version_bit_exact_and_the_pusher_streams_it_once_per_root(generators):
    learner = tiny_model(0)
    with across_hosts() as by:
        for step in (1, 2):  # the second reuses staging buffers along the tree
            if step == 2:
                with torch.no_grad():
                    for p in learner.parameters():
                        p.add_(1.0)
            outcomes = tree(by, learner.state_dict(), step, targets_of(generators))
            assert [(o.status, o.version) for o in outcomes] == [("ok", version(step))] * 7, outcomes
            assert all(same(snapshot(g.model), snapshot(learner)) for g in generators)
            assert {o.target.id: o.relayed_by for o in outcomes} == {
                "g0": "", "g1": "g0", "g2": "g1", "g3": "g0", "g4": "", "g5": "g4", "g6": "g4"}
            # the pusher's tensor bytes: two roots, so two copies of the model, whatever the tree's size
            assert sum(o.bytes for o in outcomes) == 2 * model_bytes(learner.state_dict())
    assert all(not g.relay.relaying for g in generators)


@pytest.mark.skipif(not shm_host(), reason="no writable /dev/shm on this machine")
def test_same_host_targets_keep_shared_memory_and_are_never_relayed(generators):
    learner = tiny_model(0)
    with pusher() as by:  # every target shares our /dev/shm
        outcomes = tree(by, learner.state_dict(), 1, targets_of(generators))
    assert all(o.status == "ok" and o.relayed_by == "" and o.route == Route.SHM for o in outcomes)
    assert all(same(snapshot(g.model), snapshot(learner)) for g in generators)


def test_a_relay_node_killed_mid_relay_leaves_its_subtree_to_the_pusher(generators):
    """g0 commits, relays to g3 and to g1; g1 is mid-batch on another push, so g0's stream waits unread.
    g0 dies: the pusher sees it gone and pushes to g1 itself, with g1's part of the tree (g2)."""
    g0, g1 = generators[0], generators[1]
    g1.gated.gate.clear()
    with across_hosts() as side:  # g1 busy applying version 1
        busy = threading.Thread(target=side.push, args=(tiny_model(7).state_dict(), version(1),
                                                        [PushTarget("g1", g1.address)]))
        busy.start()
        assert g1.gated.entered.wait(WAIT_S)
        learner, result = tiny_model(0), []
        with across_hosts() as by:
            push = threading.Thread(target=lambda: result.extend(
                tree(by, learner.state_dict(), 2, targets_of(generators))))
            push.start()
            wait_for(lambda: generators[3].receiver.version == version(2) and g0.relay.relaying,
                     "g0 to commit and relay to g3, and to be still relaying to g1")
            g0.stop()
            g1.gated.gate.set()
            push.join(WAIT_S)
            busy.join(WAIT_S)
    assert not push.is_alive()
    outcomes = {o.target.id: o for o in result}
    assert all(o.status == "ok" for o in outcomes.values()), outcomes
    assert outcomes["g1"].relayed_by == "" and outcomes["g1"].bytes > 0  # the pusher streamed it
    assert outcomes["g2"].relayed_by == "g1"  # and the relay went on below it
    assert outcomes["g3"].relayed_by == "g0"
    for g in generators[1:]:  # every live receiver serves the new version
        assert g.receiver.version == version(2) and same(snapshot(g.model), snapshot(learner))


def test_a_receiver_the_relay_cannot_reach_is_reported_and_its_subtree_is_pushed_to(generators):
    learner = tiny_model(0)
    with across_hosts(timeout_s=10) as by:
        # the pusher asks each target once how to reach it: all answer, so g1 stays in the tree
        first = tree(by, tiny_model(5).state_dict(), 1, targets_of(generators))
        assert all(o.status == "ok" for o in first)
        generators[1].stop()  # g1, relayed to by g0, relays to g2
        outcomes = {o.target.id: o for o in tree(by, learner.state_dict(), 2, targets_of(generators))}
    assert outcomes["g1"].status == "unreachable"
    assert outcomes["g2"].status == "ok" and outcomes["g2"].relayed_by == ""
    assert all(outcomes[f"g{i}"].status == "ok" for i in (0, 3, 4, 5, 6))
    assert all(same(snapshot(g.model), snapshot(learner)) for i, g in enumerate(generators) if i != 1)


def test_a_refused_push_relays_nothing(generators):
    root, child = generators[0], generators[1]
    learner = tiny_model(0)
    with across_hosts() as by:
        assert by.push(learner.state_dict(), version(2), [root.target_id])[0].status == "ok"
        stale = by.prepare(learner.state_dict(), version(1))  # g0 serves 2
        (refused,) = by.send(stale, [root.target_id], RelayPlan({root.target_id: [child.target_id]}, 2))
    assert (refused.status, refused.reason) == ("rejected", Reason.STALE_VERSION)
    time.sleep(0.5)
    assert child.receiver.version.step == 0 and not root.relay.relaying  # g1 would have taken version 1


def light_receiver(tensors, stack: ExitStack):
    """A WeightSync server over plain tensors (no model), relaying, its applies gated."""
    gated = Gated(Tensors({k: torch.zeros_like(v) for k, v in tensors.items()}))
    receiver = WeightReceiver(gated)
    relay = Relay(relay_pusher(ClientAccess(TOKEN), 4 << 20, 60.0))
    server, port = serve(receiver, access=ServerAccess(TOKEN), relay=relay)
    stack.callback(relay.close)
    stack.callback(server.stop, 0)
    return gated, receiver, f"127.0.0.1:{port}"


def test_a_push_arriving_mid_relay_stages_elsewhere_and_the_relayed_bytes_stay_intact():
    """The root relays version 2 to a child that does not read yet (busy applying), large enough that the
    relay's stream stalls part-way; versions 3 and 4 reach the root meanwhile. The child still gets version 2
    exactly (its checksums are the learner's: bytes overwritten under the relay would be refused)."""
    v1 = {f"w{i}": torch.randn(1024, 1024) for i in range(12)}  # 48 MB: more than gRPC's flow-control windows
    v2 = {k: t + 1 for k, t in v1.items()}
    with ExitStack() as stack:
        _, root, root_address = light_receiver(v1, stack)
        child_gate, child, child_address = light_receiver(v1, stack)
        by = stack.enter_context(across_hosts(chunk_bytes=4 << 20, timeout_s=WAIT_S))
        child_gate.gate.clear()
        busy = threading.Thread(target=by.push, args=(v2, version(1), [PushTarget("c", child_address)]))
        busy.start()  # the child applies a version 1 of other bytes, waiting at its gate
        assert child_gate.entered.wait(WAIT_S)
        root_target, child_target = PushTarget("r", root_address), PushTarget("c", child_address)
        relayed = RelayPlan({root_target: [child_target]}, 1)
        (first,) = by.send(by.prepare(v1, version(2)), [root_target], relayed)
        assert first.status == "ok"
        for step in (3, 4):  # the relay of 2 still reads; 2's buffers are free for staging again after 3
            (later,) = by.push(v2, version(step), [root_target])
            assert later.status == "ok" and root.version == version(step)
        child_gate.gate.set()
        busy.join(WAIT_S)
        wait_for(lambda: child.version == version(2), "the child to commit the relayed version 2")
        got = child.target.named_tensors()
        assert all(torch.equal(got[k], v1[k]) for k in v1)
