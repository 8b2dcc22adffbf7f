"""A timed `make align` run and its report: promotions, rollbacks, the serving version's held-out
accuracy over time (PNG) and the feedback-to-serving latency (issue 19, benchmarks/RESULTS.md).

    .venv/bin/python benchmarks/align.py                      # 10 minutes, fresh runs/align-bench/
    .venv/bin/python benchmarks/align.py --duration 120 --flip-reward-steps 10,11,12   # a bad candidate

Runs `examples.align.local` (one rollout server, two serving replicas, simulated users, `dlrl align`)
for `--duration` seconds of `dlrl align` (then SIGTERM), with `align.output_dir` and `align.store`
in a fresh `runs/align-bench/`, then prints a markdown report from the version registry, the
metrics and the users' stats, and copies the serving-accuracy plot to `--png`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.align.local import main as align_local  # noqa: E402
from store import open_store  # noqa: E402
from trainer.align.registry import NO_PRUNE  # noqa: E402
from trainer.align.report import plot_serving  # noqa: E402
from trainer.monitor.metrics_log import read_jsonl  # noqa: E402


def report(out: Path, db: Path, png: Path) -> str:
    with open_store(db, **NO_PRUNE) as st:
        versions, events = {v["version"]: v for v in st.versions()}, st.events()
    recs = read_jsonl(out / "metrics.jsonl")
    t0 = recs[0]["time"] if recs else time.time()
    users = json.loads((out / "users.json").read_text()) if (out / "users.json").is_file() else {}
    lines = ["| min | event | version | held-out acc. | KL | feedback-to-serving (median / min / max) |",
             "|---:|---|---:|---:|---:|---|"]
    for e in events:
        if e["kind"] not in ("promoted", "rollback", "gate_failed", "promotion_aborted", "superseded"):
            continue
        ev = (versions.get(e["version"]) or {}).get("eval") or {}
        lat = e["detail"].get("feedback_to_serving") or {}
        lat_s = f"{lat['median_s']:.0f} s / {lat['min_s']:.0f} s / {lat['max_s']:.0f} s" if lat else "-"
        what = e["kind"] + (f" ({e['detail'].get('kind')})" if e["kind"] == "rollback" else "")
        acc = f"{100 * ev['accuracy']:.1f}%" if ev.get("accuracy") is not None else "-"
        kl = f"{ev['kl']:.4f}" if ev.get("kl") is not None else "-"
        lines.append(f"| {(e['time'] - t0) / 60:.1f} | {what} | {e['version']} | {acc} | {kl} | {lat_s} |")
    promoted = [e for e in events if e["kind"] == "promoted" and not e["detail"].get("initial")]
    serving = [r for r in recs if isinstance(r.get("serving_accuracy"), float)]
    summary = {
        "steps": len(recs), "candidates": sum(1 for r in recs if r.get("candidate_version")),
        "promotions": len(promoted), "gate_failed": sum(e["kind"] == "gate_failed" for e in events),
        "rollbacks": sum(e["kind"] == "rollback" for e in events),
        "superseded": sum(e["kind"] == "superseded" for e in events),
        "serving_accuracy_start": serving[0]["serving_accuracy"] if serving else None,
        "serving_accuracy_end": serving[-1]["serving_accuracy"] if serving else None,
        "feedback_used": sum(v["data"].get("feedback", 0) for v in versions.values()),
        "user_requests": users.get("requests"), "user_errors": users.get("errors"),
    }
    if (out / "metrics.jsonl").is_file():
        plot_serving(out / "metrics.jsonl", png)
    return "\n".join(["```", json.dumps(summary, indent=1), "```", "", *lines, "", f"plot: {png}"])


FLIP_ENV = "DLRL_TEST_FLIP_REWARD_STEPS"  # read by tests/trainer/align/flipping.py


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of dlrl align")
    ap.add_argument("--config", default="configs/align.yaml")
    ap.add_argument("--out", default="runs/align-bench")
    ap.add_argument("--png", default="benchmarks/align_serving.png")
    ap.add_argument("--flip-reward-steps", default="", help="steps (1-based, comma-separated) trained on "
                    "1 - reward by the tests' controller (tests/trainer/align/flipping.py): a bad candidate")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    flip = []
    if args.flip_reward_steps:
        os.environ[FLIP_ENV] = args.flip_reward_steps
        flip = ["--align-module", "tests.trainer.align.flipping"]
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    db = out / "feedback.db"
    t0 = time.time()
    code = align_local(["--config", args.config, "--duration", str(args.duration), *flip, f"output_dir={out}",
                        f"store={db}", *args.overrides])
    print(f"\n## dlrl align for {args.duration:.0f} s (whole command {time.time() - t0:.0f} s, exit {code})\n")
    print(report(out, db, Path(args.png)))
    return code


if __name__ == "__main__":
    sys.exit(main())
