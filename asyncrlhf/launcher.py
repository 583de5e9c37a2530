"""`asyncrlhf up CONFIG [overrides]`: an embedded Redis (unless the config names one: `redis.url`, or
`redis.sentinel.addresses` for a sentinel-managed primary) and every service as a local process, with live
progress, per-service logs, supervision and a clean stop.

The plan and the run's supervision: each service is its own entry point (`python -m services.<name>`),
told its Redis URL, HTTP port and CPU threads by overrides, and runs as an `asyncrlhf.processes.Service`
(its start, restarts and stop). The learner decides when the run is done; the launcher then lets the
evaluator finish its last evaluation, stops the rest and prints the report.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from asyncrlhf import metrics as names
from asyncrlhf import prestart
from asyncrlhf.config import Config, ConfigError, load_config
from asyncrlhf.config_cli import split_config_args
from asyncrlhf.cores import ENV as CORES_ENV
from asyncrlhf.cores import openmp_env, service_threads, share_dir, shares_cores
from asyncrlhf.forkserver import ForkServer, fork_server
from asyncrlhf.processes import Service, stop_services
from asyncrlhf.progress import Progress
from asyncrlhf.redis_server import EmbeddedRedis, free_port
from asyncrlhf.scrape import Snapshot, read_exposition, scrape
from asyncrlhf.stalls.launched import judge_stall
from asyncrlhf.stalls.monitor import StallMonitor
from asyncrlhf.supervision import RestartPolicy, cap_message


def plan(cfg: Config, files: Sequence[str], overrides: Sequence[str], redis_url: str | None) -> list[Service]:
    """The processes of a run, in start order: reward and generators first, the learner, the evaluator.
    `redis_url`: the embedded Redis's, passed to each; None when the config names the server itself."""
    kinds = [("reward", cfg.reward.replicas), ("generator", cfg.generator.replicas), ("learner", 1)]
    if cfg.launch.evaluator:
        kinds.append(("evaluator", 1))
    logs = cfg.run.path / "logs"
    services = []
    for kind, replicas in kinds:
        for i in range(replicas):
            port = free_port()
            threads = service_threads(cfg, kind)
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
                   "TOKENIZERS_PARALLELISM": "false"}
            if kind in cfg.launch.gpus:
                env["CUDA_VISIBLE_DEVICES"] = cfg.launch.gpus[kind]
            if shares_cores(cfg, kind):
                env[CORES_ENV] = str(share_dir(cfg.run.path))
            env.update(openmp_env(env, cfg, kind, threads))
            config_args = [a for f in files for a in ("--config", f)]
            server = [f"redis.url={redis_url}"] if redis_url else []
            args = [*config_args, *overrides, *server, f"{kind}.http_port={port}"]
            if kind in ("generator", "learner", "evaluator"):
                args.append(f"{kind}.threads={threads}")
            module = ["-m", f"services.{kind}"]
            if kind == "learner" and cfg.launch.learner_procs > 1:
                module = ["-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={cfg.launch.learner_procs}", "-m", "services.learner"]
            name = f"{kind}-{i}" if replicas > 1 or kind in ("generator", "reward") else kind
            lc = cfg.launch
            policy = RestartPolicy(lc.max_restarts, lc.restart_window_s, lc.restart_backoff_s,
                                   lc.restart_backoff_max_s, lc.restart_stable_s)
            argv = [sys.executable, *module, *args]
            services.append(Service(name, kind, argv, env, logs / f"{name}.log", port, policy=policy))
    return services


# ---------------------------------------------------------------------------------------------------------
# Supervision


