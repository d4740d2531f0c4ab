"""output.report_to: a tiny run logged to TensorBoard, W&B (offline), MLflow (a local file
store) and trackio, each read back with the tracker's own reader – loss and moetune's MoE metrics –
with a planted key found in no file, and nothing written to the working directory."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from moetune.cli import app
from moetune.cli.options import choices, option_overrides
from moetune.config import parse_config
from moetune.train import TrainError, train
from moetune.train import trackers as trackers_mod
from moetune.train.routing.recorder import LayerLoad
from moetune.train.trackers import (
    TRACKERS,
    TrackerCallback,
    routing_metrics,
    shift_metrics,
    tracker_env,
)
from test_train_helpers import one_thread, reverse_rows, run_config, save_tiny_model, write_jsonl

KEYS = {  # planted credentials: none may appear in a file the run wrote
    "WANDB_API_KEY": "wandbkey-3f9a1c7e5b2d4f6a8c0e1b3d5f7a9c1e3b5d7f9a",
    "MLFLOW_TRACKING_TOKEN": "mlflowtoken-5e7c9a1b3d5f7e9c1a3b5d7f",
    "HF_TOKEN": "hf_plantedFakeTokenForTheTrackersTest0123",
}


def _logged(tmp_path_factory: Any, wanted: list[str]) -> Any:
    """One 4-step run logging to those of `wanted` installed, from an empty working dir,
    keys planted."""
    names = [n for n in wanted if trackers_mod.installed(TRACKERS.get(n).package)]
    if not names:
        pytest.skip(f"{', '.join(wanted)} not installed (pip install 'moetune[trackers]')")
    root = tmp_path_factory.mktemp("trackers")
    model = save_tiny_model(root / "model")
    data = write_jsonl(root / "train.jsonl", reverse_rows(24))
    cfg = run_config(model, data, root / "run", max_steps=4, save_steps=2, logging_steps=2)
    cfg.output.report_to = names  # type: ignore[assignment]
    cwd = root / "cwd"
    cwd.mkdir()
    with pytest.MonkeyPatch.context() as mp, one_thread():
        mp.chdir(cwd)
        for key, value in {**KEYS, "WANDB_MODE": "offline"}.items():
            mp.setenv(key, value)
        for name in names:  # moetune's defaults, not this machine's settings
            for key in TRACKERS.get(name).env(root):
                mp.delenv(key, raising=False)
        result = train(cfg, progress=False)
        if "wandb" in names:  # its service process ends with the run, not at exit
            import wandb

            wandb.teardown()
    run = Path(result.run_dir)
    routing = [json.loads(line) for line in (run / "routing.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    return types.SimpleNamespace(root=root, run=run, cwd=cwd, on=names, routing=routing,
                                 summary=summary, result=result)  # fmt: skip


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    """The fast suite's run: TensorBoard only (its package is light, in the dev extra)."""
    return _logged(tmp_path_factory, ["tensorboard"])


@pytest.fixture(scope="module")
def wandb_mlflow_run(tmp_path_factory):
    """W&B offline, an MLflow file store and trackio in one run (heavy packages: -m slow)."""
    return _logged(tmp_path_factory, ["wandb", "mlflow", "trackio"])


def _need(logged: Any, name: str) -> None:
    if name not in logged.on:
        pytest.skip(f"{name} is not installed (pip install 'moetune[trackers]')")


def _expected(logged: Any, step: int) -> dict[str, float]:
    """routing.jsonl's record of `step` as the tracker keys, drift against summary's base."""
    (row,) = [r for r in logged.routing if r["step"] == step]
    base = {b["layer"]: b["top1_share"] for b in logged.summary["routing"]["base"]}
    out = {}
    for load in row["layers"]:
        n = load["layer"]
        out[f"moe/entropy/layer_{n}"] = load["entropy"]
        out[f"moe/top1_share/layer_{n}"] = load["top1_share"]
        out[f"moe/dead_experts/layer_{n}"] = len(load["dead_experts"])
        out[f"moe/top1_drift/layer_{n}"] = load["top1_share"] - base[n]
    return out


