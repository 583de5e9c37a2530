"""Rank 0's step groups to every learner rank, as length-prefixed serialized protobufs (never pickle), each
with its staleness decision (per token, where its tokens span versions)."""

from __future__ import annotations

import torch

from asyncrlhf._proto.rollout_pb2 import RolloutGroup
from asyncrlhf.algorithms import StalenessDecision
from asyncrlhf.algorithms.offpolicy import StaleAction
from asyncrlhf.training.batch import TrainGroup

_ACTIONS: tuple[StaleAction, ...] = ("fresh", "keep", "correct", "drop")


def broadcast_groups(groups: list[TrainGroup] | None, rank: int, world: int) -> list[TrainGroup] | None:
    """Rank 0 passes the step's groups (None: the run ends); every rank returns them."""
    if world == 1:
        return groups
    import torch.distributed as dist

    if rank == 0:
        header = _header(groups)
        size = torch.tensor([header.numel()], dtype=torch.long)
    else:
        size = torch.zeros(1, dtype=torch.long)
    dist.broadcast(size, 0)
    if rank != 0:
        header = torch.zeros(int(size), dtype=torch.long)
    dist.broadcast(header, 0)
    count = int(header[0])
    if count < 0:
        return None
    columns = header[1:].view(4, count).tolist() if count else [[], [], [], []]
    lengths, staleness, actions, fresh_from = columns
    blob = b"".join(g.message.SerializeToString() for g in groups) if rank == 0 and groups else b""
    payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob \
        else torch.zeros(sum(lengths), dtype=torch.uint8)
    dist.broadcast(payload, 0)
    raw, out, offset = payload.numpy().tobytes(), [], 0
    for n, age, action, fresh in zip(lengths, staleness, actions, fresh_from, strict=True):
        message = RolloutGroup()
        message.ParseFromString(raw[offset : offset + n])
        decision = StalenessDecision(age, _ACTIONS[action], None if fresh < 0 else fresh)
        out.append(TrainGroup(message, decision))
        offset += n
    return out


def _header(groups: list[TrainGroup] | None) -> torch.Tensor:
    """[count, lengths..., staleness..., action codes..., fresh_from (-1: None)...], or [-1] when the run
    ends."""
    if groups is None:
        return torch.tensor([-1], dtype=torch.long)
    lengths = [g.message.ByteSize() for g in groups]
    staleness = [g.decision.staleness for g in groups]
    actions = [_ACTIONS.index(g.decision.action) for g in groups]
    fresh_from = [-1 if g.decision.fresh_from is None else g.decision.fresh_from for g in groups]
    return torch.tensor([len(groups), *lengths, *staleness, *actions, *fresh_from], dtype=torch.long)
