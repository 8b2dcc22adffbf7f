"""Experiment trackers for `train.report_to` (as HF Trainer's `report_to`): each optional and
imported only when asked for.

    trackers = open_trackers(["wandb", "mlflow"], run_dir, run_name="tiny-rl", config=cfg.model_dump())
    for t in trackers: t.log(step, {"reward_mean": 0.4})        # numbers only
    for t in trackers: t.close()

- `tensorboard` is written by trainer.monitor.metrics_log.MetricsLogger itself (`output_dir/tb`).
- `wandb`: `wandb.init(project=$WANDB_PROJECT or "dlrl", name=run_name, dir=output_dir)`; all of
  wandb's environment applies (`WANDB_MODE=offline`, `WANDB_API_KEY`, `WANDB_ENTITY`, ...).
- `mlflow`: the tracking URI from `MLFLOW_TRACKING_URI`, else a local file store in
  `output_dir/mlruns` (MLFLOW_ALLOW_FILE_STORE=true is set for it); experiment
  `$MLFLOW_EXPERIMENT_NAME` or "dlrl".
- `trackio`: `trackio.init(project=$TRACKIO_PROJECT or "dlrl", name=run_name)`.
A tracker whose package is missing is an error at start (`missing_trackers`), naming the key.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("dlrl.train")
Tracker = Literal["tensorboard", "wandb", "mlflow", "trackio"]
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def missing_trackers(names: list[str]) -> str:
    """"" when every tracker's package is importable, else a message naming train.report_to."""
    missing = [n for n in names if importlib.util.find_spec(PACKAGES[n]) is None]
    if not missing:
        return ""
    return (f"train.report_to: {', '.join(missing)} not installed (pip install 'dlrl[trackers]' for wandb and "
            f"mlflow, pip install {' '.join(PACKAGES[n] for n in missing)}), or remove it from train.report_to")


class WandbTracker:
    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dlrl"), name=run_name, dir=str(run_dir),
                              config=config, reinit=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step, commit=True)  # one call per step: written now

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a local file store next to the run (mlflow 3 asks for an explicit opt-in)
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "dlrl")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        for key, value in list(config.items())[:500]:
            self.client.log_param(self.run_id, key, str(value)[:500])
        log.info("mlflow: run %s in %s", self.run_id, uri)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any]):
        import trackio

        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "dlrl"), name=run_name, config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.trackio.log(metrics, step=step)

    def close(self) -> None:
        self.trackio.finish()


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker, "trackio": TrackioTracker}


def open_trackers(names: list[str], run_dir: str | Path, run_name: str, config: dict[str, Any]) -> list[Any]:
    """The trackers of `names` other than tensorboard (MetricsLogger writes that), started."""
    problem = missing_trackers(names)
    if problem:
        raise ValueError(problem)
    return [TRACKERS[n](Path(run_dir), run_name, config) for n in dict.fromkeys(names) if n in TRACKERS]
