"""`dlrl align` end to end on the tiny LLaDA default (the architecture and tokenizer of configs/tiny_llada.yaml,
random weights and a reward with variance on them, tests.helpers.parity_reward: the claim is the mechanics for a
full-attention model, not a learning curve -- the SDAR run in test_align_e2e.py measures that): all real
processes on loopback, one rollout server and two serving replicas running the full-attention runner, simulated
users with exact-match feedback, the controller training on rollouts and their recorded traces and promoting a
candidate through the gate and the canary.

Checked: the replicas record full-attention traces (blocks from the prompt's end, exact cache mode) and users'
feedback lands in the store; `dlrl align` trains on those records (TIS off-policy replay of LLaDA rows) and
promotes a candidate whose weights (checksum) reach every replica; users see 0 errors; SIGTERM exits 0.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from examples.align.local import LocalAlign
from store import open_store
from tests.helpers import admin_get, free_port, wait_until
from trainer.align.registry import NO_PRUNE

pytestmark = pytest.mark.slow


def _config(tmp: Path) -> Path:
    import yaml

    cfg = yaml.safe_load(Path("configs/align.yaml").read_text())
    cfg["model"] = yaml.safe_load(Path("configs/tiny_llada.yaml").read_text())["model"]  # family: llada
    cfg["server"].update({"device": "cpu", "default_max_tokens": 4, "max_batch": 16})
    cfg["train"].update({"tensorboard": False, "device": "cpu", "prompts_per_step": 4, "group_size": 4,
                         "max_tokens": 4, "lr": 1e-4,  # a reward with variance on a random model: it trains
                         "reward": "tests.helpers:parity_reward"})
    cfg["align"].update({"console_port": 0, "eval_size": 16, "kl_prompts": 8, "promote_every": 2,
                         "canary_window_s": 1, "canary_min_requests": 2, "rollback_on_latency_ratio": 10,
                         "prompt_source": "task", "feedback_ratio": 0.5, "reconcile_every_s": 1,
                         # a random model's answers: the accuracy and answer monitors are opened (tested
                         # elsewhere); the KL budget (by full-attention trace replay) is the gate's check here
                         "tolerance": 1.0, "max_empty_frac": 1.0, "max_degenerate_frac": 1.0,
                         "max_length_ratio": 100.0, "max_stop_rate_drop": 1.0})
    cfg["users"].update({"num_users": 2, "think_time_s": 0.2, "feedback_delay_s": 0.2, "max_tokens": 4})
    path = tmp / "align_llada.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _llada_default(tmp: Path) -> str:
    """A random-weight folder of the tiny LLaDA default's architecture, in LLaDA's official layout."""
    import yaml

    from dllm.embedded.full_folders import build_full_folder

    arch = yaml.safe_load(Path("configs/tiny_llada.yaml").read_text())["model"]
    fields = {k: v for k, v in arch.items() if k not in ("family", "head_dim")}
    return str(build_full_folder(tmp / "tiny-llada", "llada", init_std=0.05, **fields))


def test_align_end_to_end_on_the_tiny_llada_default(tmp_path: Path) -> None:
    model, db, metrics_port = _llada_default(tmp_path), tmp_path / "feedback.db", free_port()
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    overrides = [f"rollout_servers=[{urls[0]}]", f"serving_replicas=[{urls[1]},{urls[2]}]", f"store={db}",
                 f"output_dir={tmp_path / 'align'}", f"train.model={model}", "max_steps=0",
                 f"metrics_port={metrics_port}"]
    stack = LocalAlign(str(_config(tmp_path)), overrides)
    log = lambda: (stack.logs / "align.log").read_text()[-4000:]  # noqa: E731

    def promoted() -> list[dict]:
        with open_store(db, **NO_PRUNE) as st:
            return [e for e in st.events() if e["kind"] == "promoted" and not e["detail"].get("initial")]

    try:
        stack.start_servers()
        stack.start_users()
        align = stack.start_align()
        wait_until(lambda: promoted() or align.poll() is not None, 600, "a promoted candidate")
        assert align.poll() is None, log()
        first = promoted()[0]
        wait_until(lambda: all(admin_get(u, "/weights/version", stack.admin_token)["version"] >= first["version"]
                               for u in urls[1:]), 120, "every replica on the promoted version")
        assert stack.stop("align", signal.SIGTERM, grace_s=300) == 0, log()
        assert stack.stop("users") == 0
        users = stack.users_stats()
        digests = {admin_get(u, "/weights/checksum", stack.admin_token)["digest"] for u in urls[1:]}
    finally:
        stack.stop_all()
    with open_store(db, **NO_PRUNE) as st:
        versions, serving = {v["version"]: v for v in st.versions()}, st.serving_version()
        traces = [lab.record.trace for lab in st.labeled(limit=1000)]
    assert len(digests) == 1 and (serving == first["version"] or serving > first["version"])
    if serving == first["version"]:
        assert digests == {first["detail"]["digest"]}  # the candidate's weights, on every replica
    assert versions[first["version"]]["eval"]["gate_passed"] is True
    assert 0 <= versions[first["version"]]["eval"]["kl"] <= 0.5  # KL(candidate || serving) by LLaDA trace replay
    assert sum(v["data"].get("feedback", 0) for v in versions.values()) > 0  # users' records were trained on
    assert traces and all(t["cache_mode"] == "exact" and t["block_origin"] == t["prompt_len"] and
                          t["schedule"] == "llada" for t in traces)  # full-attention traces, blocks from the prompt's end
    assert users["requests"] > 0 and users["errors"] == 0 and users["feedback_errors"] == 0, users
