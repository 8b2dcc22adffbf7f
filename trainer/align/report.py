"""Pictures and tables of a `dlrl align` run: the serving version's accuracy over time, the registry.

    plot_serving("runs/align/metrics.jsonl", "runs/align/serving.png")
    print(format_versions(store.versions()))       # `dlrl versions`
    print(format_events(store.events()))           # `dlrl versions --events`
    print(event_line(event))                       # one status line (`make align`, the console)

The PNG shows, against wall-clock minutes since the run started, the held-out accuracy of the
version the serving replicas serve (a step line: it moves at each promotion or rollback), every
candidate the gate saw (filled: passed, cross: stopped) and the reward of the training batches.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TypeGuard

from trainer.monitor.metrics_log import new_figure, read_jsonl, save_figure


def _num(x: object) -> TypeGuard[int | float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def plot_serving(jsonl_path: str | Path, png_path: str | Path) -> Path:
    recs = [r for r in read_jsonl(jsonl_path) if _num(r.get("time"))]
    fig = new_figure(figsize=(8, 5.5))
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    if recs:
        t0 = recs[0]["time"]
        minutes = lambda r: (r["time"] - t0) / 60.0  # noqa: E731
        serving = [(minutes(r), r["serving_accuracy"]) for r in recs if _num(r.get("serving_accuracy"))]
        if serving:
            ax.step(*zip(*serving), where="post", lw=2, label="serving version")
        for passed, style, label in ((1, "o", "candidate: passed the gate"), (0, "x", "candidate: stopped")):
            pts = [(minutes(r), r["eval_accuracy"]) for r in recs
                   if _num(r.get("eval_accuracy")) and r.get("gate_passed") == passed]
            if pts:
                ax.plot(*zip(*pts), style, ms=7, label=label)
        rew = [(minutes(r), r["reward_mean"]) for r in recs if _num(r.get("reward_mean"))]
        if rew:
            ax2.plot(*zip(*rew), lw=1, label="batch reward (on-policy + feedback)")
            ax2.legend(loc="best", fontsize=8)
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right", fontsize=8)
    ax2.set_xlabel("minutes")
    ax2.set_ylabel("reward")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"dlrl align: {Path(jsonl_path).parent.name}")
    return save_figure(fig, png_path)


def _fmt_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def format_versions(versions: list[dict]) -> str:
    head = ["version", "parent", "step", "status", "accuracy", "kl", "on_policy", "feedback", "updated"]
    rows = []
    for v in versions:
        ev, data = v.get("eval") or {}, v.get("data") or {}
        acc, kl = ev.get("accuracy"), ev.get("kl")
        rows.append([str(v["version"]), "-" if v["parent"] is None else str(v["parent"]), str(v["step"]),
                     v["status"], "-" if acc is None else f"{100 * acc:.1f}%", "-" if kl is None else f"{kl:.4f}",
                     str(data.get("on_policy", "-")), str(data.get("feedback", "-")), _fmt_time(v.get("updated"))])
    return _table(head, rows)


def format_events(events: list[dict]) -> str:
    head = ["id", "time", "kind", "version", "replica", "detail"]
    rows = [[str(e["id"]), _fmt_time(e["time"]), e["kind"], str(e["version"]), e.get("replica") or "-",
             json.dumps(e.get("detail") or {}, default=str)[:120]] for e in events]
    return _table(head, rows)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def event_line(e: dict) -> str:
    """One human line for a registry event: what `make align` prints per gate verdict, promotion,
    rollback (and the console lists). Never holds user text (events hold scores, reasons, replicas)."""
    d, v, kind = e.get("detail") or {}, e.get("version"), e.get("kind")
    scores = d.get("scores") or {}
    acc = scores.get("accuracy")
    acc_s = f" held-out accuracy {100 * acc:.1f}%" if _num(acc) else ""
    if kind == "gate_passed":
        text = f"version {v} passed the gate:{acc_s} vs serving {100 * d.get('serving_accuracy', 0):.1f}%, " \
               f"KL {scores.get('kl', 0):.4f}"
    elif kind == "gate_failed":
        text = f"version {v} stopped by the gate:{acc_s}; " + "; ".join(d.get("reasons") or [])
    elif kind == "canary":
        text = f"version {v} on the canary {e.get('replica')}"
    elif kind == "promoted":
        lat = d.get("feedback_to_serving") or {}
        text = f"version {v} promoted to every replica" + (" (initial)" if d.get("initial") else
                                                             f" (was {d.get('previous')})")
        if lat.get("num"):
            text += f"; feedback-to-serving median {lat['median_s']:.0f}s over {lat['num']} records"
    elif kind == "rollback":
        text = f"version {v} rolled back ({d.get('kind')}) to {d.get('to')}" + (
            ": " + "; ".join(d["reasons"]) if d.get("reasons") else "")
    elif kind == "superseded":
        text = f"version {v} superseded: {d.get('reason', '')}"
    elif kind in ("promotion_paused", "promotion_resumed"):
        text = f"promotion {kind.split('_')[1]}" + (f" ({d['by']})" if d.get("by") else "")
    else:  # promotion_started, promotion_aborted, replica_missed, replica_synced, ...
        text = f"version {v}: {str(kind).replace('_', ' ')}" + (f" on {e['replica']}" if e.get("replica") else "")
        if d.get("reason"):
            text += f": {d['reason']}"
    return f"[{time.strftime('%H:%M:%S', time.localtime(e.get('time') or time.time()))}] {text}"
