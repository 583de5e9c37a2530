"""One host's CPU cores, shared by the services that compute on it.

A fixed split (one core to the generator, one to the learner on a 2-core box) leaves a core idle whenever one
phase waits for the other: in sync mode always, in async mode whenever the generator is ahead or the learner
waits for a batch. Under `asyncrlhf up` on a CPU host (`launch.share_cores`), the generator(s) and the
learner instead mark themselves busy while they compute and size torch's thread pool from how many members
are busy right now: alone, a member takes every core; `n` busy members take `cores // n` each. The generator
re-sizes between decoding steps, the learner before each micro-batch's forward, so cores move to whichever
phase is working within one token or one micro-batch.

The state is one file per busy member in a directory the launcher gives every service (`ASYNCRLHF_CORES`):
the member's name, holding its pid. A member that died busy (SIGKILL) is not counted: its pid is gone.

Where generation and training overlap, members also wait passively (`shared_core_env`: OpenMP's idle workers
sleep instead of spinning): a member's threads re-size only between tokens or micro-batches, so for a while
both may run on every core, and a pool spinning between parallel regions then burns the core the other member
needs. Where they alternate (`max_staleness: 0`) a member computes alone, and passive waiting only costs a
wake-up per parallel region, of which decoding has many small ones, so there the workers spin briefly. The
figures behind each choice: docs/benchmarks.md, `bench pipeline`.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from asyncrlhf.config import Config

ENV = "ASYNCRLHF_CORES"  # the shared directory, set by the launcher; unset: fixed threads
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SHORT_SPIN = "30000"  # libgomp spins before it sleeps (its default 300000; 0 when passive)
T = TypeVar("T")


def on_fresh_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a thread that exits when it returns (its result returned, its exception raised here).

    For torch work off the compute thread in a long-lived thread (a gRPC handler applying a push): OpenMP
    (libgomp) gives every thread that runs a parallel region a worker pool of its own, kept while that thread
    lives, and once the process holds more pool threads than it has cores, every pool's workers stop spinning
    between parallel regions and sleep on a futex instead. The generator's decoding (many small parallel
    regions) then pays a wake-up per region, and the service generated well below the bare backend after
    its first push from a gRPC thread (docs/benchmarks.md, `bench generator`). A thread that exits frees its
    pool. (Where services share cores, the launcher makes every pool wait passively anyway:
    `shared_core_env`.)"""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-oneshot") as pool:
        return pool.submit(fn).result()  # leaving the block joins the thread


def share_dir(run_dir: Path) -> Path:
    """Where a run's core share keeps one file per busy member (`ENV` names it to each service)."""
    return run_dir / "cores"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


