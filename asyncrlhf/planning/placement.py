"""Where each process of a run computes, as `asyncrlhf up` starts them on one node: a service sees the GPUs
`launch.gpus` gives it (CUDA_VISIBLE_DEVICES; all of them when unset), and its `device` setting picks among
those (`auto` and `cuda` the first, `cuda:k` the k-th, `cpu` none). Learner rank r computes on its r-th
visible GPU (torchrun's LOCAL_RANK, DeepSpeed's choice: `learner.device` is not read), or the CPU; a vLLM
generator shards over its first `tensor_parallel_size`; every replica of a service sees the same GPUs (`up`
gives them one CUDA_VISIBLE_DEVICES)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrlhf.config import Config

CPU = "cpu"


def gpu(index: int) -> str:
    return f"gpu {index}"


@dataclass(frozen=True)
class Process:
    """One process of the run and the devices it computes on (`gpu 0`, ..., or `cpu`)."""

    service: str  # as `up` names it: generator-0, reward-0, learner (rank 0), learner rank 1, evaluator
    kind: str  # generator | reward | learner | evaluator
    devices: tuple[str, ...]
    rank: int = 0


class Placement:
    """The processes of a run on a node of `gpus` GPUs, and why a setting cannot be placed."""

    def __init__(self, cfg: Config, gpus: int):
        self.cfg, self.gpus = cfg, gpus
        self.problems: list[str] = []
        self.processes = self._generators() + self._rewards() + self._learner() + self._evaluator()

    def visible(self, kind: str) -> list[int]:
        """The GPUs `kind`'s processes see; a GPU the node lacks is a problem."""
        spec = self.cfg.launch.gpus.get(kind)
        if spec is None:
            return list(range(self.gpus))
        ids = [int(part) for part in spec.split(",") if part.strip()]
        missing = [i for i in ids if i >= self.gpus]
        if missing:
            self._problem(
                f"launch.gpus.{kind}={spec!r} names GPU {missing[0]}, but the node has {self.gpus} "
                f"GPU{'s' if self.gpus != 1 else ''} ({self._ids()})")
        return [i for i in ids if i < self.gpus]

    def device(self, kind: str, setting: str, index: int = 0) -> str:
        """The device of `kind`'s `device` setting, its `index`-th visible GPU for `auto`/`cuda`."""
        if setting == CPU:
            return CPU
        visible = self.visible(kind)
        if setting.startswith("cuda:"):
            index += int(setting.split(":", 1)[1])
        if index < len(visible):
            return gpu(visible[index])
        if setting == "auto" and not visible:
            return CPU
        self._problem(f"{kind}.device={setting} needs GPU {index + 1} of those it sees, but it sees "
                             f"{len(visible)} ({self._visible_text(kind, visible)})")
        return CPU

    def _problem(self, text: str) -> None:
        if text not in self.problems:  # a setting read for several ranks or replicas is one problem
            self.problems.append(text)

    def _generators(self) -> list[Process]:
        g = self.cfg.generator
        shards = g.tensor_parallel_size if g.backend == "vllm" else 1
        devices = tuple(dict.fromkeys(self.device("generator", g.device, i) for i in range(shards)))
        return [Process(f"generator-{i}", "generator", devices) for i in range(g.replicas)]

    def _rewards(self) -> list[Process]:
        device = self.device("reward", self.cfg.reward.device)
        return [Process(f"reward-{i}", "reward", (device,)) for i in range(self.cfg.reward.replicas)]

    def _learner(self) -> list[Process]:
        """DeepSpeed puts rank r on its r-th visible GPU wherever there is one (`learner.device` is not
        read), else on the CPU."""
        procs = self.cfg.launch.learner_procs
        setting = "cuda" if self.visible("learner") else CPU
        return [Process("learner" if r == 0 else f"learner rank {r}", "learner",
                        (self.device("learner", setting, r),), rank=r) for r in range(procs)]

    def _evaluator(self) -> list[Process]:
        if not self.cfg.launch.evaluator:
            return []
        return [Process("evaluator", "evaluator", (self.device("evaluator", self.cfg.evaluator.device),))]

    def _ids(self) -> str:
        return f"0-{self.gpus - 1}" if self.gpus > 1 else "0" if self.gpus else "none"

    def _visible_text(self, kind: str, visible: list[int]) -> str:
        spec = self.cfg.launch.gpus.get(kind)
        return f"launch.gpus.{kind}={spec!r}" if spec is not None else f"the node's {self._ids()}"
