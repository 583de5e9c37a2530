"""Experiment trackers beside Prometheus (which is for live operations): `run.trackers` lists any of
`tensorboard`, `wandb`, `mlflow` (none by default). Each service that logs (the learner per step, the
evaluator per checkpoint) opens them with `open_trackers(cfg, service)`; the run config is logged once.

Where each writes:
- tensorboard: event files under `<run.dir>/tensorboard/<service>`;
- wandb: project `run.name`, one run per service grouped by `run.name`, files under `<run.dir>/wandb`;
  offline unless `WANDB_MODE` says otherwise (`WANDB_MODE=online` with `WANDB_API_KEY` to sync live);
- mlflow: `MLFLOW_TRACKING_URI` if set, else a local store `sqlite:///<run.dir>/mlflow.db`; experiment
  `run.name`, one run per service (`mlflow ui --backend-store-uri sqlite:///<run.dir>/mlflow.db`).

A tracker whose package is missing or that cannot start fails the service at start with what to install or
fix (`TrackerError`), unless `run.tracker_errors: warn`, which logs the reason and goes on without it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

from asyncrlhf.config import Config
from asyncrlhf.service import ServiceError

log = logging.getLogger(__name__)

INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb",
           "mlflow": "pip install mlflow"}


class TrackerError(ServiceError):
    """A configured tracker cannot start; the message says what to install or fix (the service exits 2)."""


class Tracker(Protocol):
    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log_scalars(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"learner": {"lr": 1e-4}} -> {"learner.lr": 1e-4}; lists and None become strings."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


class TensorBoardTracker:
    def __init__(self, cfg: Config, service: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(cfg.run.path / "tensorboard" / service))

    def log_config(self, config: Mapping[str, Any]) -> None:
        text = "\n".join(f"    {k}: {v}" for k, v in sorted(flatten(config).items()))
        self.writer.add_text("config", text, 0)

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, cfg: Config, service: str):
        import wandb

        directory = cfg.run.path / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.run.name, group=cfg.run.name, name=service, job_type=service,
                              dir=str(directory), mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
                              reinit=True)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


def local_mlflow_uri(cfg: Config) -> str:
    """A local SQLite store in the run directory (MLflow's file store is deprecated)."""
    cfg.run.path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(cfg.run.path / 'mlflow.db').resolve()}"


class MLflowTracker:
    def __init__(self, cfg: Config, service: str):
        import mlflow

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI") or local_mlflow_uri(cfg)
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(cfg.run.name)
        self.client = mlflow.MlflowClient(uri)
        self.run_id = mlflow.start_run(run_name=service).info.run_id
        mlflow.end_run()  # logged through the client by run id: no process-global active run

    def log_config(self, config: Mapping[str, Any]) -> None:
        for key, value in flatten(config).items():
            self.client.log_param(self.run_id, key, str(value)[:6000])

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.client.log_metric(self.run_id, key, float(value), step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_KINDS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MLflowTracker}


class Trackers:
    """All the configured trackers as one; with none configured every call does nothing."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log_config(self, config: Mapping[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log_config(config)

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        finite = {k: float(v) for k, v in values.items() if v == v}  # NaN: not known, not logged
        for tracker in self.trackers:
            tracker.log_scalars(finite, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def step_scalars(stats: Mapping[str, float], staleness: list[int], step_s: float,
                 lr: float | None) -> dict[str, float]:
    """The learner's per-step scalars: the algorithm's statistics (loss, KL, rewards, ...), the mean
    staleness of the step's groups (versions), throughput and the learning rate."""
    values = dict(stats)
    if staleness:
        values["staleness_mean"] = sum(staleness) / len(staleness)
    if step_s > 0:
        values["samples_per_s"] = stats.get("sequences", 0.0) / step_s
        values["tokens_per_s"] = stats.get("tokens", 0.0) / step_s
    if lr is not None:
        values["lr"] = lr
    return values


def open_trackers(cfg: Config, service: str) -> Trackers:
    """The trackers `run.trackers` names, started, with the run config (token redacted) logged."""
    opened: list = []
    for kind in cfg.run.trackers:
        try:
            opened.append(_KINDS[kind](cfg, service))
        except ImportError as err:
            _refuse(cfg, f"run.trackers has `{kind}` but {err.name or kind} is not installed: "
                         f"{INSTALL[kind]} (or remove it from run.trackers)")
        except Exception as err:  # a tracker that cannot start: a login, a URI, a directory
            _refuse(cfg, f"tracker `{kind}` could not start: {type(err).__name__}: {err}")
    trackers = Trackers(opened)
    config = cfg.model_dump(mode="json")
    if config["run"].get("token"):
        config["run"]["token"] = "***"
    trackers.log_config(config)
    return trackers


def _refuse(cfg: Config, message: str) -> None:
    if cfg.run.tracker_errors == "warn":
        log.warning("%s; going on without it (run.tracker_errors=warn)", message)
        return
    raise TrackerError(message + "; or set run.tracker_errors=warn to go on without it")