class CoreShare:
    """`member` computes inside `with share.busy():` and calls `share.adjust()` at its natural breaks
    (a decoding step, a micro-batch); torch's threads follow the number of busy members."""

    def __init__(self, directory: Path, member: str, cores: int):
        self.directory, self.member, self.cores = directory, member, max(1, cores)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._mine = directory / member
        import torch  # the members import it anyway; the launcher, which only plans their threads, does not

        self._threads = torch.get_num_threads()

    @classmethod
    def from_env(cls, member: str) -> CoreShare | None:
        directory = os.environ.get(ENV)
        return cls(Path(directory), member, os.cpu_count() or 1) if directory else None

    def busy_members(self) -> int:
        """Members computing now, this one included when it is."""
        count = 0
        for entry in self.directory.iterdir():
            if entry.suffix == ".tmp":
                continue
            try:
                pid = int(entry.read_text() or 0)
            except (OSError, ValueError):  # removed or half-written between listing and reading
                continue
            count += pid > 0 and _alive(pid)  # a restarted learner's dead predecessor, same name: not busy
        return count

    def threads(self) -> int:
        return max(1, self.cores // max(1, self.busy_members()))

    def adjust(self) -> int:
        """Re-size torch's thread pool to this member's share now (a no-op when it is unchanged)."""
        wanted = self.threads()
        if wanted != self._threads:
            import torch

            torch.set_num_threads(wanted)
            self._threads = wanted
        return wanted

    @contextmanager
    def busy(self) -> Iterator[int]:
        """Counted as computing inside; yields the threads taken on entry."""
        tmp = self._mine.with_suffix(".tmp")
        tmp.write_text(str(os.getpid()))
        tmp.replace(self._mine)  # other members never read a half-written pid
        try:
            yield self.adjust()
        finally:
            self._mine.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------
# Threads per service under `asyncrlhf up`


def _configured_threads(cfg: Config, kind: str) -> int:
    return {"generator": cfg.generator.threads, "learner": cfg.learner.threads,
            "evaluator": cfg.evaluator.threads}.get(kind, 1)


def shares_cores(cfg: Config, kind: str) -> bool:
    """Whether this service joins the host's core share: the heavy CPU services whose
    threads the config leaves to `up`; vLLM's worker fixes its threads at start, so it keeps a fixed share."""
    if not cfg.launch.share_cores or kind not in ("generator", "learner") or kind in cfg.launch.gpus:
        return False
    if kind == "generator" and cfg.generator.backend != "hf":
        return False
    device = cfg.generator.device if kind == "generator" else cfg.learner.device
    return device in ("auto", "cpu") and not cuda_available() and not _configured_threads(cfg, kind)


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, without importing torch where its build has no CUDA (a `+cpu` wheel): the
    launcher asks for every service and computes nothing with torch itself (importing it costs a CPU-second,
    at every `asyncrlhf up`)."""
    try:
        if importlib.metadata.version("torch").endswith("+cpu"):
            return False
    except importlib.metadata.PackageNotFoundError:
        pass
    import torch

    return torch.cuda.is_available()


def shared_core_env(environ: Mapping[str, str], cfg: Config) -> dict[str, str]:
    """What the launcher adds to the environment `environ` of a member, unless the user chose OpenMP's wait
    policy or spin count already: passive waiting where generation and training overlap
    (`learner.max_staleness` > 0), a short spin where they alternate (the module's docstring says why)."""
    if any(v in environ for v in OPENMP_WAIT_VARS):
        return {}
    if cfg.learner.max_staleness == 0:
        return {"GOMP_SPINCOUNT": SHORT_SPIN}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def openmp_env(environ: Mapping[str, str], cfg: Config, kind: str, threads: int) -> dict[str, str]:
    """OpenMP's wait settings for a service `up` starts: the core share's for its members; the same for a
    service of one thread that starts no engine process, when the run has members: it has no OpenMP workers
    to wait, so there they change nothing, and its environment then matches the members', so that `up`'s
    fork server can serve them all (asyncrlhf/forkserver.py). An engine process (vLLM's, which it forks) would
    inherit them: a service that starts one keeps OpenMP's defaults."""
    one_thread = threads == 1 and not starts_engine(cfg, kind)
    members = any(shares_cores(cfg, k) for k in ("generator", "learner"))
    if shares_cores(cfg, kind) or (one_thread and members):
        return shared_core_env(environ, cfg)
    return {}


def starts_engine(cfg: Config, kind: str) -> bool:
    """Whether the service may start an engine process of its own: a vLLM generator, or a judge among the
    scorers of the reward service or of the evaluator's gold reward."""
    if kind == "generator":
        return cfg.generator.backend != "hf"
    scorers = {"reward": cfg.reward.scorers, "evaluator": [cfg.evaluator.gold]}.get(kind, [])
    return any(scorer.kind == "judge" for scorer in scorers)


def service_threads(cfg: Config, kind: str) -> int:
    """Threads for a CPU service: what the config says; every core for a service in the core share (it gives
    them back while another computes); else a fair share of the cores."""
    cores = os.cpu_count() or 2
    if configured := _configured_threads(cfg, kind):
        return configured
    if shares_cores(cfg, kind):
        return cores
    heavy = 2  # generation and training each get a share; reward and evaluator take what is left
    return max(1, cores // heavy) if kind in ("generator", "learner") else 1
