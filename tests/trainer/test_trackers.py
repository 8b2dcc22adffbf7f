"""Show what is happening (issue 24): plain console lines when stdout is not a terminal (every
held-out evaluation on a line of its own), train.report_to trackers (wandb in offline mode, mlflow
with a local file store) receiving every numeric metric, and the labelled curves."""

import json

import pytest

from trainer.monitor.metrics_log import MetricsLogger, plot_curves
from trainer.monitor.trackers import missing_trackers, open_trackers


def _metrics(step):
    return {"reward_mean": step / 10, "accuracy": step / 20, "kl_ref": 0.01 * step, "pg_loss": -0.1 * step,
            "entropy": 1.0 / step, "clip_frac": 0.05, "response_length": 4.0 + step, "step_time": 1.5}


def test_plain_lines_without_a_terminal_and_every_evaluation_printed(tmp_path, capsys):
    with MetricsLogger(tmp_path, tensorboard=False, console_every_s=0, final_step=3) as log:
        log.log(0, {"eval_accuracy": 0.315, "eval_reward": 0.315})
        for step in (1, 2, 3):
            log.log(step, {**_metrics(step), **({"eval_accuracy": 0.845} if step == 3 else {})})
    out = capsys.readouterr().out
    assert "\r" not in out and "it/s" not in out  # no progress-bar fragments
    lines = out.splitlines()
    assert lines[0] == "step 0: held-out greedy accuracy 31.5%, reward 0.315"
    assert lines[1] == "step 1/3: rew=0.1 acc=0.05 kl=0.01 s/step=1.5"
    assert "step 3: held-out greedy accuracy 84.5%" in lines


def test_wandb_offline_and_mlflow_file_store_get_every_metric(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert missing_trackers(["wandb", "mlflow", "tensorboard"]) == ""
    trackers = open_trackers(["wandb", "mlflow", "tensorboard"], tmp_path, "run-a", {"lr": 1e-4})
    wandb_t, mlflow_t = trackers
    with MetricsLogger(tmp_path, console=False, trackers=trackers) as log:
        for step in (1, 2, 3):
            log.log(step, {**_metrics(step), "note": "text"})
        assert wandb_t.run.summary["reward_mean"] == pytest.approx(0.3)
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # written offline, nothing sent
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    history = client.get_metric_history(mlflow_t.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3))]
    assert client.get_run(mlflow_t.run_id).data.params["lr"] == "0.0001"
    assert client.get_run(mlflow_t.run_id).info.status == "FINISHED"
    uri = (tmp_path / "mlruns").resolve().as_uri()  # the end says how to read it back (mlflow 3: opt-in)
    assert f"read it back with `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri}`" in \
        capsys.readouterr().err
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_a_missing_tracker_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    assert "train.report_to: trackio not installed" in missing_trackers(["trackio", "mlflow"])


def test_curves_label_greedy_heldout_and_sampled_training_accuracy(tmp_path, monkeypatch):
    from trainer.monitor import metrics_log

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, **_metrics(s), "eval_accuracy": 0.5}) + "\n" for s in (1, 2)))
    saved = {}
    real_save = metrics_log.save_figure
    monkeypatch.setattr(metrics_log, "save_figure", lambda fig, png: saved.setdefault("fig", fig) and real_save(fig, png))
    assert plot_curves(path, tmp_path / "c.png").stat().st_size > 0
    axes = saved["fig"].axes
    assert [a.get_ylabel() for a in axes] == ["reward", "accuracy", "loss", "KL", "entropy", "clip fraction",
                                              "response length"]
    labels = [t.get_text() for t in axes[1].get_legend().get_texts()]
    assert labels == ["training accuracy (sampled rollouts)", "held-out accuracy (greedy)"]
