"""WeightSync: the learner pushes versioned weights to every generator over gRPC, staged and swapped
atomically. One module per concern:

    codec.py     the wire format: tensors <-> WeightChunk bytes, dtypes, XXH3-64 checksums, adapter tensors
    receiver.py  stage, verify, atomic swap; `WeightTarget`, the one interface that applies weights
                 (`apply_weights(tensors, version, adopt=...)`), `ModuleTarget`, `swap_in`, `PushRejected`
    server.py    the gRPC servicer (proto <-> receiver, refusals -> status codes in one place), token auth,
                 `serve`
    pusher.py    the learner's side: fan-out to many servers, channels, which path each target gets
    shm.py       the same-host data plane: the pusher's /dev/shm segment, written once per version, and the
                 receiver's read-only view of it (docs/weights.md: where CUDA IPC / NCCL slot in)
    stream.py    the cross-host byte stream of a version, encoded once for every streamed target
    relay.py     relays: the tree (`plan`), a generator forwarding what it committed (`Relay`), and the
                 learner following the tree and pushing around a failed relay (`TreePush`)

The names below are the package's API; code inside the package imports from the owning module.
"""

from asyncrlhf.weights.codec import adapter_tensors, prepare
from asyncrlhf.weights.pusher import PushOutcome, PushTarget, WeightPusher
from asyncrlhf.weights.receiver import ModuleTarget, PushRejected, WeightReceiver, WeightTarget, swap_in
from asyncrlhf.weights.relay import Relay
from asyncrlhf.weights.server import serve

__all__ = [
    "ModuleTarget",
    "PushOutcome",
    "PushRejected",
    "PushTarget",
    "Relay",
    "WeightPusher",
    "WeightReceiver",
    "WeightTarget",
    "adapter_tensors",
    "prepare",
    "serve",
    "swap_in",
]
