"""The route contract: every route (shared memory, data channel, gRPC stream, relay, collective broadcast on
gloo, received by the generator or by its inference engine's worker) refuses every faulty push for its
`Reason`, keeps the old version serving bit for bit, and orders versions by lineage then step.

The route is a fixture parameter, one per registered route (`routes.Direct`), the relay (`routes.Relayed`) and
the collective route received by an engine's worker; each fault is planted on the last hop's sender
(`routes.Faulty`); the refusal is read where a pusher reads it, in the call's trailing metadata. A new route
is in the suite once registered."""

from __future__ import annotations

import grpc
import pytest

from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.codec import Snapshot, prepare
from asyncrlhf.weights.pusher import PushStatus
from asyncrlhf.weights.routes import registered
from asyncrlhf.weights.vocabulary import Reason, Route
from tests.integration.weights.helpers import same, snapshot, tiny_model
from tests.integration.weights.routes import FALLING_BACK, REFUSALS, SERVED, Direct, Relayed, sender

pytestmark = pytest.mark.integration


ENGINE = "collective-engine"  # the collective route received by an inference engine's worker


@pytest.fixture(params=[*(spec.route for spec in registered()), Route.RELAY, ENGINE],
                ids=lambda r: getattr(r, "value", r))
def route(request):
    if isinstance(request.param, Route) and request.param != Route.RELAY:
        made = sender(request.param)
        if made is None:
            pytest.skip(f"the {request.param} route cannot be taken here (e.g. no writable /dev/shm)")
        made.close()
    if request.param == ENGINE:
        return Direct(Route.COLLECTIVE, engine=True)
    return Relayed() if request.param == Route.RELAY else Direct(request.param)


def pushed(model, version: PolicyVersion) -> Snapshot:
    return Snapshot(version, prepare(model.state_dict()))


@pytest.fixture
def serving(route, learner):
    """A generator serving `SERVED`, the learner's weights, pushed over the route."""
    gen = route.generator()
    outcome = route.push(gen, pushed(learner, SERVED))
    assert (outcome.status, outcome.version) == (PushStatus.OK, SERVED), outcome.detail
    assert same(snapshot(gen.model), snapshot(learner))
    yield gen
    gen.stop()


def test_a_push_lands_bit_exact_over_the_route(route, serving):
    newer = tiny_model(seed=7)
    outcome = route.push(serving, pushed(newer, PolicyVersion(1, 2)))
    assert (outcome.status, outcome.version) == (PushStatus.OK, PolicyVersion(1, 2)), outcome.detail
    assert same(snapshot(serving.model), snapshot(newer)) and serving.receiver.version == PolicyVersion(1, 2)
    if isinstance(route, Direct):
        assert outcome.route == route.route  # taken, not fallen back from
    if serving.engine is not None:  # both versions verified and loaded by the worker, none staged here
        assert serving.engine.taken == 2 and not serving.receiver.buffers.storages()


@pytest.mark.parametrize("fault", REFUSALS, ids=lambda f: f.reason.value)
def test_a_refused_push_keeps_the_old_version_serving(route, serving, fault):
    before = snapshot(serving.model)
    outcome = route.push(serving, pushed(tiny_model(seed=7), PolicyVersion(1, 2)), fault)
    assert (outcome.status, outcome.reason) == (PushStatus.REJECTED, fault.reason), outcome.detail
    assert outcome.detail.startswith(fault.reason.value)
    assert same(snapshot(serving.model), before) and serving.receiver.version == SERVED
    newer = tiny_model(seed=8)  # and the next good push lands
    assert route.push(serving, pushed(newer, PolicyVersion(1, 3))).status == PushStatus.OK
    assert same(snapshot(serving.model), snapshot(newer))


def test_a_push_without_the_token_is_refused_and_the_old_version_serves(route, serving):
    before = snapshot(serving.model)
    outcome = route.push(serving, pushed(tiny_model(seed=7), PolicyVersion(1, 2)), token="wrong")
    assert (outcome.status, outcome.reason, outcome.code) == (PushStatus.REJECTED, Reason.UNAUTHENTICATED,
                                                              grpc.StatusCode.UNAUTHENTICATED)
    assert same(snapshot(serving.model), before) and serving.receiver.version == SERVED


def test_a_route_the_receiver_cannot_use_gives_way_to_the_stream(route, serving):
    if not isinstance(route, Direct) or route.route not in FALLING_BACK:
        pytest.skip(f"{route.route.value}: no refusal that makes it fall back (RouteSpec.fallbacks)")
    newer = tiny_model(seed=7)
    outcome = route.push(serving, pushed(newer, PolicyVersion(1, 2)), FALLING_BACK[route.route])
    assert (outcome.status, outcome.route) == (PushStatus.OK, Route.STREAM), outcome.detail
    assert route.last is not None and route.last.begun == 1  # the route was tried first
    assert same(snapshot(serving.model), snapshot(newer))


# (lineage, step) pushed in turn -> the refusal, or None: accepted. A restarted learner begins a new lineage
# and resumes from a checkpoint, at a lower step; the learner it replaced is refused.
ORDER = [((1, 9), None), ((2, 4), None), ((1, 10), Reason.STALE_LINEAGE), ((2, 4), Reason.STALE_VERSION),
         ((2, 3), Reason.STALE_VERSION), ((2, 5), None)]


def test_versions_go_forward_by_lineage_then_step(route, learner):
    gen = route.generator()
    try:
        served = PolicyVersion(0, 0)
        for (lineage, step), refusal in ORDER:
            outcome = route.push(gen, pushed(learner, PolicyVersion(lineage, step)))
            assert outcome.reason == refusal, (lineage, step, outcome.detail)
            served = PolicyVersion(lineage, step) if refusal is None else served
            assert gen.receiver.version == served
    finally:
        gen.stop()
