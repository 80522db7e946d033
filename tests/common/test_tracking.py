"""Experiment trackers in their offline modes: what a run logs reaches W&B's offline run files and
MLflow's local store, read back with each library's own readers."""

from __future__ import annotations

import json
import time

import pytest

from services.common.tracking import MlflowTracker, Trackers, WandbTracker, numeric, open_trackers, requested


def test_nothing_is_tracked_by_default(monkeypatch, tmp_path):
    monkeypatch.delenv("STAR_TRACKING", raising=False)
    assert requested() == [] and open_trackers(tmp_path, "run") == []
    with pytest.raises(ValueError, match="tensorboard2"):
        requested("mlflow,tensorboard2")


def test_only_finite_numbers_are_sent():
    assert numeric({"a": 1, "b": 2.5, "c": float("nan"), "d": True, "e": "x"}) == {"a": 1.0, "b": 2.5}


def test_mlflow_local_store_holds_every_step(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("STAR_MLFLOW_TRACKING_URI", raising=False)
    trackers = Trackers([MlflowTracker(tmp_path, "tiny/rl", {"lr": 1e-5})])
    for step in (1, 2, 3):
        trackers.log({"loss": 1.0 / step, "reward_mean": step * 0.1, "note": "text is skipped"}, step)
    run_id = trackers.trackers[0].run_id
    trackers.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    run = client.get_run(run_id)
    assert run.data.params["lr"] == "1e-05" and run.info.status == "FINISHED"
    assert "note" not in run.data.metrics


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(tmp_path, "tiny/sft", {"lr": 1e-4})
    trackers = Trackers([tracker])
    for step in (1, 2):
        trackers.log({"loss": 2.0 / step}, step)
    trackers.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (log_file,) = runs[0].glob("run-*.wandb")  # what `wandb sync` uploads
    deadline = time.monotonic() + 30  # wandb's own process writes the file; complete once it holds the exit
    while time.monotonic() < deadline and "exit" not in {r.WhichOneof("record_type") for r in wandb_records(log_file)}:
        time.sleep(0.2)
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in wandb_records(log_file)
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h["loss"]) for h in history] == [(1, 2.0), (2, 1.0)]


def wandb_records(path):
    """The records of a W&B run file: a LevelDB-style log (a 7-byte file header, 32 KiB blocks of
    records each with a 7-byte header: CRC32, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_runlog_sends_its_steps_to_the_trackers_switched_on(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from services.learner.runlog import RunLog

    monkeypatch.setenv("STAR_TRACKING", "mlflow")
    monkeypatch.setenv("STAR_MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store.db'}")
    log = RunLog(tmp_path / "run" / "rl", tensorboard=False)
    log.write(1, {"loss": 0.5})
    log.write(2, {"loss": 0.25})
    log.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'store.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("star").experiment_id])
    assert run.info.run_name == "run/rl"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [0.5, 0.25]
