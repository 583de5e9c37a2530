"""Tokens sampled twice in a chaos run of continuous generators (`asyncrlhf bench chaos --tokens`).

Every token a generator samples ends in one of three places: a group it or another generator wrote (its
sample's length counts it, however many generators it passed through), the progress of a group still in
flight when the run ended (a handed-on prompt in the prompts stream, or a save), or nowhere: sampled after
the last save of a generator that was killed, so sampled again by whoever continued the group. So

    regenerated = sampled - written - in flight at the end

`sampled` and `written`: each generator process's own counters, read from its /metrics just before the bench
kills it, or from the line it logs when it stops ("generator stopped: S tokens sampled, W written in
groups"). The tokens a killed generator samples between that last read and the kill are missed: at most one
engine step's (one token per running sample). A batch-mode generator counts its tokens only when the batch
is written, so this sum says nothing about batch mode: there every sample in flight at a kill restarts from
its first token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from asyncrlhf import metrics as names
from asyncrlhf._proto.rollout_pb2 import PromptGroup
from asyncrlhf.scrape import Snapshot, read_exposition
from asyncrlhf.streams import PARTIALS, PAYLOAD_FIELD, PROMPTS, RunStreams
from asyncrlhf.streams.partials import partial_tokens

STOPPED = re.compile(r"generator stopped: (\d+) tokens sampled, (\d+) written in groups")
HTTP_PORT = re.compile(r"generator\.http_port=(\d+)")


@dataclass
class KillReading:
    """A generator's counters read just before the bench killed it."""

    sampled: float
    written: float
    running: float  # samples in its engine at its last step


@dataclass
class TokenLedger:
    kills: list[KillReading] = field(default_factory=list)
    unread: int = 0  # kills whose generator did not answer the read before it: the figure errs low
    stopped_sampled: int = 0  # the processes that stopped by themselves (their log line)
    stopped_written: int = 0
    in_flight_at_end: int = 0

    @property
    def sampled(self) -> float:
        return sum(k.sampled for k in self.kills) + self.stopped_sampled

    @property
    def written(self) -> float:
        return sum(k.written for k in self.kills) + self.stopped_written

    @property
    def regenerated(self) -> float:
        return self.sampled - self.written - self.in_flight_at_end

    def summary(self, save_every_tokens: int) -> dict:
        in_flight = sum(k.running for k in self.kills)
        return {"tokens_sampled": int(self.sampled), "tokens_written": int(self.written),
                "tokens_in_flight_at_end": self.in_flight_at_end, "tokens_regenerated": int(self.regenerated),
                "samples_in_flight_at_kills": int(in_flight),
                "regenerated_per_sample_in_flight": self.regenerated / in_flight if in_flight else 0.0,
                "bound_per_sample": save_every_tokens, "unread_kills": self.unread}


def read_before_kill(pid: int, capacity: int, timeout_s: float = 2.0) -> KillReading | None:
    """The counters of the generator `pid` (its HTTP port from its command line); None if it did not answer
    (it is then counted as if it had sampled nothing: the figure errs low)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    port = HTTP_PORT.search(cmdline)
    if port is None:
        return None
    try:
        text = httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=timeout_s).text
    except httpx.HTTPError:
        return None
    snap = Snapshot()
    read_exposition(text, "victim", snap)
    values = snap.per_service["victim"]
    return KillReading(values.get(names.GENERATOR_TOKENS_TOTAL, 0.0),
                       values.get(names.GENERATOR_WRITTEN_TOKENS_TOTAL, 0.0),
                       values.get(names.GENERATOR_ENGINE_OCCUPANCY, 0.0) * capacity)


def add_stopped(ledger: TokenLedger, logs: Path) -> None:
    """The counters every generator process logged when it stopped by itself."""
    for log in sorted(logs.glob("generator*.log")):
        for sampled, written in STOPPED.findall(log.read_text(errors="replace")):
            ledger.stopped_sampled += int(sampled)
            ledger.stopped_written += int(written)


def in_flight_tokens(client, run_name: str, ended: set[str]) -> int:
    """Tokens of the unfinished samples the run left: per group not ended, the further of its prompt entry's
    handed-on progress and its save (as a generator continuing it would pick)."""
    streams = RunStreams(client, run_name)
    best: dict[str, int] = {}
    for _, fields in client.xrange(streams.key(PROMPTS.name)):
        group = PromptGroup.FromString(fields.get(PAYLOAD_FIELD, b""))
        best[group.group_id] = max(best.get(group.group_id, 0), partial_tokens(group))
    for gid, raw in client.hgetall(streams.key(PARTIALS)).items():
        group_id = gid.decode(errors="replace")
        best[group_id] = max(best.get(group_id, 0), partial_tokens(PromptGroup.FromString(raw)))
    return sum(tokens for gid, tokens in best.items() if gid not in ended)
