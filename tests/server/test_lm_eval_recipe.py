"""The README's lm-eval recipe (issue 47): the commands of "Evaluating with lm-eval-harness", run as written
(address, model name and tokenizer folder replaced, `--limit 4`) through lm-eval's own command line against
a real `dlrl serve`, with the task YAMLs of examples/lm_eval: generation and multiple choice; and the
multiple-choice task against a LLaDA server, scored by the Monte Carlo ELBO. Each score is checked against
what the server's own model gives for the same documents.

    python -m pytest -q tests/server/test_lm_eval_recipe.py
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from dllm.likelihood import sequential_logprobs
from tests.conftest import start_server

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 4
MARK = "<!-- lm-eval: tests/server/test_lm_eval_recipe.py"


def readme_commands() -> list[list[str]]:
    """The `lm_eval` lines of the README's recipe block."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index(MARK):]
    block = block[block.index("```bash") + 7:block.index("```", block.index("```bash") + 7)]
    return [shlex.split(line) for line in block.strip().splitlines() if line.startswith("lm_eval ")]


def _docs() -> list[dict[str, Any]]:
    lines = (ROOT / "examples/lm_eval/addition_heldout.jsonl").read_text().splitlines()[:LIMIT]
    return [json.loads(line) for line in lines]


def run_lm_eval(argv: list[str], url: str, model: str, folder: str, out: Path,
                monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """One README command through lm-eval's CLI in this process (cwd: the repository root); its results."""
    from lm_eval._cli import HarnessCLI

    args = list(argv)
    i = args.index("--model_args") + 1
    args[i] = re.sub(r"base_url=[^,]+", f"base_url={url}/v1/completions", args[i])
    args[i] = re.sub(r"model=[^,]+", f"model={model}", args[i])
    args[i] = re.sub(r"tokenizer=[^,]+", f"tokenizer={folder}", args[i])
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [*args, "--limit", str(LIMIT), "--output_path", str(out)])
    # lm-eval's CLI indexes its ~26,000 built-in task YAMLs first (minutes on a loaded 2-core box); the recipe
    # needs only examples/lm_eval, so the test skips that index (the command line is the README's)
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager,
                                                                         include_defaults=False))
    cli = HarnessCLI()
    cli.execute(cli.parse_args())
    (found,) = out.rglob("results_*.json")
    return json.loads(found.read_text())["results"]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def _mc_expected(score: Any) -> float:
    """The multiple-choice accuracy the scores `score(prompt, choice)` give on the first LIMIT documents."""
    docs = _docs()
    return sum(max(range(3), key=lambda c: score(d["prompt"], d["choices"][c])) == d["label"] for d in docs) / len(docs)


@pytest.mark.slow
def test_readme_recipe_generation_and_multiple_choice(serve_process: Any, server: Any, tiny_model_dir: str,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen_cmd, mc_cmd = readme_commands()
    assert "--tasks" in gen_cmd and gen_cmd[-1] == "dlrl_addition_gen" and mc_cmd[-1] == "dlrl_addition_mc"
    assert "tokenizer_backend=huggingface" in mc_cmd[mc_cmd.index("--model_args") + 1]
    served = serve_process()
    name = httpx.get(served.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    gen = run_lm_eval(gen_cmd, served.url, name, tiny_model_dir, tmp_path / "gen", monkeypatch)["dlrl_addition_gen"]
    expected = 0.0
    for d in _docs():  # the same request lm-eval sends: greedy, its stop and length, its seed
        r = httpx.post(served.url + "/v1/completions", json={"prompt": d["prompt"], "model": name, "max_tokens": 8,
                                                             "temperature": 0, "stop": ["\n"], "seed": 1234}, timeout=60)
        expected += (r.json()["choices"][0]["text"] == d["answer"]) / LIMIT
    assert gen["exact_match,none"] == pytest.approx(expected)
    mc = run_lm_eval(mc_cmd, served.url, name, tiny_model_dir, tmp_path / "mc", monkeypatch)["dlrl_addition_mc"]
    tok, model = server.engine.tokenizer, server.engine.model  # the same folder, in process

    def loglik(prompt: str, choice: str) -> float:
        ids, num = tok.encode(prompt + choice, add_special_tokens=False), len(choice)
        return sum(sequential_logprobs(model, [ids])[0].logprobs[len(ids) - num:])  # type: ignore[arg-type]

    assert mc["acc,none"] == pytest.approx(_mc_expected(loglik))


@pytest.mark.slow
def test_llada_multiple_choice_through_lm_eval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLaDA log-likelihoods: the README's multiple-choice command against a LLaDA server (the ELBO, seeded by
    the seed lm-eval sends), its accuracy the one the same estimate gives in process."""
    from dllm.embedded.full_folders import build_llada_folder
    from dllm.full.likelihood import elbo_logprobs

    folder = str(build_llada_folder(tmp_path / "llada", seed=5))
    srv = start_server(folder, build=True, block_size=4, max_batch=2, elbo_samples=8)
    try:
        mc = run_lm_eval(readme_commands()[1], srv.url, srv.engine.model_name, folder, tmp_path / "out",
                         monkeypatch)["dlrl_addition_mc"]
        tok, model = srv.engine.tokenizer, srv.engine.model

        def loglik(prompt: str, choice: str) -> float:
            ids, ctx = tok.encode(prompt + choice, add_special_tokens=False), tok.encode(prompt, add_special_tokens=False)
            (s,) = elbo_logprobs(model, [ids], num_samples=8, seed=1234)  # lm-eval's seed
            return sum(s.logprobs[len(ctx):])  # type: ignore[arg-type]

        assert mc["acc,none"] == pytest.approx(_mc_expected(loglik))
    finally:
        srv.stop()
