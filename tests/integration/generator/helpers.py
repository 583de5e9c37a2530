"""Start generator processes, push weights the way the learner does, enqueue prompts and read rollouts."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import redis
import torch

from asyncrlhf._proto.rollout_pb2 import PromptGroup, RolloutGroup
from asyncrlhf.redis_server import free_port
from asyncrlhf.registry import Member, Registry
from asyncrlhf.streams import PAYLOAD_FIELD, PROMPTS, ROLLOUTS, RunStreams, run_key
from asyncrlhf.version import PolicyVersion
from asyncrlhf.weights import PushTarget, WeightPusher

ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 180  # import torch + build the tiny model, on a few shared cores
WAIT_S = 120
T = TypeVar("T")


class GeneratorProcess:
    """`python -m services.generator` on configs/tiny.yaml, logging to a temp file."""

    def __init__(self, redis_url: str, run: str, *overrides: str):
        self.http_port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix="generator-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "services.generator", "--config", "configs/tiny.yaml",
               f"redis.url={redis_url}", f"run.name={run}", f"generator.http_port={self.http_port}",
               "generator.device=cpu", "generator.threads=1", "redis.block_ms=200", *overrides]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"generator exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log_path.unlink(missing_ok=True)


def wait_for(condition: Callable[[], T], what: str, timeout_s: float = WAIT_S,
             alive: Iterable[GeneratorProcess] = ()) -> T:
    """Poll `condition` until it returns something truthy; fail after `timeout_s` or if a process died."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout_s
    while True:
        for process in alive:
            process.check_alive()
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            tails = "\n---\n".join(p.log_tail() for p in alive)
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{tails}")
        pause.wait(0.1)


def members(client: redis.Redis, run: str) -> list[Member]:
    return Registry(client, run).live()


def push(state: dict[str, torch.Tensor], version: int, targets: list[Member]) -> None:
    """Push `state` as `version` to every target, as the learner does; fail unless every push succeeded."""
    with WeightPusher(timeout_s=60) as pusher:
        targeted = [PushTarget(m.id, m.address) for m in targets]
        outcomes = pusher.push(state, PolicyVersion(0, version), targeted)
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, f"pushes failed: {bad}"


def enqueue(client: redis.Redis, run: str, prompts: list[list[int]], k: int = 0) -> list[str]:
    """One PromptGroup per prompt (k=0: the generator's samples_per_prompt); returns the group ids."""
    groups = [PromptGroup(group_id=f"g-{uuid.uuid4().hex[:10]}", prompt_token_ids=p, k=k,
                          enqueued_at=time.time()) for p in prompts]
    RunStreams(client, run).producer(PROMPTS).add_many(groups)
    return [g.group_id for g in groups]


def rollouts(client: redis.Redis, run: str) -> list[RolloutGroup]:
    """Every RolloutGroup in the run's rollouts stream, in stream order (duplicates included)."""
    out = []
    for _, fields in client.xrange(run_key(run, ROLLOUTS.name)):
        group = RolloutGroup()
        group.ParseFromString(fields[PAYLOAD_FIELD])
        out.append(group)
    return out


def rollouts_for(client: redis.Redis, run: str, group_ids: list[str]) -> dict[str, RolloutGroup] | None:
    """The rollouts of `group_ids` once all are written (None before)."""
    wanted = set(group_ids)
    found = {g.group_id: g for g in rollouts(client, run) if g.group_id in wanted}
    return found if len(found) == len(wanted) else None


@torch.no_grad()
def recomputed_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int],
                        temperature: float) -> torch.Tensor:
    """log pi(completion_t | prompt, completion_<t) under logits / temperature, by one unpadded forward
    pass."""
    full = torch.tensor([prompt + completion])
    logits = model(input_ids=full).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
