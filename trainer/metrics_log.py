"""Per-step training metrics: JSONL file, TensorBoard, a console progress bar, and PNG curves.

    with MetricsLogger("runs/x", total_steps=200) as log:
        for step in range(log.next_step, 200 + 1):     # resumes after the last logged step
            ...
            log.log(step, {"reward_mean": 0.4, "accuracy": 0.3, "kl_ref": 0.01, "step_time": 2.1})
    plot_curves("runs/x/metrics.jsonl", "runs/x/curves.png")

`metrics.jsonl` holds one JSON object per step (`{"step": N, "time": unix, ...}`), appended
and flushed as each step is logged. On restart the file is read back: a torn last line is cut
off and steps at or below the last logged one are skipped, so re-running a step after a crash
never duplicates it. TensorBoard (`tb/`) is optional: without the `tensorboard` package only
the JSONL and the bar are written. Non-numeric values go to the JSONL only.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

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
                 console: bool = True, jsonl_name: str = JSONL_NAME):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / jsonl_name
        if self.path.is_file():
            _truncate_torn_tail(self.path)
        done = read_jsonl(self.path)
        self.last_step: int | None = max((int(r["step"]) for r in done), default=None)
        self._file = self.path.open("a")
        self._tb = self._open_tensorboard() if tensorboard else None
        self._bar = None
        if console:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=self.next_step - 1 if done else 0,
                             desc="rl", unit="step", dynamic_ncols=True)

    @property
    def next_step(self) -> int:
        """First step not logged yet (steps are 1-based by convention; 0 also accepted)."""
        return 1 if self.last_step is None else self.last_step + 1

    def _open_tensorboard(self):
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
        if self._tb is not None:
            for k, v in record.items():
                if k not in ("step", "time") and _is_number(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(record), refresh=False)
            self._bar.update(1)
        return True

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
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plot_curves(jsonl_path: str | Path, png_path: str | Path,
                keys: tuple[str, ...] = ("reward_mean", "accuracy")) -> Path:
    """PNG of `keys` over steps (one panel each), plus `eval_accuracy` (at the steps that have
    it) in the accuracy panel when present. Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(jsonl_path)
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["step"], r[key]) for r in records if _is_number(r.get(key))]
        if pts:
            ax.plot(*zip(*pts), label=key, lw=1.5)
        if key == "accuracy":
            ev = [(r["step"], r["eval_accuracy"]) for r in records if _is_number(r.get("eval_accuracy"))]
            if ev:
                ax.plot(*zip(*ev), "o-", label="eval_accuracy", lw=1.5, ms=4)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(Path(jsonl_path).parent.name or "metrics")
    return save_figure(fig, png_path)


def save_figure(fig, png_path: str | Path) -> Path:
    """Lay out, write (folders made) and close a matplotlib figure; -> the PNG's path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