class Launcher:
    def __init__(self, cfg: Config, files: Sequence[str], overrides: Sequence[str], *flags: str):
        self.cfg, self.files, self.overrides, self.flags = cfg, list(files), list(overrides), set(flags)
        self.redis: EmbeddedRedis | None = None
        self.services: list[Service] = []
        self.forks: ForkServer | None = None
        self.stopping = False
        self.failed: Service | None = None
        self.answered: dict[str, bool] = {}  # whether each service's /metrics ever answered
        self.last_metrics: dict[str, dict[str, float]] = {}  # each service's last scraped values
        self.at_learner_end: Snapshot | None = None  # the scrape taken when the learner finished
        self.monitor: StallMonitor | None = None
        self.started_at = time.time()

    def run(self) -> int:
        run_dir = self.cfg.run.path
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        # before Redis starts: on a refusal nothing runs
        problem = prestart.refusal(self.cfg, self.files, self.flags,
                                   say=lambda text: print(f"asyncrlhf up: {text}", flush=True))
        if problem is not None:
            print(f"asyncrlhf up: {problem}", file=sys.stderr)
            return 2
        url = self._redis_url()
        self.services = plan(self.cfg, self.files, self.overrides, url)
        self.monitor = StallMonitor.from_config(self.cfg, url=url,
                                                say=lambda text: print(f"asyncrlhf up: {text}", flush=True))
        for svc in self.services:  # an earlier run's last values are not this run's
            names.final_metrics_path(run_dir, svc.name).unlink(missing_ok=True)
        shutil.rmtree(share_dir(run_dir), ignore_errors=True)  # members an earlier run left busy
        print(f"asyncrlhf up: run `{self.cfg.run.name}` in {run_dir} (logs in {run_dir / 'logs'}), "
              f"Redis {url or self.cfg.redis.where}", flush=True)
        self.forks = fork_server(self.cfg, self.services)
        self.started_at = time.time()
        for svc in self.services:
            svc.start()
        g = self.cfg.generator
        backend = f"{g.backend} ({g.auto_reason})" if g.auto_reason else g.backend
        if g.mode == "continuous":  # the HF backend has no step-wise engine: it runs batch mode
            backend += " continuous" if g.backend == "vllm" else " batch (continuous needs vllm)"
        progress = Progress(self.cfg.learner.total_steps, final_version=self._final_version,
                            generator=backend)
        try:
            code = self._supervise(progress)
        finally:
            progress.close()
            self._summarise()
            self._stop_all()
            if self.redis is not None:
                self.redis.stop()
        if code == 0:
            print_report(run_dir)
        return code

    def _final_version(self) -> int | None:
        from asyncrlhf.training.checkpoint import latest_version

        return latest_version(self.cfg)

    def _redis_url(self) -> str | None:
        """The embedded Redis's URL, started here; None when the config names a server (`redis.url`, or
        sentinels: every service then finds the primary through them, and follows a failover)."""
        if self.cfg.redis.external:
            return None
        data_dir = self.cfg.run.path / "redis" if self.cfg.redis.persist else None
        self.redis = EmbeddedRedis(data_dir=data_dir, appendfsync=self.cfg.redis.appendfsync).start()
        return self.redis.url

    def _supervise(self, progress: Progress) -> int:
        learner = next(s for s in self.services if s.kind == "learner")
        learner_done_at = None
        while True:
            # Poll fast until every service has answered once: a short run's learner can start, train and
            # exit between two slow polls.
            everyone = len(self.answered) == len(self.services) and all(self.answered.values())
            time.sleep(self.cfg.launch.progress_every_s if everyone else 0.2)
            if self.stopping:
                return 130
            self._check_redis()
            for svc in self.services:
                if not self._check(svc):
                    return 1
            snap = scrape(self.services)
            for name, ok in snap.answered.items():
                self.answered[name] = self.answered.get(name, False) or ok
            self.last_metrics.update(snap.per_service)
            progress.update(snap)
            if learner_done_at is None:
                progress.state.stall = judge_stall(self.monitor, progress.state, self.services)
            if learner.pending is None and learner.poll() == 0 and learner_done_at is None:
                learner_done_at = time.monotonic()
                self.at_learner_end = scrape(self.services)
            if learner_done_at is not None and self._evaluator_done(learner_done_at):
                return 0

    def _check_redis(self) -> None:
        """The embedded Redis is supervised too: a crashed one restarts on its port and its append-only file
        (what it lost is re-created by the learner, docs/guarantees.md); services reconnect by themselves."""
        if self.redis is None or self.redis.running:
            return
        code = self.redis.process.returncode if self.redis.process else None
        print(f"asyncrlhf up: Redis exited with {code}; restarting it on its append-only file", flush=True)
        self.redis.start()

    def _check(self, svc: Service) -> bool:
        """Start a service whose back-off is over; handle one that exited. Returns whether the run goes on."""
        if svc.pending is not None:
            svc.start_if_due()
            return True
        code = svc.poll()
        if code is None or (code == 0 and svc.kind in ("evaluator", "learner")):
            return True
        return self._handle_crash(svc, code)

    def _evaluator_done(self, since: float) -> bool:
        evaluator = next((s for s in self.services if s.kind == "evaluator"), None)
        if evaluator is None or evaluator.poll() is not None:
            return True
        return time.monotonic() - since > self.cfg.launch.evaluator_grace_s

    def _handle_crash(self, svc: Service, code: int) -> bool:
        """Schedule a restart after its back-off if allowed; otherwise report it. Returns whether the run
        goes on. A restarted learner resumes from the latest checkpoint (its default)."""
        if not self.cfg.launch.restart:
            self._report_crash(svc, code)
            return False
        restart = svc.restart_after(code)
        if restart is None:
            self.failed = svc
            print(cap_message(svc.name, svc.kind, code, svc.policy, svc.tail(), str(svc.log_path)),
                  file=sys.stderr, flush=True)
            return False
        delay = restart.at - time.monotonic()
        print(f"asyncrlhf up: {svc.name} exited with {code}; restarting in {delay:.1f} s "
              f"({restart.count} in the last {svc.policy.window_s:g} s)", flush=True)
        return True

    def _report_crash(self, svc: Service, code: int) -> None:
        self.failed = svc
        print(f"asyncrlhf up: {svc.name} exited with code {code}; the run stops. "
              f"Last lines of {svc.log_path}:\n{svc.tail()}", file=sys.stderr, flush=True)

    def _on_signal(self, signum, _frame) -> None:
        if self.stopping:
            return
        self.stopping = True
        print("asyncrlhf up: stopping (the learner writes a checkpoint first)...", flush=True)

    def _stop_all(self) -> None:
        stop_services(self.services)
        if self.forks is not None:
            self.forks.close()

    def _summarise(self) -> None:
        """`<run dir>/up_summary.json`: the final version (from the last checkpoint), what each generator
        served when the learner finished, and which /metrics endpoints answered during the run."""
        snap = self.at_learner_end or scrape(self.services)
        from asyncrlhf.training.checkpoint import latest_version

        for svc in self.services:  # a service's own last values beat a scrape taken before it finished
            final = names.final_metrics_path(self.cfg.run.path, svc.name)
            if final.is_file():
                last = Snapshot()
                read_exposition(final.read_text(), svc.name, last)
                self.last_metrics[svc.name] = last.per_service[svc.name]

        summary = {
            "learner_version": latest_version(self.cfg),
            "started_at": self.started_at,
            "generator_versions": snap.generator_versions,
            "metrics_answered": self.answered,
            "final_metrics": self.last_metrics,
            "failed": self.failed.name if self.failed else None,
            "services": {
                s.name: {"log": str(s.log_path), "url": s.url, "restarts": s.restarts} for s in self.services
            },
        }
        (self.cfg.run.path / "up_summary.json").write_text(json.dumps(summary, indent=2))



def print_report(run_dir: Path) -> None:
    from asyncrlhf.report import headline, write_report

    path = write_report(run_dir)
    h = headline(run_dir)
    print(f"asyncrlhf up: done. Report: {path}")
    print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in h.items()))


USAGE = """usage: asyncrlhf up CONFIG.yaml [--fresh | --resume-anyway] [key=value | --key value ...]
A run with a checkpoint resumes from it; --fresh moves its directory aside (docs/bring-your-own.md)."""


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    flags = [a for a in argv if a in ("--fresh", "--resume-anyway")]
    files, overrides = split_config_args([a for a in argv if a not in flags])
    try:
        cfg = load_config(files, overrides)
    except ConfigError as err:
        print(f"asyncrlhf up: {err}", file=sys.stderr)
        return 2
    return Launcher(cfg, files, overrides, *flags).run()
