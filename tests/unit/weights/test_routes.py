"""Which route each generator gets, without a network: the first sender that accepts its GetStatus, asked
once per address; the fallback table's two kinds of row (avoid the route from then on, or ask again)."""

from __future__ import annotations

import grpc
import pytest

from asyncrlhf._proto import weights_pb2 as pb
from asyncrlhf.weights.routes import FALLBACKS, Routes, Unreachable
from asyncrlhf.weights.vocabulary import Reason, Route

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
    assert table.route("gone") == Unreachable("UNAVAILABLE")
    assert table.route("gone") == Unreachable("UNAVAILABLE") and status.asked == ["gone", "gone"]
    assert routes(Status({}, grpc.StatusCode.UNAUTHENTICATED))[0].route("x") == Route.STREAM  # the push says


def test_a_route_fallen_back_from_is_avoided_or_asked_again_as_the_table_says():
    status = Status({"local": pb.GetStatusReply(shm_host="here", data_port=9),
                     "remote": pb.GetStatusReply(data_port=9)})
    table, shm, data = routes(status)
    table.route("local"), table.route("remote")
    avoid = FALLBACKS[(Route.SHM, Reason.SHM_UNAVAILABLE)]
    assert (avoid.to, avoid.avoid) == (Route.STREAM, True)
    table.fall_back("local", Route.SHM, avoid)
    assert table.route("local") == Route.DATA and shm.forgotten == ["local"]  # its next route, unasked
    again = FALLBACKS[(Route.DATA, OSError)]
    assert (again.to, again.avoid) == (Route.STREAM, False)
    table.fall_back("remote", Route.DATA, again)
    assert table.route("remote") == Route.DATA and data.forgotten == ["remote"]
    assert status.asked == ["local", "remote", "remote"]  # asked again: a restart may have moved its port


def test_a_pusher_with_only_the_stream_asks_nobody():
    status = Status({})
    assert Routes([Accepting(Route.STREAM, lambda s: True)], status).route("x") == Route.STREAM
    assert status.asked == []
