"""MetricsLogger: JSONL + TensorBoard + bar, resume without duplicates, PNG curves."""

from __future__ import annotations

import json

from trainer.monitor.metrics_log import MetricsLogger, plot_curves, read_jsonl

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics(step: int) -> dict:
    return {"reward_mean": step / 10, "accuracy": step / 20, "kl_ref": 0.01 * step, "step_time": 1.5,
            "note": "text is kept in the JSONL"}


def test_writes_jsonl_tensorboard_and_png(tmp_path):
    with MetricsLogger(tmp_path, total_steps=5) as log:
        for step in range(1, 6):
            extra = {"eval_accuracy": 0.5} if step % 2 == 0 else {}
            assert log.log(step, {**_metrics(step), **extra})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[2]["reward_mean"] == 0.3 and records[2]["note"] == "text is kept in the JSONL"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "plots" / "curves.png")
    data = png.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC


def test_resume_skips_logged_steps_and_torn_line(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as log:
        for step in (1, 2, 3):
            log.log(step, _metrics(step))
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "reward_me')  # crash mid-write
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as log:
        assert log.last_step == 3 and log.next_step == 4
        assert not log.log(2, _metrics(2))  # re-run of an old step: skipped
        assert log.log(4, _metrics(4))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


def test_plot_without_some_keys(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward_mean": 0.1 * s}) + "\n" for s in range(3)))
    png = plot_curves(path, tmp_path / "c.png")  # no "accuracy" anywhere: empty panel, no error
    assert png.read_bytes()[:8] == PNG_MAGIC
