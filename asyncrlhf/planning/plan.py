"""A run's plan on one node: every process placed on a device (`placement`), what each holds there
(`demands`), each GPU's total against its memory, and the reasons a run does not fit: a GPU the node lacks, a
device over its memory (naming what fills it), a vLLM share too small for its weights and one sequence."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from asyncrlhf.config import Config
from asyncrlhf.planning import memory as mem
from asyncrlhf.planning.demands import Demand, demands, sequence_tokens
from asyncrlhf.planning.placement import CPU, Placement, Process
from asyncrlhf.planning.shapes import model_shape
from asyncrlhf.planning.timing import StepFloor, step_floor


@dataclass
class Plan:
    """The plan of `cfg` on a node of `gpus` GPUs of `gpu_bytes` each."""

    gpus: int
    gpu_bytes: int
    processes: list[Process]
    demands: list[Demand]
    floor: StepFloor
    total_steps: int
    problems: list[str] = field(default_factory=list)

    def used(self) -> dict[str, int]:
        """Bytes held per device, GPUs first in order, then the host."""
        totals: dict[str, int] = defaultdict(int)
        for d in self.demands:
            totals[d.device] += d.bytes
        return dict(sorted(totals.items(), key=lambda kv: (kv[0] == CPU, kv[0])))

    @property
    def fits(self) -> bool:
        return not self.refusals()

    def refusals(self) -> list[str]:
        """Why the run does not fit (empty: it fits)."""
        over = [self._over(device, used) for device, used in self.used().items()
                if device != CPU and used > self.gpu_bytes]
        return self.problems + over

    def _over(self, device: str, used: int) -> str:
        held = sorted((d for d in self.demands if d.device == device), key=lambda d: -d.bytes)
        top = ", ".join(f"{d.service} {d.item} {gib(d.bytes)}" for d in held[:3])
        return (f"{device} needs {gib(used)} GiB of its {gib(self.gpu_bytes)} GiB: {top} "
                f"(move a service to another GPU with launch.gpus, or shrink what holds the most)")


def gib(size: int) -> str:
    return f"{size / mem.GIB:.1f}"


def make_plan(cfg: Config, gpus: int, gpu_bytes: int) -> Plan:
    """Place `cfg`'s processes on `gpus` GPUs of `gpu_bytes` and total what each device holds."""
    placement = Placement(cfg, gpus)
    held = [d for p in placement.processes for d in demands(p, cfg, gpu_bytes)]
    plan = Plan(gpus, gpu_bytes, placement.processes, held, _floor(cfg), cfg.learner.total_steps,
                list(placement.problems))
    plan.problems += _vllm_share_problems(cfg, plan)
    return plan


def _floor(cfg: Config) -> StepFloor:
    from asyncrlhf.training.objectives import make_objective
    from asyncrlhf.training.policies import value_source

    objective = make_objective(cfg)
    value = model_shape(value_source(cfg), "score") if objective.needs_values else None
    policy = model_shape(cfg.model, "causal")
    return step_floor(cfg, policy, value, objective.needs_reference, sequence_tokens(cfg))


def _vllm_share_problems(cfg: Config, plan: Plan) -> list[str]:
    """A vLLM share must hold the weights (its shard of them) and the KV cache of one longest sequence."""
    g = cfg.generator
    if g.backend != "vllm" or all(p.devices == (CPU,) for p in plan.processes if p.kind == "generator"):
        return []
    policy = model_shape(cfg.model, "causal")
    dtype = cfg.model.dtype if g.vllm.dtype == "auto" else g.vllm.dtype
    size = mem.DTYPE_BYTES[dtype]
    longest = g.vllm.max_model_len or policy.max_positions
    need = mem.weights(policy.params, size, g.tensor_parallel_size) + mem.CONTEXT_BYTES \
        + mem.kv_cache(policy, 1, longest, size) // g.tensor_parallel_size
    share = int(g.vllm.gpu_memory_utilization * plan.gpu_bytes)
    if need <= share:
        return []
    return [f"generator: vLLM's share (generator.vllm.gpu_memory_utilization={g.vllm.gpu_memory_utilization} "
            f"of {gib(plan.gpu_bytes)} GiB = {gib(share)} GiB) cannot hold the weights ({dtype}) and one "
            f"{longest}-token sequence's KV cache: {gib(need)} GiB; raise it, shard the model "
            "(generator.tensor_parallel_size), or set generator.vllm.max_model_len"]


def table(plan: Plan) -> str:
    """The plan as a table: each device's items, its total against its memory, and the verdict."""
    rows = [("device", "service", "holds", "GiB")]
    used = plan.used()
    for device, total in used.items():
        for d in (d for d in plan.demands if d.device == device):
            rows.append((device, d.service, d.item, gib(d.bytes)))
        capacity = f" of {gib(plan.gpu_bytes)}" if device != CPU else ""
        rows.append((device, "", "total", f"{gib(total)}{capacity}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>5}" for r in rows]
    refusals = plan.refusals()
    verdict = ["fits"] if not refusals else ["does not fit:", *(f"  - {r}" for r in refusals)]
    return "\n".join([*lines, timing(plan), *verdict])


def timing(plan: Plan) -> str:
    """The time floor (asyncrlhf/planning/timing.py): the least a step's arithmetic and reads take."""
    f = plan.floor
    how = "overlapped" if f.overlapped else "in turn"
    total = f.step_s * plan.total_steps
    return (f"time floor on H100-class GPUs (not a measurement: asyncrlhf/planning/timing.py): learner "
            f"{f.train_s:.2f} s/step, generation {f.generate_s:.2f} s/step, {how}: {plan.total_steps} steps "
            f"in {duration(total)} or more")


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
