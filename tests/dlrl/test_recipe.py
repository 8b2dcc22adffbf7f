"""The README recipe (SDAR-1.7B-Chat on MATH), every command as written, run on a small random model
of the real SDAR-1.7B-Chat config shape (tests/fixtures config, shrunk: conftest.small_sdar_dir)
with the stand-in Qwen tokenizer. The model and the two MATH data sets are hub ids, served from a
Hugging Face cache this test writes (HF_HUB_OFFLINE=1: no network). Extra `key=value` overrides
only make it small and local: CPU, fp32, a free port, tmp paths, 2 steps, short completions."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import free_port, is_ready, run_group, wait_until

ROOT = Path(__file__).resolve().parents[2]
REV = "5eed0000" * 5


def recipe_commands() -> list[list[str]]:
    """The command lines of README.md's recipe block (after the `<!-- recipe` marker)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- recipe.*?-->\n```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.split(line) for line in block.strip().splitlines()]


def _snapshot(home: Path, kind: str, repo: str) -> Path:
    root = home / "hub" / f"{kind}--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(REV)
    return root / "snapshots" / REV


def _hub_cache(home: Path, model_dir: str) -> None:
    shutil.copytree(model_dir, _snapshot(home, "models", "JetLM/SDAR-1.7B-Chat"))
    rows = [{"problem": f"What is {i} + {i}?", "solution": f"Add: $\\boxed{{{2 * i}}}$.", "level": "Level 1",
             "type": "Algebra"} for i in range(8)]
    data = _snapshot(home, "datasets", "DigitalLearningGmbH/MATH-lighteval") / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), data / "test-00000-of-00001.parquet")
    m500 = _snapshot(home, "datasets", "HuggingFaceH4/MATH-500")
    m500.mkdir(parents=True)
    (m500 / "test.jsonl").write_text("".join(json.dumps({"problem": r["problem"], "solution": r["solution"],
                                                         "answer": str(2 * i), "unique_id": f"t/{i}"}) + "\n"
                                             for i, r in enumerate(rows[:3])))


@pytest.mark.slow
def test_the_readme_recipe_runs(small_sdar_dir, tmp_path):
    _hub_cache(tmp_path / "hf", small_sdar_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("DLRL_ADMIN_TOKEN", "CUDA_VISIBLE_DEVICES")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    token_file = tmp_path / "admin_token"
    run_dir = tmp_path / "sdar-math"
    small = {
        "serve": [f"server.port={port}", "server.device=cpu", "server.dtype=float32", "server.max_batch=8",
                  "server.max_model_len=512"],
        "train": [f"servers=[{url}]", "num_steps=2", "prompts_per_step=2", "group_size=2", "max_tokens=8",
                  "eval_size=2", "eval_every=1", "dtype=fp32", "grad_accum=1", "gradient_checkpointing=false",
                  "checkpoint_every=0", "report_to=[]"],
        "eval": [f"servers=[{url}]", "max_tokens=8", "num_samples=1", "limit=2", "dynamic_thresholds=[]"],
        # (no server.* sizes: the recipe's server answers, so dlrl eval starts none and refuses them)
    }
    commands = recipe_commands()
    assert [c[c.index("dlrl") + 1] for c in commands] == ["serve", "train", "eval", "train", "eval"]
    server = None
    try:
        for i, cmd in enumerate(commands):
            argv = cmd[cmd.index("dlrl") + 1:]  # the CUDA_VISIBLE_DEVICES=N prefix: no GPU here
            argv = [a.replace("runs/sdar-math", str(run_dir)) for a in argv]
            argv += small[argv[0]] + [f"server.admin_token_file={token_file}"]
            if argv[0] == "eval" and "output=" not in " ".join(argv):
                argv.append(f"output={run_dir}/eval-base.json")
            if argv[0] == "train":
                argv.append(f"output_dir={run_dir}")
            full = [sys.executable, "-m", "dlrl.cli", *argv]
            if argv[0] == "serve":
                log = open(tmp_path / "serve.log", "wb")
                server = subprocess.Popen(full, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                wait_until(lambda proc=server: is_ready(url) or proc.poll() is not None, 300, "recipe server")
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                continue
            out = run_group(full, timeout=600, cwd=ROOT, env=env)
            (tmp_path / f"step{i}.log").write_text(out.stdout + out.stderr)
            assert out.returncode == 0, f"{argv}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            if argv[0] == "train" and "--check" not in argv:
                assert "train.data: 8 examples from DigitalLearningGmbH/MATH-lighteval" in out.stderr
                assert "train.eval_data: 2 examples from HuggingFaceH4/MATH-500" in out.stderr
                assert json.loads(out.stdout[out.stdout.index("{"):])["summary"].startswith(
                    "done: held-out greedy accuracy")
        served_log = (tmp_path / "serve.log").read_text()
        assert "JetLM/SDAR-1.7B-Chat resolved to" in served_log and f"(revision {REV})" in served_log
        assert httpx.get(url + "/health").json()["model"] == "SDAR-1.7B-Chat"
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    base = json.loads((run_dir / "eval-base.json").read_text())
    held = base["served"][url]
    assert held["model"] == "SDAR-1.7B-Chat" and held["version"] == 0 and held["checksum"]
    assert base["results"][0]["problems"][0]["prompt"].startswith("<|im_start|>user\nWhat is 0 + 0?\nPlease reason")
    final = json.loads((run_dir / "eval-final.json").read_text())
    assert list(final["served"].values())[0]["model"] == "sdar-math"  # the export, named after its run
    assert (run_dir / "final" / "config.json").is_file() and (run_dir / "curves.png").is_file()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