def test_the_first_choice_shift_reaches_the_trackers_beside_the_set_shift():
    row = {"step": 2, "mean_shift": 0.2, "mean_top1_shift": 0.1,
           "layers": [{"layer": 3, "tokens": 10, "shift": 0.2, "top1_shift": 0.1}]}  # fmt: skip
    assert shift_metrics(row) == {
        "moe/routing_shift/layer_3": 0.2, "moe/routing_shift_mean": 0.2,
        "moe/routing_shift_top1/layer_3": 0.1, "moe/routing_shift_top1_mean": 0.1,
    }  # fmt: skip


def test_tensorboard_events_hold_loss_and_moe_metrics(tensorboard_run):
    logged = tensorboard_run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged.run / "trackers" / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in tags}
    assert set(scalars["train/loss"]) == {2, 4}  # the step's own loss rows still log
    for step in (2, 4):  # routing_every 2: a record at every logged step
        for key, value in _expected(logged, step).items():
            assert scalars[f"train/{key}"][step] == pytest.approx(value, abs=1e-6), key
    planned = logged.summary["memory"]["planned_peak_bytes"]
    assert scalars["train/memory/planned_peak_bytes"][4] == pytest.approx(planned, rel=1e-6)
    measured = scalars["train/memory/peak_bytes"][4]
    assert 0 < measured <= logged.summary["memory"]["measured_peak_bytes"]
    assert scalars["train/memory/measured_over_planned"][4] == pytest.approx(
        measured / planned, rel=1e-3
    )


