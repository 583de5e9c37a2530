"""The worker-round hop: over the collective route, the engine's worker is the weight group's member itself
(`engine_member.py`), so a version goes from the learner's broadcast into the worker, never through the
generator's process; at the commit the worker verifies and loads the round it staged. A push whose bytes
are in the generator's process after all (the learner fell back to another route for it) goes through the
hop it hands over by (`handed`: shared memory or a file), as it would without the worker round."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import torch

from asyncrlhf.sampling.hops.engine_member import EngineMember, refusal
from asyncrlhf.sampling.hops.hop import Adapter, EngineHop, HopKind, land
from asyncrlhf.weights.collective_member import Member

JOIN_ROUNDS = "asyncrlhf_join_rounds"  # the worker extension's method that starts its `WorkerRounds`


class WorkerRound:
    """The generator's half: `member` joins each round through the worker; the worker's half takes the
    round's verified tensors (`worker.WorkerEnd`, `engine_member.WorkerRounds.take`)."""

    kind = HopKind.WORKER_ROUND

    def __init__(self, member: EngineMember, handed: EngineHop):
        self.member, self.handed = member, handed

    @classmethod
    def joined(cls, llm: Any, handed: EngineHop) -> WorkerRound:
        """Have the engine's one worker take the rounds (before any request: the RPC has the engine to
        itself), authenticated by a key of this generator's."""
        authkey = secrets.token_bytes(32)
        ((address, backends),) = llm.collective_rpc(JOIN_ROUNDS, args=(authkey,))
        return cls(EngineMember(address, authkey, backends), handed)

    @property
    def rounds(self) -> Member | None:
        return self.member

    def load(self, llm: Any, tensors: Mapping[str, torch.Tensor], adapter: Adapter | None = None) -> None:
        held = self.member.held(tensors)
        if held is None:  # the bytes are here
            self.handed.load(llm, tensors, adapter)
            return
        try:
            land(llm, self.kind, held, adapter)
        except Exception as err:  # the worker's refusal, its Reason in the message: nothing was loaded
            raise refusal(err) from err

    def close(self) -> None:
        self.member.close()
        self.handed.close()
