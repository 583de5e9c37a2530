"""Engine hops: the generator -> inference engine step of a push (the learner -> generator step is a route,
`asyncrlhf.weights`). The generator has verified a version; a hop makes every worker of its vLLM engine load
it, full weights and unmerged LoRA adapters alike. One module per concern:

    hop.py            `EngineHop` (the one interface), `HopKind`, `Adapter`; `land`, the call into the workers
    factory.py        `engine_hop`: the one place the hop is chosen, from the config, as the engine starts
    in_process.py     the engine's worker runs in the generator's process: the tensors themselves
    shared_memory.py  an engine in processes of its own: a /dev/shm segment rewritten per version (`Handoff`)
    file.py           the same with no usable /dev/shm: a safetensors file per version, removed after it
    worker_round.py   the collective route's round, received by the engine's worker itself
    engine_member.py  its two halves: `EngineMember` (the generator's) and `WorkerRounds` (the worker's)
    line.py           the authenticated control line between them, a deadline on every message
    worker.py         `WorkerEnd`: every hop's worker half, in each vLLM worker

Code inside the package imports from the owning module.
"""

from asyncrlhf.sampling.hops.factory import engine_hop
from asyncrlhf.sampling.hops.hop import Adapter, EngineHop, HopKind

__all__ = ["Adapter", "EngineHop", "HopKind", "engine_hop"]
