"""WeightSync: the learner pushes versioned weights to every generator over gRPC, staged and swapped
atomically. One module per concern:

    vocabulary.py  `Route`, `Reason` (every refusal), `PushRejected`; the reason in gRPC trailing metadata
    codec.py       the wire format: tensors <-> WeightChunk bytes, dtypes, XXH3-64, `Snapshot` (one version)
    target.py      `WeightTarget`, the one interface that applies weights
                   (`apply_weights(tensors, version: PolicyVersion, adopt=...)`), `ModuleTarget`, `swap_in`
    access.py      token, TLS and channels: `ClientAccess` (pusher, relay), `ServerAccess` (server)
    routes.py      one interface per end of a route: `Sender` (learner) and `Source` (generator); `Routes`,
                   which route each generator gets, and `FALLBACKS`, what a failed route gives way to
    stream.py      the gRPC byte stream route        channel.py  the data channel route
    shm.py         the shared-memory route (learner) shm_read.py its generator end
    receiver.py    stage, verify, atomic swap (`WeightReceiver`); staging.py, leases.py: its parts
    server.py      the gRPC servicer (proto <-> receiver, refusals -> status codes in one place), `serve`
    pusher.py      the learner's side: probe -> route -> sender, to many servers at once
    relay.py       relays: the tree (`plan`), a generator forwarding what it committed (`Relay`), and the
                   learner following the tree and pushing around a failed relay (`TreePush`)

The names below are the package's API; code inside the package imports from the owning module.
"""

from asyncrlhf.weights.access import ClientAccess, ServerAccess
from asyncrlhf.weights.codec import Snapshot, adapter_tensors, prepare
from asyncrlhf.weights.pusher import PushOutcome, PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.relay import Relay, TreePush
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.target import ModuleTarget, WeightTarget, swap_in
from asyncrlhf.weights.vocabulary import PushRejected, Reason, Route

__all__ = [
    "ClientAccess",
    "ModuleTarget",
    "PushOutcome",
    "PushRejected",
    "PushTarget",
    "Reason",
    "Relay",
    "Route",
    "ServerAccess",
    "Snapshot",
    "TreePush",
    "WeightPusher",
    "WeightReceiver",
    "WeightTarget",
    "adapter_tensors",
    "prepare",
    "serve",
    "swap_in",
]
