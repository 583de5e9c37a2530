"""A receiver-side stand-in for the generator service, a tiny model, pushers over chosen routes, and
comparisons of exact state."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Collection, Mapping

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrlhf.sampling.hops.engine_member import EngineMember, WorkerRounds
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights.access import ClientAccess, ServerAccess
from asyncrlhf.weights.channel_read import DataListener
from asyncrlhf.weights.collective_member import CollectiveMember, Member
from asyncrlhf.weights.pusher import PushOutcome, PushTarget, WeightPusher
from asyncrlhf.weights.receiver import NO_VERSION, WeightReceiver
from asyncrlhf.weights.relay import Relay, relay_pusher
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.target import ModuleTarget
from asyncrlhf.weights.vocabulary import Route

TOKEN = "s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)  # the call metadata of a hand-written push
CHUNK = 8 << 10  # small, so every tensor of the tiny model spans several chunks
# The routes a pusher may use to reach a generator on the route named, as across hosts where it is not shm.
ONLY = {Route.STREAM: (Route.STREAM,), Route.DATA: (Route.DATA, Route.STREAM),
        Route.SHM: (Route.SHM, Route.STREAM)}


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def version(step: int, lineage: int = 0) -> PolicyVersion:
    return PolicyVersion(lineage, step)


def pusher(token: str | None = TOKEN, routes: Collection[Route] | None = None, **kw) -> WeightPusher:
    return WeightPusher(ClientAccess(token), chunk_bytes=kw.pop("chunk_bytes", CHUNK), routes=routes, **kw)


class Gated:
    """A `WeightTarget` that lets each apply through only while `gate` is set (it is, at first); `entered` is
    set once an apply waits or passes: a generator mid-batch, observable."""

    def __init__(self, target):
        self.target, self.gate, self.entered = target, threading.Event(), threading.Event()
        self.gate.set()

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self.target.named_tensors()

    def apply_weights(self, tensors, version, *, adopt=False):
        self.entered.set()
        self.gate.wait()
        return self.target.apply_weights(tensors, version, adopt=adopt)


class EngineHeld:
    """A `WeightTarget` whose collective rounds an inference engine's worker receives
    (`engine_member.WorkerRounds`; here in this process, over its own socket, loading into the module as a
    vLLM worker loads into its model)."""

    def __init__(self, target):
        key = secrets.token_bytes(16)
        self.target, self.rounds = target, WorkerRounds("cpu", key)
        self.member = EngineMember(self.rounds.address, key, self.rounds.backends)
        self.taken = 0  # rounds loaded from the worker's staging

    def named_tensors(self) -> Mapping[str, torch.Tensor]:
        return self.target.named_tensors()

    def apply_weights(self, tensors, version, *, adopt=False):
        held = self.member.held(tensors)
        if held is None:
            return self.target.apply_weights(tensors, version, adopt=adopt)
        group, round_id, places = held
        # the receiver waited for the worker to stage every bucket before it took the target (an engine
        # is paused for the load alone)
        assert self.rounds.staged(group, round_id).wait(0), "the round was still arriving at the commit"
        taken = self.rounds.take(group, round_id, places)
        self.taken += 1
        return self.target.apply_weights(taken, version)  # copied: the stage is reused

    def close(self) -> None:
        self.member.close()
        self.rounds.close()


class Generator:
    """A receiver-side stand-in for the generator service: a live model behind a WeightSync server that
    relays when a push asks it to (with `relay`, else a relay of the run's token), with a data channel when
    `data`, joining weight groups when `collective` (through an engine's worker, `EngineHeld`, when
    `engine`); `ends`: its standing end of any other route, by the route's name."""

    def __init__(self, seed: int = 1, token: str | None = TOKEN, names=None, data: bool = True,
                 relay: Relay | None = None, collective: bool = False, engine: bool = False, **ends):
        self.model = tiny_model(seed)
        self.target = ModuleTarget(self.model, names)
        self.engine = EngineHeld(self.target) if engine else None
        self.gated = Gated(self.engine or self.target)
        self.data = DataListener() if data else None
        self.collective: Member | None = None
        if collective:
            self.collective = self.engine.member if self.engine is not None else CollectiveMember()
        self.receiver = WeightReceiver(self.gated, NO_VERSION, data=self.data, collective=self.collective,
                                       **ends)
        self.relay = relay or Relay(relay_pusher(ClientAccess(token), CHUNK, 60.0))
        self.server, self.port = serve(self.receiver, access=ServerAccess(token), relay=self.relay)
        self.address = f"127.0.0.1:{self.port}"
        self.target_id = PushTarget(f"gen-{self.port}", self.address)

    def stop(self) -> None:
        """As if killed: the server stops, relays in flight are cut, the data channel closes."""
        self.server.stop(0)
        self.relay.close()
        if self.data is not None:
            self.data.close()
        if self.collective is not None:
            self.collective.close()
        if self.engine is not None:
            self.engine.close()


def push(by: WeightPusher, state, step: int, gen: Generator, lineage: int = 0, **kw) -> PushOutcome:
    (outcome,) = by.push(state, version(step, lineage), [PushTarget("g0", gen.address)], **kw)
    return outcome


def serve_collective_generator(conn) -> None:
    """A `Generator` joining weight groups in a process of its own (a child, to be killed): sends its address,
    then serves until killed."""
    gen = Generator(seed=2, data=False, collective=True)
    conn.send(gen.address)
    conn.recv()
