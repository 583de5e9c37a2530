"""A receiver-side stand-in for the generator service, a tiny model, and comparisons of exact state."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrlhf.weights.channel import DataListener
from asyncrlhf.weights.pusher import PushTarget, WeightPusher
from asyncrlhf.weights.receiver import ModuleTarget, WeightReceiver
from asyncrlhf.weights.relay import Relay
from asyncrlhf.weights.server import serve

TOKEN = "s3cret"
CHUNK = 8 << 10  # small, so every tensor of the tiny model spans several chunks
DATA_CHANNEL = {"on": True}  # whether a `Generator` offers a data channel (the `data_path` fixture sets it)


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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


class Generator:
    """A receiver-side stand-in for the generator service: a live model behind a WeightSync server that
    relays when a push asks it to, with a data channel unless `DATA_CHANNEL` says none."""

    def __init__(self, seed: int = 1, token: str | None = TOKEN, names=None, data: bool | None = None):
        self.model = tiny_model(seed)
        self.target = ModuleTarget(self.model, names)
        self.gated = Gated(self.target)
        self.receiver = WeightReceiver(self.gated)
        self.relay = Relay(token, chunk_bytes=CHUNK)
        self.data = DataListener() if (DATA_CHANNEL["on"] if data is None else data) else None
        self.server, self.port = serve(self.receiver, token=token, relay=self.relay, data=self.data)
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        """As if killed: the server stops, relays in flight are cut, the data channel closes."""
        self.server.stop(0)
        self.relay.close()
        if self.data is not None:
            self.data.close()


def push(pusher: WeightPusher, state, version, gen: Generator, **kw):
    (outcome,) = pusher.push(state, version, [PushTarget("g0", gen.address)], **kw)
    return outcome