def _wandb_history(path: Path) -> list[dict[str, Any]]:
    """The history records of a W&B transaction log (the LevelDB log format W&B documents:
    a 7-byte header, 32 KiB blocks, records of crc32 | length | type), parsed with W&B's own
    protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, part, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # full, or the last piece of one
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in items})  # fmt: skip
    return rows


@pytest.mark.slow
def test_wandb_offline_run_holds_loss_and_moe_metrics(wandb_mlflow_run):
    logged = wandb_mlflow_run
    _need(logged, "wandb")
    (log,) = (logged.run / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")
    rows = {int(r["train/global_step"]): r for r in _wandb_history(log) if "train/loss" in r}
    assert set(rows) == {2, 4}
    moe = [r for r in _wandb_history(log) if "train/moe/entropy_min" in r]
    assert [int(r["train/global_step"]) for r in moe] == [2, 4]
    for row in moe:
        for key, value in _expected(logged, int(row["train/global_step"])).items():
            assert row[f"train/{key}"] == pytest.approx(value, abs=1e-6), key


@pytest.mark.slow
def test_mlflow_file_store_holds_loss_and_moe_metrics(wandb_mlflow_run, monkeypatch):
    logged = wandb_mlflow_run
    _need(logged, "mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((logged.run / "trackers" / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("moetune")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == logged.run.name and found.info.status == "FINISHED"

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}

    assert set(history("loss")) == {2, 4}
    for step in (2, 4):
        for key, value in _expected(logged, step).items():
            assert history(key)[step] == pytest.approx(value, abs=1e-6), key


def test_no_planted_key_in_any_file_and_nothing_in_the_cwd(tensorboard_run):
    _no_key_and_nothing_in_the_cwd(tensorboard_run)


@pytest.mark.slow
def test_trackio_database_holds_loss_and_moe_metrics(wandb_mlflow_run):
    logged = wandb_mlflow_run
    _need(logged, "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    db = SQLiteStorage.get_project_db_path("moetune")
    assert db.is_file() and logged.run / "trackers" / "trackio" in db.parents
    assert SQLiteStorage.get_runs("moetune") == [logged.run.name]
    rows = SQLiteStorage.get_logs("moetune", logged.run.name)  # "step": trackio's own count
    assert {int(r["train/global_step"]) for r in rows if "train/loss" in r} == {2, 4}
    moe = [r for r in rows if "train/moe/entropy_min" in r]
    assert [int(r["train/global_step"]) for r in moe] == [2, 4]
    for row in moe:
        for key, value in _expected(logged, int(row["train/global_step"])).items():
            assert row[f"train/{key}"] == pytest.approx(value, abs=1e-6), key


@pytest.mark.slow
def test_no_planted_key_in_wandb_mlflow_or_trackio_files(wandb_mlflow_run):
    _no_key_and_nothing_in_the_cwd(wandb_mlflow_run)


def _no_key_and_nothing_in_the_cwd(logged: Any) -> None:
    files = [p for p in logged.root.rglob("*") if p.is_file()]
    assert any("trackers" in p.parts for p in files)
    for path in files:  # the run dir, the trackers' files under it, the ledger
        data = path.read_bytes()
        assert not any(v.encode() in data for v in KEYS.values()), path
    assert list(logged.cwd.iterdir()) == []
    folders = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlruns"}
    wanted = {folders.get(n, n) for n in logged.on}
    assert {p.name for p in (logged.run / "trackers").iterdir()} >= wanted
    metrics = [json.loads(x) for x in (logged.run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == [2, 4]  # moetune's own rows unchanged


# ---------------------------------------------------------------- without a run


def test_missing_tracker_is_one_line_naming_the_extra_before_any_model(tmp_path, monkeypatch):
    monkeypatch.setattr(trackers_mod, "installed", lambda package: package != "wandb")
    cfg = {"model": {"id": str(tmp_path / "no-model-here")}, "data": {"train_file": "x.jsonl"}}
    cfg["output"] = {"dir": str(tmp_path / "run"), "ledger": str(tmp_path / "ledger.jsonl")}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["train", str(path), "--report-to", "tensorboard,wandb"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 2 and "Traceback" not in result.stderr
    assert "wandb" in lines[0] and "pip install 'moetune[trackers]'" in result.stderr
    assert not (tmp_path / "run").exists()  # refused before the model or the run dir


def test_report_to_flag_and_registry_match_the_field():
    assert TRACKERS.names() == sorted(choices("output.report_to") or [])
    cfg = parse_config({}, option_overrides(report_to="tensorboard, mlflow"))
    assert cfg.output.report_to == ["tensorboard", "mlflow"]
    with pytest.raises(Exception, match="report-to"):
        option_overrides(report_to="comet")


def test_tracker_files_default_under_the_run_dir_and_the_users_env_wins(tmp_path, monkeypatch):
    for key in ("TENSORBOARD_LOGGING_DIR", "WANDB_DIR", "MLFLOW_TRACKING_URI", "TRACKIO_DIR"):
        monkeypatch.delenv(key, raising=False)
    env = tracker_env(TRACKERS.names(), tmp_path)
    assert env["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "trackers" / "tensorboard")
    assert env["WANDB_DIR"] == str(tmp_path / "trackers")
    assert env["MLFLOW_TRACKING_URI"] == (tmp_path / "trackers" / "mlruns").as_uri()
    assert env["TRACKIO_DIR"] == str(tmp_path / "trackers" / "trackio")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert "MLFLOW_TRACKING_URI" not in tracker_env(["mlflow"], tmp_path)
    with trackers_mod.tracking(["tensorboard"], tmp_path):
        assert os.environ["TENSORBOARD_LOGGING_DIR"].startswith(str(tmp_path))
    assert "TENSORBOARD_LOGGING_DIR" not in os.environ  # restored


def test_moe_metrics_per_layer_with_drift_and_no_key_a_folder_of_another():
    loads = [LayerLoad(0, (6, 2, 0, 0), (3, 1, 0, 0)), LayerLoad(1, (2, 2, 2, 2), (1, 1, 1, 1))]
    base = {0: LayerLoad(0, (4, 4, 0, 0), (2, 2, 0, 0))}
    out = routing_metrics([load.to_json() for load in loads], base)
    assert out["moe/top1_share/layer_0"] == 0.75 and out["moe/top1_drift/layer_0"] == 0.25
    assert "moe/top1_drift/layer_1" not in out  # no base measured there: no drift claimed
    assert out["moe/dead_experts/layer_0"] == 2 and out["moe/dead_experts_total"] == 2
    assert out["moe/entropy/layer_1"] == 1.0
    assert out["moe/entropy_min"] == out["moe/entropy/layer_0"] < 1.0
    row = {"step": 1, "mean_shift": 0.2, "layers": [{"layer": 0, "tokens": 10, "shift": 0.3}]}
    keys = [*out, *shift_metrics(row), "memory/peak_bytes", "memory/planned_peak_bytes"]
    assert shift_metrics(row) == {"moe/routing_shift/layer_0": 0.3, "moe/routing_shift_mean": 0.2}
    assert not any(b.startswith(a + "/") for a in keys for b in keys)  # MLflow's files


def test_feed_logs_a_step_once_and_keeps_the_steps_own_loss_row_due():
    logged: list[dict[str, float]] = []
    feed = TrackerCallback(logged.append, lambda: {}, planned_peak=1000)
    feed.routing({"step": 3, "layers": [LayerLoad(0, (1, 1), (1, 1)).to_json()]})
    feed.shift({"step": 3, "mean_shift": 0.5, "layers": [{"layer": 0, "tokens": 4, "shift": 0.5}]})
    args = types.SimpleNamespace(logging_steps=2)
    state = types.SimpleNamespace(global_step=3, max_steps=10, is_world_process_zero=True)
    control = types.SimpleNamespace(should_log=True)
    feed.on_step_end(args, state, control)
    (row,) = logged
    assert row["moe/entropy/layer_0"] == 1.0 and row["moe/routing_shift_mean"] == 0.5
    assert row["memory/planned_peak_bytes"] == 1000 and control.should_log is True
    state.global_step = 5  # nothing recorded, not a logging step: nothing sent
    feed.on_step_end(args, state, control)
    assert len(logged) == 1


def test_mlx_stack_refuses_report_to():
    from moetune.train.mlx.stack import refuse_unsupported

    cfg = parse_config({"lora": {"stack": "mlx"}, "output": {"report_to": ["tensorboard"]}})
    with pytest.raises(TrainError, match="report_to"):
        refuse_unsupported(cfg)


def test_a_failed_run_ends_its_wandb_run_as_failed_and_the_env_is_restored(tmp_path, monkeypatch):
    ended: list[int] = []
    fake = types.SimpleNamespace(run=object(), finish=lambda exit_code: ended.append(exit_code))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    with pytest.raises(RuntimeError), trackers_mod.tracking(["wandb"], tmp_path):
        assert os.environ["WANDB_DIR"] == str(tmp_path / "trackers")
        raise RuntimeError("a step failed")
    with trackers_mod.tracking(["wandb"], tmp_path):
        pass
    assert ended == [1, 0] and "WANDB_DIR" not in os.environ


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("tensorboard", "TENSORBOARD_LOGGING_DIR", "{file}/tb"),
        ("wandb", "WANDB_DIR", "{file}"),
        ("mlflow", "MLFLOW_TRACKING_URI", "file://{file}/mlruns"),
        ("trackio", "TRACKIO_DIR", "/dev/null/trackio"),
    ],
)
def test_an_unwritable_tracker_folder_is_one_line_before_any_model(
    tmp_path, monkeypatch, name, key, value
):
    """Issue 36 item 8: the user's own tracker folder under a file (or a device) was an
    exit-3 NotADirectoryError after the run dir was started."""
    monkeypatch.setattr(trackers_mod, "installed", lambda package: True)
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv(key, value.format(file=tmp_path / "a-file"))
    cfg = {"model": {"id": str(tmp_path / "no-model-here")}, "data": {"train_file": "x.jsonl"}}
    cfg["output"] = {"dir": str(tmp_path / "run"), "ledger": str(tmp_path / "ledger.jsonl")}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["train", str(path), "--report-to", name])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 2 and "Traceback" not in result.stderr
    assert f"{name} writes to {key}=" in lines[0]
    assert "is not a directory" in result.stderr or "is a file, not a folder" in result.stderr
    assert f"point {key} at a writable folder" in result.stderr
    assert not (tmp_path / "run").exists()  # refused before the model or the run dir


def test_a_tracker_server_uri_is_not_a_folder_to_check(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    trackers_mod.check_tracker_dirs(["mlflow"])  # nothing local to write: no refusal
