"""`dlrl eval` and trainer.evaluation.evaluate: data loading, pass@k, and accuracy equal to the one computed
by hand from the generations, against a real server on loopback (and one eval starts itself)."""

import itertools
import json
import socket

import pytest

from tests.helpers import ADMIN_TOKEN
from trainer.eval_cli import main as eval_main
from trainer.evaluation.evaluate import EvalError, load_eval_examples, make_settings, pass_at_k


def test_pass_at_k_matches_enumeration():
    for n in range(1, 6):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_math500_and_gsm8k_records(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"problem": "What is 1/2+1/2?", "solution": "Add: $\\boxed{\\frac{2}{2}}$ so \\boxed{1}."},
        {"question": "Tom has 3 apples...", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "x?", "ground_truth_answer": "42", "answer": "ignored"},
    ]) + "\n")
    ex = load_eval_examples(f)
    assert [e["answer"] for e in ex] == ["1", "7", "42"]
    assert ex[0]["prompt"] == "What is 1/2+1/2?"
    f.write_text(json.dumps({"problem": "p", "solution": "no box"}) + "\n")
    with pytest.raises(EvalError, match="record 1: `solution` has no"):
        load_eval_examples(f)
    f.write_text(json.dumps({"problem": "p"}) + "\n")
    with pytest.raises(EvalError, match="no answer field"):
        load_eval_examples(f)


def test_settings_cross_block_sizes():
    s = make_settings([2, 4], [0.9], [4, 8])
    assert [x.name for x in s] == ["static steps=2 block=4", "static steps=4 block=4", "dynamic threshold=0.9 block=4",
                                   "static steps=2 block=8", "static steps=4 block=8", "dynamic threshold=0.9 block=8"]
    assert make_settings()[0].request_kwargs() == {"strategy": "dynamic", "threshold": 0.9}


def _run(tmp_path, capsys, *overrides) -> dict:
    cfg = tmp_path / "eval.yaml"
    cfg.write_text("eval:\n  start_server: false\n  max_tokens: 8\n  reward: exact_match\n")
    out = tmp_path / "res.json"
    rc = eval_main(["--config", str(cfg), f"output={out}", *overrides])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "pass@1" in printed and "tok/forward" in printed
    return json.loads(out.read_text())


def _by_hand(problem: dict, answer: str) -> list[bool]:
    return [c["text"].strip() == answer.strip() for c in problem["completions"]]


def test_eval_accuracy_equals_hand_count(server, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    prompts = ["1+2=", "33+4=", "7*8=", "9-3=", "12+12=", "5+5="]
    data.write_text("".join(json.dumps({"question": p, "answer": "?"}) + "\n" for p in prompts))
    common = [f"data={data}", f"servers=[{server.url}]"]
    sampled = common + ["num_samples=3", "temperature=1.0", "seed=5", "static_steps=[2]"]
    first = _run(tmp_path, capsys, *sampled)["results"][0]
    # make some problems correct: the answer is the text of one of their own samples
    answers = [p["completions"][i % 3]["text"] if i % 2 == 0 else "never" for i, p in enumerate(first["problems"])]
    data.write_text("".join(json.dumps({"question": p, "answer": a}) + "\n" for p, a in zip(prompts, answers)))
    res = _run(tmp_path, capsys, *sampled)["results"][0]
    correct = [_by_hand(p, a) for p, a in zip(res["problems"], answers)]
    assert res["pass_at"]["1"] == pytest.approx(sum(sum(c) / 3 for c in correct) / len(prompts))
    assert res["pass_at"]["3"] == pytest.approx(sum(any(c) for c in correct) / len(prompts))
    assert 0 < res["pass_at"]["1"] < 1  # same seeds, same generations: the even problems are hit
    lengths = [c["num_tokens"] for p in res["problems"] for c in p["completions"]]
    assert res["mean_response_tokens"] == pytest.approx(sum(lengths) / len(lengths))
    assert res["tokens_per_forward"] >= 1.0 and res["wall_seconds"] > 0 and res["block_size"] == 4
    # greedy, two settings: each row's accuracy is its own hand count
    out = _run(tmp_path, capsys, *common, "static_steps=[1,4]", "dynamic_thresholds=[0.5]")
    assert [r["setting"]["name"] for r in out["results"]] == ["static steps=1", "static steps=4",
                                                              "dynamic threshold=0.5"]
    for r in out["results"]:
        hand = [_by_hand(p, a)[0] for p, a in zip(r["problems"], answers)]
        assert r["pass_at"]["1"] == pytest.approx(sum(hand) / len(hand))
    assert 3 < out["results"][0]["tokens_per_forward"] <= 4  # 1 step per block (a prompt tail fills some)
    assert out["results"][1]["tokens_per_forward"] == pytest.approx(1.0)  # one token per forward


def test_eval_errors_name_the_key(server, tmp_path, capsys):
    with pytest.raises(SystemExit):
        eval_main(["num_sample=3"])
    assert "num_sample" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eval_main(["dynamic_thresholds=[1.5]"])
    assert "eval.dynamic_thresholds" in capsys.readouterr().err
    rc = eval_main([f"data={tmp_path}/missing.jsonl", f"servers=[{server.url}]", "start_server=false"])
    assert rc == 2 and "eval.data: no such file" in capsys.readouterr().err  # before anything runs
    rc = eval_main([f"servers=[{server.url}]", "start_server=false", "block_sizes=[8]", "limit=2",
                    f"admin_token={ADMIN_TOKEN}", f"output={tmp_path}/r.json"])  # (not a runs/admin_token left here)
    assert rc == 1 and "block_sizes: asked for block size 8" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_starts_its_own_server_per_block_size(tiny_model_dir, tmp_path, capsys):
    """`dlrl eval` starts `dlrl serve` itself (restarted per block size) on a folder with custom
    code (config.json auto_map + modeling files): the server never asks on stdin whether to run it."""
    from dllm.export import export_pretrained
    from dllm.weights import load_pretrained

    model = load_pretrained(tiny_model_dir)
    folder = export_pretrained(model.hf_named_tensors(), model.config, tmp_path / "custom", source_dir=tiny_model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _run(tmp_path, capsys, f"servers=[http://127.0.0.1:{port}]", "start_server=true", f"model={folder}",
               "block_sizes=[4,8]", "static_steps=[1]", "limit=3", "server.device=cpu")
    assert [(r["setting"]["name"], r["block_size"]) for r in res["results"]] == [
        ("static steps=1 block=4", 4), ("static steps=1 block=8", 8)]
    with pytest.raises(OSError):  # stopped at the end
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert "Do you wish to run the custom code" not in (tmp_path / "server0.log").read_text()
