"""Which route each generator gets, without a network: the first sender that accepts its GetStatus, asked
once per address; a registered route's two kinds of fallback (avoid the route from then on, or ask again);
the registry's order."""

from __future__ import annotations

import grpc
import pytest

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.pusher import Routes
from asyncrlhf.weights.routes import Fallback, Unreachable, last_resort, registered, spec_of
from asyncrlhf.weights.vocabulary import REASON_KEY, Reason, Route

pytestmark = pytest.mark.unit


class Accepting:
    """A sender that accepts the generators `accept(status)` says, and records what it was told."""

    def __init__(self, route: Route, accept):
        self.route, self.accept, self.forgotten = route, accept, []

    def accepts(self, address, status):
        return self.accept(status)

    def forget(self, address):
        self.forgotten.append(address)


class Status:
    """GetStatus by address, counting the calls; an address absent raises the gRPC error `code`."""

    def __init__(self, replies: dict[str, pb.GetStatusReply], code=grpc.StatusCode.UNAVAILABLE):
        self.replies, self.code, self.asked = replies, code, []

    def __call__(self, address):
        self.asked.append(address)
        if address not in self.replies:
            err = grpc.RpcError()
            err.code = lambda: self.code
            raise err
        return self.replies[address]


def routes(status: Status):
    shm = Accepting(Route.SHM, lambda s: s.shm_host == "here")
    data = Accepting(Route.DATA, lambda s: s.data_port > 0)
    stream = Accepting(Route.STREAM, lambda s: True)
    return Routes([shm, data, stream], status), shm, data


def test_the_first_sender_that_accepts_wins_and_each_address_is_asked_once():
    status = Status({"local": pb.GetStatusReply(shm_host="here", data_port=9),
                     "remote": pb.GetStatusReply(data_port=9), "plain": pb.GetStatusReply()})
    table, _, _ = routes(status)
    for _ in range(2):
        assert [table.route(a) for a in ("local", "remote", "plain")] == [Route.SHM, Route.DATA, Route.STREAM]
    assert status.asked == ["local", "remote", "plain"]


def test_a_generator_that_does_not_answer_is_unreachable_and_asked_again():
    status = Status({})
    table, _, _ = routes(status)
    gone = Unreachable(grpc.StatusCode.UNAVAILABLE)
    assert table.route("gone") == gone
    assert table.route("gone") == gone and status.asked == ["gone", "gone"]
    assert routes(Status({}, grpc.StatusCode.UNAUTHENTICATED))[0].route("x") == Route.STREAM  # the push says


def refused(reason: Reason) -> grpc.RpcError:
    err = grpc.RpcError()
    err.trailing_metadata = lambda: ((REASON_KEY, reason.value),)
    return err


def test_a_route_fallen_back_from_is_avoided_or_asked_again_as_its_spec_says():
    status = Status({"local": pb.GetStatusReply(shm_host="here", data_port=9),
                     "remote": pb.GetStatusReply(data_port=9)})
    table, shm, data = routes(status)
    table.route("local"), table.route("remote")
    assert spec_of(Route.SHM).fallbacks[Reason.SHM_UNAVAILABLE] == Fallback(avoid=True)
    assert table.fall_back("local", Route.SHM, refused(Reason.SHM_UNAVAILABLE)) == Route.STREAM
    assert table.route("local") == Route.DATA and shm.forgotten == ["local"]  # its next route, unasked
    assert spec_of(Route.DATA).fallbacks[OSError] == Fallback(avoid=False)
    assert table.fall_back("remote", Route.DATA, OSError("refused")) == Route.STREAM
    assert table.route("remote") == Route.DATA and data.forgotten == ["remote"]
    assert status.asked == ["local", "remote", "remote"]  # asked again: a restart may have moved its port
    # a refusal the route lists no fallback for is the push's outcome
    assert table.fall_back("remote", Route.DATA, refused(Reason.BAD_CHECKSUM)) is None


def test_the_registry_lists_every_route_in_order_of_preference_the_stream_last():
    assert [spec.route for spec in registered()] == [Route.COLLECTIVE, Route.SHM, Route.DATA, Route.STREAM]
    assert last_resort() == Route.STREAM
    assert [spec.route for spec in registered() if spec.whole] == [Route.COLLECTIVE]
    with pytest.raises(ValueError, match="no route `toy` is registered; the routes are: collective, shm"):
        spec_of(Route("toy"))


def test_a_pusher_with_only_the_stream_asks_nobody():
    status = Status({})
    assert Routes([Accepting(Route.STREAM, lambda s: True)], status).route("x") == Route.STREAM
    assert status.asked == []
