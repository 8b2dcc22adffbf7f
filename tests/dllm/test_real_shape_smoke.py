"""Real-shape smoke run (slow): SDAR-1.7B-Chat shapes with 1 layer (672M parameters), the stand-in
Qwen tokenizer and a MATH-style JSONL: `dlrl serve`, `dlrl eval` and 2 steps of `dlrl train`
(math reward, DiPO) as real CLI subprocesses, through benchmarks/real_shape.py (whose numbers are
in benchmarks/RESULTS.md). Chat turns use the template and stop at <|im_end|>."""

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import run_group

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_real_shape_serve_eval_train(tmp_path):
    summary_path = tmp_path / "summary.json"
    out = run_group([sys.executable, str(ROOT / "benchmarks" / "real_shape.py"), "--workdir", str(tmp_path),
                     "--json", str(summary_path), "--layers", "1", "--steps", "2"], timeout=1200, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    s = json.loads(summary_path.read_text())
    assert s["params_millions"] > 600  # vocab 151936 x hidden 2048, embeddings untied
    assert s["chat"]["num_stopped_at_im_end"] >= 1 and s["chat"]["stop_token_in_trace"], s["chat"]
    assert s["eval"]["rc"] == 0, (tmp_path / "eval.log").read_text()[-3000:]
    assert s["train"]["rc"] == 0, (tmp_path / "train.log").read_text()[-3000:]
    assert s["train_steps_logged"] == 2
    results = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert [r["setting"]["name"] for r in results] == ["static steps=1", "dynamic threshold=0.9"]
    for r in results:
        assert r["finish_reasons"].get("stop", 0) >= 1  # turns end at <|im_end|> before max_tokens
        assert r["problems"][0]["prompt"].startswith("<|im_start|>user\n")  # the chat template
    steps = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in steps] == [1, 2]  # each step pushed its weights into the server
    assert s["peak_rss_sum_gib"] < 24
