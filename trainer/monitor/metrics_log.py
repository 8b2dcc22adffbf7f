"""Per-step training metrics: JSONL file, TensorBoard and other trackers, the console, PNG curves.

    with MetricsLogger("runs/x", total_steps=200) as log:
        for step in range(log.next_step, 200 + 1):     # resumes after the last logged step
            ...
            log.log(step, {"reward_mean": 0.4, "accuracy": 0.3, "kl_ref": 0.01, "step_time": 2.1})
    plot_curves("runs/x/metrics.jsonl", "runs/x/curves.png")

`metrics.jsonl` holds one JSON object per step (`{"step": N, "time": unix, ...}`), appended
and flushed as each step is logged. On restart the file is read back: a torn last line is cut
off and steps at or below the last logged one are skipped, so re-running a step after a crash
never duplicates it. TensorBoard (`tb/`) is optional: without the `tensorboard` package only
the JSONL and the console are written; `trackers` (trainer.monitor.trackers: wandb, mlflow, trackio)
get every numeric value too. Non-numeric values go to the JSONL only.

Console: on a terminal a progress bar; when stdout is not one (nohup, Slurm, Kubernetes logs)
plain lines instead, one every `console_every_s` seconds (and at the last step). Every held-out
evaluation (`eval_accuracy`) is printed as a line of its own in both cases.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from torch.utils.tensorboard import SummaryWriter

Panel = tuple[str, Sequence[tuple[str, str, str]]]  # (y label, [(metric key, legend label, style)])

JSONL_NAME = "metrics.jsonl"
# console bar: (metric key, short label); the first key present of each alias tuple is shown
CONSOLE_KEYS = ((("reward_mean", "reward"), "rew"), (("accuracy",), "acc"),
                (("kl_ref", "kl", "approx_kl"), "kl"), (("step_time",), "s/step"))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete, valid records of a metrics file (a torn or corrupt line is skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def _truncate_torn_tail(path: Path) -> None:
    """Cut a last line that has no newline (a write interrupted by a crash)."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class MetricsLogger:
    def __init__(self, run_dir: str | Path, total_steps: int | None = None, tensorboard: bool = True,
                 console: bool = True, jsonl_name: str = JSONL_NAME, trackers: list | None = None,
                 console_every_s: float = 10.0, final_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / jsonl_name
        if self.path.is_file():
            _truncate_torn_tail(self.path)
        done = read_jsonl(self.path)
        self.last_step: int | None = max((int(r["step"]) for r in done), default=None)
        self._file = self.path.open("a")
        self._tb = self._open_tensorboard() if tensorboard else None
        self.trackers = list(trackers or [])
        self._bar = None
        self.console, self.final_step, self.console_every_s = console, final_step, console_every_s
        self._last_line = time.monotonic()
        if console and sys.stdout.isatty():
            self._bar = tqdm(total=total_steps, initial=self.next_step - 1 if done else 0,
                             desc="rl", unit="step", dynamic_ncols=True)

    @property
    def next_step(self) -> int:
        """First step not logged yet (steps are 1-based by convention; 0 also accepted)."""
        return 1 if self.last_step is None else self.last_step + 1

    def _open_tensorboard(self) -> SummaryWriter | None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard not installed: JSONL + console only
            return None
        purge = None if self.last_step is None else self.last_step + 1  # drop events of a lost step
        return SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, Any]) -> bool:
        """Record one step's metrics. Returns False (and writes nothing) when `step` was
        already logged, e.g. a step re-run after resuming from an older checkpoint."""
        step = int(step)
        if self.last_step is not None and step <= self.last_step:
            return False
        record = {"step": step, "time": round(time.time(), 3)}
        record.update({k: v for k, v in metrics.items() if k not in ("step", "time")})
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()
        self.last_step = step
        numbers = {k: float(v) for k, v in record.items() if k not in ("step", "time") and _is_number(v)}
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        for tracker in self.trackers:
            tracker.log(step, numbers)
        self._console(step, record)
        return True

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def _console(self, step: int, record: dict[str, Any]) -> None:
        if not self.console:
            return
        if _is_number(record.get("eval_accuracy")):
            extra = (f", reward {record['eval_reward']:.3g}" if _is_number(record.get("eval_reward")) else "")
            self._write(f"step {step}: held-out greedy accuracy {100 * record['eval_accuracy']:.1f}%{extra}")
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(record), refresh=False)
            self._bar.update(1)
            return
        last = self.final_step is not None and step >= self.final_step
        postfix = self._postfix(record)
        if postfix and (time.monotonic() - self._last_line >= self.console_every_s or last):
            self._write(f"step {step}{f'/{self.final_step}' if self.final_step else ''}: {postfix}")
            self._last_line = time.monotonic()

    @staticmethod
    def _postfix(record: dict[str, Any]) -> str:
        parts = []
        for aliases, label in CONSOLE_KEYS:
            key = next((k for k in aliases if _is_number(record.get(k))), None)
            if key is not None:
                parts.append(f"{label}={record[key]:.3g}")
        return " ".join(parts)

    def set_total(self, total_steps: int | None) -> None:
        """The progress bar's total (None: a run without a fixed length, e.g. dlrl align)."""
        if self._bar is not None:
            self._bar.total = total_steps
            self._bar.refresh()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# curves.png panels: (y label, [(metric key, legend label, style)]); a panel is drawn when a key has data
