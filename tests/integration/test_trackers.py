"""Each tracker through its own reader: TensorBoard's event reader, the MLflow client on the local store,
W&B's offline run files. And a missing tracker's error."""

from __future__ import annotations

import builtins
import json
import math
import threading

import pytest

from asyncrlhf.config import load_config
from asyncrlhf.trackers import TrackerError, local_mlflow_uri, open_trackers

pytestmark = pytest.mark.integration
STEPS = [{"loss": 0.5, "kl": 0.01, "reward_mean": -1.0}, {"loss": 0.25, "kl": 0.02, "reward_mean": 0.5,
                                                          "nan_is_skipped": math.nan}]


def config(tmp_path, *trackers, extra=()):
    listed = "[" + ",".join(trackers) + "]"
    return load_config(["configs/tiny.yaml"], [f"run.dir={tmp_path}/{{name}}", f"run.trackers={listed}",
                                               "run.token=s3cret", *extra])


def log_two_steps(cfg):
    trackers = open_trackers(cfg, "learner")
    for step, values in enumerate(STEPS, start=1):
        trackers.log_scalars(values, step)
    trackers.close()


def test_tensorboard_event_files_hold_the_scalars_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config(tmp_path, "tensorboard")
    log_two_steps(cfg)
    events = EventAccumulator(str(cfg.run.path / "tensorboard" / "learner"),
                              size_guidance={"tensors": 0, "scalars": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [e.value for e in events.Scalars("reward_mean")] == [-1.0, 0.5]
    assert "nan_is_skipped" not in events.Tags()["scalars"]
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "learner.lr: 0.0001" in text and "run.token: ***" in text


def test_mlflow_local_store_holds_the_metrics_and_the_config_as_params(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = config(tmp_path, "mlflow")
    log_two_steps(cfg)
    client = mlflow.MlflowClient(local_mlflow_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.run.name)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "learner" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.25)]
    assert run.data.params["learner.lr"] == "0.0001" and run.data.params["run.token"] == "***"


def wandb_records(path):
    """The records of an offline run's `.wandb` file: after a 7-byte file header, a LevelDB-style log of
    32 KiB blocks, each record fragment behind a 7-byte header (crc32 4, length 2 little-endian, type 1:
    1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_file_holds_the_history_and_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(tmp_path, "wandb")
    log_two_steps(cfg)
    (run_file,) = (cfg.run.path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    records: list = []
    for _ in range(600):  # wandb's service may still be writing after finish() returns: up to its exit record
        records = wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        threading.Event().wait(0.1)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["loss"], h["reward_mean"]) for h in history] == [(1, 0.5, -1.0), (2, 0.25, 0.5)]
    config_updates = {item.key: json.loads(item.value_json) for r in records
                      if r.WhichOneof("record_type") == "config" for item in r.config.update}
    assert config_updates["learner"]["lr"] == 0.0001 and config_updates["run"]["token"] == "***"


def test_a_missing_tracker_fails_with_the_install_hint_or_warns_by_config(tmp_path, monkeypatch, caplog):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'", name="wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(TrackerError, match=r"wandb is not installed: pip install wandb .*tracker_errors"):
        open_trackers(config(tmp_path, "wandb"), "learner")
    trackers = open_trackers(config(tmp_path, "wandb", extra=["run.tracker_errors=warn"]), "learner")
    assert trackers.trackers == [] and "pip install wandb" in caplog.text


def test_an_unknown_tracker_is_a_config_error(tmp_path):
    from asyncrlhf.config import ConfigError

    with pytest.raises(ConfigError, match="tensorboard"):
        config(tmp_path, "tensorbord")
