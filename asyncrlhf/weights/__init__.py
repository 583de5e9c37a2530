"""WeightSync: the learner pushes versioned weights to every generator over gRPC, staged and swapped
atomically. One module per concern:

    vocabulary.py  `Route`, `Reason` (every refusal), `PushRejected`; the reason in gRPC trailing metadata
    codec.py       the wire format: tensors <-> WeightChunk bytes, dtypes, XXH3-64, `Snapshot` (one version)
    target.py      `WeightTarget`, the one interface that applies weights
                   (`apply_weights(tensors, version: PolicyVersion, adopt=...)`), `ModuleTarget`, `swap_in`
    access.py      token, TLS (the files of run.grpc_tls as credentials and ssl contexts) and channels:
                   `ClientAccess` (pusher, relay), `ServerAccess` (server)
    routes.py      one interface per end of a route: `Sender` (learner) and `Source` (generator); the registry
                   of routes (`RouteSpec`: both ends, GetStatus offer, whole-only, fallbacks)
    the routes, each registering itself where its two ends meet:
      stream.py            the gRPC byte stream, the route of last resort
      channel.py           the data channel, both ends' shared part and the learner end; channel_read.py the
                           generator end (registered there)
      shm.py, shm_read.py  shared memory: learner end, generator end (registered there)
      collective.py        a broadcast round, both ends' shared part; collective_sender.py the learner end,
                           collective_member.py the generator end (registered there); an inference
                           engine's worker receiving it: `asyncrlhf.sampling.hops.engine_member`
    receiver.py    stage, verify, atomic swap (`WeightReceiver`); staging.py: one tensor staged before the
                   commit (copied, or a placeholder for bytes another process holds); leases.py: bytes
                   adopted in place
    server.py      the gRPC servicer (proto <-> receiver, refusals -> status codes in one place), `serve`
    pusher.py      the learner's side: probe -> route -> sender, to many servers at once
    delta.py       delta pushes, both ends (entered only when learner.push_delta is on)
    relay.py       relays: the tree (`plan`), a generator forwarding what it committed (`Relay`), and the
                   learner following the tree and pushing around a failed relay (`TreePush`)

One push on the plain path (the stream route, no delta, no relay) reads, in order:
services/learner/sync.py -> pusher.py -> stream.py -> server.py -> receiver.py.

The names below are the package's API; code inside the package imports from the owning module.
"""

# The routes register themselves on import (`routes.register`): every user of the package has them.
from asyncrlhf.weights import channel_read, collective_member, shm_read, stream  # noqa: F401
from asyncrlhf.weights.access import ClientAccess, ServerAccess
from asyncrlhf.weights.codec import Snapshot, adapter_tensors, prepare
from asyncrlhf.weights.pusher import Encoding, PushOutcome, PushStatus, PushTarget, WeightPusher
from asyncrlhf.weights.receiver import WeightReceiver
from asyncrlhf.weights.relay import Relay, TreePush
from asyncrlhf.weights.server import serve
from asyncrlhf.weights.target import ModuleTarget, WeightTarget, swap_in
from asyncrlhf.weights.vocabulary import PushRejected, Reason, Route

__all__ = [
    "ClientAccess",
    "Encoding",
    "ModuleTarget",
    "PushOutcome",
    "PushRejected",
    "PushStatus",
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