PANELS: tuple[Panel, ...] = (
    ("reward", [("reward_mean", "training reward (sampled rollouts)", "-")]),
    ("accuracy", [("accuracy", "training accuracy (sampled rollouts)", "-"),
                  ("eval_accuracy", "held-out accuracy (greedy)", "o-")]),
    ("loss", [("pg_loss", "policy loss", "-"), ("value_loss", "value loss", "-")]),
    ("KL", [("kl_ref", "KL to the reference", "-"), ("approx_kl", "approx. KL to the behaviour policy", "-")]),
    ("entropy", [("entropy", "token entropy", "-")]),
    ("clip fraction", [("clip_frac", "clipped ratio fraction", "-")]),
    ("response length", [("response_length", "training (sampled), tokens", "-"),
                         ("eval_response_length", "held-out (greedy), tokens", "o-")]),
)


def plot_curves(jsonl_path: str | Path, png_path: str | Path, panels: Sequence[Panel] = PANELS) -> Path:
    """PNG of the metrics over steps: reward and accuracy panels always (training accuracy of the
    sampled rollouts and held-out greedy accuracy labelled apart), then one panel each for loss,
    KL, entropy, clip fraction and response length when the run logged them. -> the PNG path."""
    records = read_jsonl(jsonl_path)

    def points(key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in records if _is_number(r.get(key))]

    shown = [(title, lines) for i, (title, lines) in enumerate(panels)
             if i < 2 or any(points(key) for key, _, _ in lines)]
    fig = new_figure(figsize=(7, 2.3 * len(shown)))
    axes = fig.subplots(len(shown), 1, sharex=True, squeeze=False)
    for ax, (title, lines) in zip(axes[:, 0], shown):
        for key, label, style in lines:
            pts = points(key)
            if pts:
                ax.plot(*zip(*pts), style, label=label, lw=1.5, ms=4)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(Path(jsonl_path).parent.name or "metrics")
    return save_figure(fig, png_path)


def new_figure(figsize: tuple[float, float]) -> Figure:
    """A matplotlib Figure drawn by the Agg renderer, without pyplot: no global figure registry to close, no
    interactive backend looked for, and pyplot's import (about 1 s of CPU at the end of every run) not paid."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, png_path: str | Path) -> Path:
    """Lay out and write (folders made) a figure of new_figure; -> the PNG's path."""
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    return png_path
