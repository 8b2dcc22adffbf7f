"""Prompt data the ways users keep it (issue 24): JSONL, JSON, Parquet, CSV, a `datasets`
save_to_disk folder and a hub dataset id read offline from a hub cache the test writes, with field
mapping, chat `messages`, splits and limits. Every file is written here."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.data.prompts import load_prompts
from trainer.data.sources import source_problem
from trainer.evaluation.evaluate import load_eval_examples

ROWS = [{"problem": f"What is {i}+{i}?", "solution": f"It is $\\boxed{{{2 * i}}}$.", "level": i} for i in range(5)]


def _write_all(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    (tmp_path / "splits.json").write_text(json.dumps({"train": ROWS, "test": ROWS[:2]}))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    with open(tmp_path / "d.csv", "w") as f:
        f.write("problem,solution,level\n" + "".join(f'"{r["problem"]}","{r["solution"]}",{r["level"]}\n'
                                                         for r in ROWS))
    return ["d.jsonl", "list.json", "splits.json", "d.parquet", "d.csv"]


def test_every_file_format_reads_the_same_examples(tmp_path):
    for name in _write_all(tmp_path):
        ex = load_eval_examples(tmp_path / name)
        assert [e["answer"] for e in ex] == ["0", "2", "4", "6", "8"], name  # MATH-style \boxed{} answers
        assert ex[3]["prompt"] == "What is 3+3?" and str(ex[3]["level"]) == "3"
        assert len(load_eval_examples(tmp_path / name, limit=2)) == 2
    assert len(load_eval_examples(tmp_path / "splits.json", split="test")) == 2
    assert source_problem(str(tmp_path / "nope.parquet")).startswith("no such file")
    (tmp_path / "x.txt").write_text("hi")
    assert "unknown file type '.txt'" in source_problem(str(tmp_path / "x.txt"))


def test_field_mapping_and_chat_messages(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "1+1?"},
                                          {"role": "assistant", "content": "2"}]}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "2+2?"}], "answer": "#### 4"}) + "\n")

    class Tok:
        def apply_chat_template(self, turns, tokenize, add_generation_prompt):
            return "".join(f"<{t['role']}>{t['content']}" for t in turns) + "<assistant>"

    ex = load_eval_examples(f, tokenizer=Tok())
    assert ex[1]["prompt"] == "<user>2+2?<assistant>" and ex[1]["answer"] == "4"
    ex = load_prompts(f, tokenizer=Tok(), require_answer=False)
    assert ex[0]["prompt"] == "<system>be brief<user>1+1?<assistant>" and ex[0]["answer"] == "2"
    assert ex[0]["question_text"] == "1+1?"
    g = tmp_path / "mapped.csv"
    g.write_text("q,gt\nhello,world\n")
    (only,) = load_prompts(g, prompt_field="q", answer_field="gt")
    assert only["prompt"] == "hello" and only["answer"] == "world"
    with pytest.raises(ValueError, match=r"mapped.csv: row 1: missing prompt field 'text'"):
        load_prompts(g, prompt_field="text")


def test_datasets_folder_and_offline_hub_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(tmp_path / "dict"))
    assert [e["answer"] for e in load_eval_examples(tmp_path / "one", limit=3)] == ["0", "2", "4"]
    assert len(load_eval_examples(tmp_path / "dict", split="test")) == 1
    with pytest.raises(ValueError, match=r"no split 'validation' \(splits: train, test\)"):
        load_eval_examples(tmp_path / "dict", split="validation")
    # a hub dataset id, offline: the hub cache layout written by hand (no network)
    snap = tmp_path / "hf" / "hub" / "datasets--acme--math-mini" / "snapshots" / ("a" * 40)
    (snap / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS), snap / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:2]), snap / "data" / "test-00000-of-00001.parquet")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("a" * 40)
    code = ("from trainer.evaluation.evaluate import load_eval_examples as L; import json; "
            "print(json.dumps([[e['answer'] for e in L('acme/math-mini', split=s)] for s in ('train', 'test')]))")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [["0", "2", "4", "6", "8"], ["0", "2"]]
    code = "from trainer.data.prompts import load_prompts; load_prompts('acme/not-cached')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "hub dataset 'acme/not-cached'" in out.stderr
