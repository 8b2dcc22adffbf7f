"""Writes examples/lm_eval/addition_heldout.jsonl: held-out problems of the embedded task (configs/tiny.yaml's
`task` section) for the lm-eval task YAMLs next to it, each with three answer choices for the
multiple-choice task: the true sum, the imperfect teacher's carry-free sum (the SFT model's typical mistake;
another wrong answer when the problem needs no carry) and one more near miss, in a seeded order.

    python -m examples.lm_eval.make_data [--num 100] [--config configs/tiny.yaml]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from dllm.embedded.task import ArithmeticTask
from dlrl_config import load_section

OUT = Path(__file__).with_name("addition_heldout.jsonl")


def choices(task: ArithmeticTask, a: int, b: int, rng: random.Random) -> tuple[list[str], int]:
    """Three distinct answers in the task's format and the index of the true one."""
    true = a + b
    wrong = [task.carry_free_sum(a, b), true + 10, true - 10, true + 1, true - 1]
    picked = [true] + [w for i, w in enumerate(wrong) if 0 <= w < 10 ** (task.max_digits + 1)
                       and w != true and w not in wrong[:i]][:2]
    texts = [task.format(a, b, v)["answer"] for v in picked]
    order = list(range(3))
    rng.shuffle(order)
    return [texts[i] for i in order], order.index(0)


def records(task: ArithmeticTask, num: int, seed: int = 0) -> list[dict]:
    rng, seen, out = random.Random(seed), set(), []
    for ex in task.split("heldout", 20 * num):
        if ex["prompt"] in seen:
            continue
        seen.add(ex["prompt"])
        a, b = (int(x) for x in ex["prompt"].rstrip("=").split("+"))
        options, answer = choices(task, a, b, rng)
        out.append({"prompt": ex["prompt"], "answer": ex["answer"], "choices": options, "label": answer,
                    "carry": task.carry_free_sum(a, b) != a + b})
        if len(out) == num:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num", type=int, default=100)
    ap.add_argument("--config", default="configs/tiny.yaml")
    args = ap.parse_args()
    task = load_section(ArithmeticTask, args.config, "task")
    rows = records(task, args.num)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} problems ({sum(r['carry'] for r in rows)} need a carry) -> {OUT}")


if __name__ == "__main__":
    main()
