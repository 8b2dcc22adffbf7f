"""The promotion gate (regression, KL budget, sanity monitors), the canary's judgement and the weight bank."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from dllm.decoding import SamplingParams, generate
from dllm.tokenizer import encode, load_tokenizer
from dllm.weights import load_pretrained
from trainer.align.bank import WeightBank
from trainer.align.config import AlignConfig
from trainer.align.gate import Gate, is_degenerate
from trainer.align.metrics import AlignMetrics
from trainer.align.promote import Canary, Candidate, FeedbackTally, Promoter
from trainer.align.replicas import LiveStats, parse_live
from trainer.config import TrainConfig
from weight_sync import weights_digest

SERVING = {"accuracy": 0.6, "mean_length": 3.0, "stop_rate": 1.0, "empty_frac": 0.0, "degenerate_frac": 0.0}


@pytest.mark.parametrize("text,bad", [("122", False), ("", False), ("aaaa", True), ("1212121212", True),
                                      ("the the the the", True), ("ab ab", False), ("1111", True), ("12 3", False)])
def test_degenerate_answers(text, bad):
    assert is_degenerate(text) is bad


def _gate(**align) -> Gate:
    return Gate(AlignConfig(**align), TrainConfig(), [], None, lambda e: [1], 0, 4, 0)


@pytest.mark.parametrize("change,check", [
    ({"accuracy": 0.5}, "held-out accuracy"), ({"kl": 0.9}, "KL to the serving version"),
    ({"mean_length": 7.0}, "mean length"), ({"mean_length": 1.0}, "mean length"),
    ({"stop_rate": 0.8}, "stop rate"), ({"empty_frac": 0.2}, "empty answers"),
    ({"degenerate_frac": 0.5}, "degenerate answers")])
def test_gate_stops_a_candidate_naming_the_check(change, check):
    gate = _gate(tolerance=0.05, kl_budget=0.5)
    ok = gate.check({**SERVING, "accuracy": 0.58, "kl": 0.1}, SERVING)
    assert ok.passed and not ok.reasons
    bad = gate.check({**SERVING, "kl": 0.1, **change}, SERVING)
    assert not bad.passed and len(bad.reasons) == 1 and bad.reasons[0].startswith(check)


def test_kl_by_trace_replay_is_zero_for_the_same_weights_and_grows_with_distance(tiny_model_dir):
    model = load_pretrained(tiny_model_dir).eval()
    tok = load_tokenizer(tiny_model_dir)
    examples = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((12, 34), (7, 8), (55, 66), (3, 90))]

    def generate_fn(prompts, n, seed=0, **kw):  # what the rollout servers answer: traced samples
        params = SamplingParams(max_tokens=kw["max_tokens"], strategy=kw["strategy"], temperature=1.0, seed=seed)
        return generate(model, [p for p in prompts for _ in range(n)], params)

    gate = Gate(AlignConfig(kl_prompts=4), TrainConfig(max_tokens=8), examples, None,
                lambda e: encode(tok, e["prompt"]), model.config.mask_token_id, 4, 0)
    same = gate.kl(generate_fn, model, copy.deepcopy(model))
    assert same["kl_tokens"] > 0 and same["kl"] == pytest.approx(0.0, abs=1e-6)
    kls = []
    for scale in (0.01, 0.1):
        ref = copy.deepcopy(model)
        with torch.no_grad():
            torch.manual_seed(0)
            for p in ref.parameters():
                p.add_(torch.randn_like(p) * scale)
        kls.append(gate.kl(generate_fn, model, ref)["kl"])
    assert 0 < kls[0] < kls[1]


def _promoter(tally: FeedbackTally, serving: int = 3) -> Promoter:
    cfg = AlignConfig(rollback_on_error_rate=0.01, rollback_on_latency_ratio=2.0, rollback_on_reward_drop=0.1,
                      rollback_min_feedback=5, rollback_z=1.645)
    return Promoter(cfg, None, SimpleNamespace(urls=["a", "b"]), None, AlignMetrics(), tally,
                    serving_version=serving)


def test_canary_judgement_error_rate_latency_and_feedback_reward():
    tally = FeedbackTally()
    for i in range(40):
        tally.add(100.0 + i, 3, 1.0 if i % 2 else 0.0)  # serving version: reward 0.5
    for i in range(10):
        tally.add(100.0 + i, 9, 1.0 if i % 3 else 0.0)  # candidate: 0.6
    p = _promoter(tally)
    canary = Canary(Candidate(9, 9, {}, None), "a", 0.0, 0.0, 100.0)
    good = {"a": LiveStats(40, 0, 4.0, 40), "b": LiveStats(40, 0, 4.0, 40)}
    assert p.judge(canary, good)[0] == []
    slow = {"a": LiveStats(40, 0, 10.0, 40), "b": LiveStats(40, 0, 4.0, 40)}
    assert p.judge(canary, slow)[0][0].startswith("mean latency")
    errors = {"a": LiveStats(40, 2, 4.0, 40), "b": LiveStats(40, 0, 4.0, 40)}
    assert p.judge(canary, errors)[0][0].startswith("error rate")
    for i in range(4):
        tally.add(120.0 + i, 9, 0.0)  # 6/14 liked (0.43): not below 0.5 - 0.1
    assert p.judge(canary, good)[0] == []
    for i in range(26):
        tally.add(130.0 + i, 9, 0.0)  # users dislike the candidate's answers: 6/40
    reasons, detail = p.judge(canary, good)
    assert reasons[0].startswith("feedback reward") and detail["canary_feedback"] == 40


def test_live_stats_from_server_metrics():
    text = ('dlrl_requests_total{endpoint="/v1/completions",status="200"} 30.0\n'
            'dlrl_requests_total{endpoint="/v1/completions",status="503"} 2.0\n'
            'dlrl_requests_total{endpoint="/generate",status="400"} 1.0\n'
            'dlrl_request_latency_seconds_sum{endpoint="/v1/completions"} 3.0\n'
            'dlrl_request_latency_seconds_count{endpoint="/v1/completions"} 30.0\n')
    s = parse_live(text)
    assert (s.requests, s.errors, s.mean_latency) == (33.0, 2.0, 0.1)
    assert (s - LiveStats(3, 0, 0.0, 0)).error_rate == pytest.approx(2 / 30)


def test_weight_bank_keeps_recent_in_memory_all_on_disk(tiny_model_dir, tmp_path):
    model = load_pretrained(tiny_model_dir)
    ref = copy.deepcopy(model)
    bank = WeightBank(tmp_path / "promoted", ref, keep=1)
    w = {n: p.detach().clone() for n, p in model.hf_named_tensors()}
    w2 = {n: t + 1.0 for n, t in w.items()}
    bank.put(1, w)
    bank.put(2, w2)
    assert list(bank.memory) == [2] and bank.path(1).is_file()
    assert bank.digest(1) == weights_digest(w)  # read back from disk, bit for bit
    bank.set_reference(2)
    assert weights_digest(dict(ref.hf_named_tensors())) == weights_digest(w2)
    with pytest.raises(KeyError, match="no saved weights"):
        bank.set_reference(7)


class _Promoter:
    """The promoter's face to the Aligner: busy while a canary is in flight; records starts."""

    def __init__(self):
        self.serving_version, self.canary, self.started = 0, None, []

    busy = property(lambda self: self.canary is not None)

    def reconcile(self):
        pass

    def start(self, cand):
        self.started.append(cand.version)
        self.canary = SimpleNamespace(cand=cand)


def _aligner(tmp_path, monkeypatch, scores: dict):
    """An Aligner with its collaborators stubbed: the rollout servers' scores come from `scores`."""
    from store import open_store
    from trainer.align import controller

    monkeypatch.setattr(controller, "policy_weights", lambda run: {})
    al = object.__new__(controller.Aligner)
    al.cfg = AlignConfig(promote_every=3, tolerance=0.02)
    al.run = SimpleNamespace(version=0)
    al.store = open_store(tmp_path / "reg.db")
    al.store.register_version(0, None, 0, "r", {})
    al.promoter, al.metrics, al.bank = _Promoter(), AlignMetrics(), SimpleNamespace(reference=None)
    al.gate = SimpleNamespace(scores=lambda gen: dict(scores[al.run.version]), kl=lambda *a, **k: {"kl": 0.0},
                              check=_gate(tolerance=0.02, kl_budget=1.0).check)
    al.run.fleet = al.run.learner = SimpleNamespace(generate=None, engine=SimpleNamespace(module=None))
    al.pending, al.last_candidate, al.waiting, al.serving_scores = [], -1, None, dict(SERVING)
    al.counts = {"promotions": 0, "rollbacks": 0, "gate_failed": 0, "reverts": 0}
    al.reverts, al.flipped, al.promotion_paused = [], False, False
    monkeypatch.setattr(al, "revert", lambda: al.reverts.append(al.run.version), raising=False)
    return al


def _to(al, version: int, step: int) -> dict:
    al.run.version = version
    al.store.register_version(version, version - 1, step, "r", {})
    return al.maybe_promote(step)


def test_the_gate_runs_during_a_promotion_and_a_passing_candidate_waits_for_it(tmp_path, monkeypatch):
    scores = {3: {**SERVING, "accuracy": 0.7}, 6: {**SERVING, "accuracy": 0.2}, 7: {**SERVING, "accuracy": 0.75},
              9: {**SERVING, "accuracy": 0.8}, 12: {**SERVING, "accuracy": 0.72}}
    al = _aligner(tmp_path, monkeypatch, scores)
    status = lambda v: next(r["status"] for r in al.store.versions() if r["version"] == v)  # noqa: E731
    assert _to(al, 3, 3)["gate_passed"] == 1 and al.promoter.started == [3]  # idle: the promotion starts
    # a bad policy during version 3's canary: stopped and reverted at once, not after the promotion
    assert _to(al, 6, 6)["gate_passed"] == 0 and status(6) == "gated_out" and al.reverts == [6]
    assert al.waiting is None and al.promoter.started == [3]
    # good ones during the canary wait; the newer replaces the older
    assert _to(al, 7, 9)["gate_passed"] == 1 and al.waiting.version == 7 and status(7) == "candidate"
    assert _to(al, 9, 12)["gate_passed"] == 1 and al.waiting.version == 9
    assert status(7) == "superseded" and al.promoter.started == [3]
    al.start_waiting()  # still busy: nothing
    assert al.promoter.started == [3]
    al.promoter.canary, al.promoter.serving_version = None, 3  # version 3 promoted (72% held out)
    al.serving_scores = {**SERVING, "accuracy": 0.7}
    al.start_waiting()  # 80% >= 70% - 2%: checked again, it starts
    assert al.promoter.started == [3, 9] and al.waiting is None
    # one that passed against the old serving version but not against the one promoted meanwhile
    assert _to(al, 12, 15)["gate_passed"] == 1 and al.waiting.version == 12
    al.promoter.canary, al.promoter.serving_version = None, 9
    al.serving_scores = {**SERVING, "accuracy": 0.8}
    al.start_waiting()
    assert al.promoter.started == [3, 9] and status(12) == "gated_out" and al.reverts == [6]  # no revert
    row = next(r for r in al.store.versions() if r["version"] == 12)
    assert row["eval"]["gate_passed"] is False and row["eval"]["serving_version"] == 9
    assert "held-out accuracy 0.720 < serving 0.800" in row["eval"]["reasons"][0]
    # a revert drops the waiting candidate
    al.promoter.canary = SimpleNamespace(cand=SimpleNamespace(version=99))
    scores[13] = {**SERVING, "accuracy": 0.9}
    scores[14] = {**SERVING, "accuracy": 0.1}
    assert _to(al, 13, 18)["gate_passed"] == 1 and al.waiting.version == 13
    assert _to(al, 14, 21)["gate_passed"] == 0 and al.waiting is None and status(13) == "superseded"
    al.store.close()


def test_paused_promotion_keeps_the_newest_passing_candidate_until_resumed(tmp_path, monkeypatch):
    scores = {3: {**SERVING, "accuracy": 0.7}, 6: {**SERVING, "accuracy": 0.75}}
    al = _aligner(tmp_path, monkeypatch, scores)
    al.pause_promotion(True, by="console")
    assert _to(al, 3, 3)["gate_passed"] == 1 and al.promoter.started == [] and al.waiting.version == 3
    assert _to(al, 6, 6)["gate_passed"] == 1 and al.waiting.version == 6  # the gate still runs; newest kept
    al.start_waiting()
    assert al.promoter.started == [] and al.metrics.registry.get_sample_value("dlrl_align_promotion_paused") == 1
    al.pause_promotion(False, by="console")
    al.start_waiting()
    assert al.promoter.started == [6] and al.waiting is None
    kinds = [e["kind"] for e in al.store.events()]
    assert kinds.count("gate_passed") == 2 and "promotion_paused" in kinds and "promotion_resumed" in kinds


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_gate_replays_full_attention_traces_exactly(family, tmp_path):
    """The gate's KL on LLaDA / Dream: one bidirectional canvas per trace step (dllm.full.replay), so the
    serving policy's replayed log-probabilities are the sampler's own (exact cache mode) and KL is 0."""
    from dllm.embedded.full_folders import build_full_folder
    from trainer.align.gate import build_full_rows, target_logprobs

    model = load_pretrained(build_full_folder(tmp_path / family, family)).eval()
    cfg = model.config
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    samples = []

    def generate_fn(prompts, n, seed=0, **kw):
        params = SamplingParams(max_tokens=kw["max_tokens"], strategy=kw["strategy"], temperature=1.0, seed=seed,
                                ignore_eos=True)
        samples[:] = generate(model, [p for p in prompts for _ in range(n)], params, cache_mode="exact")
        return samples

    gate = Gate(AlignConfig(kl_prompts=3), TrainConfig(max_tokens=8), [{"prompt": "", "answer": ""}] * 3, None,
                lambda e: prompts.pop(0), cfg.mask_token_id, cfg.block_size, cfg.pad_token_id)
    same = gate.kl(generate_fn, model, copy.deepcopy(model))
    assert same["kl_tokens"] > 0 and same["kl"] == pytest.approx(0.0, abs=1e-6)
    for sample in samples:  # the trace's own numbers, token by token (rows are in step order)
        rows = build_full_rows([sample], cfg.mask_token_id, cfg.pad_token_id)
        with torch.no_grad():
            lp = target_logprobs(model, rows, cfg.mask_token_id, 1.0)
        replayed = torch.empty(len(sample.trace.logprobs))
        replayed[rows.token_idx[rows.target]] = lp[rows.target]
        assert (replayed - torch.tensor(sample.trace.logprobs)).abs().max() < 1e-4
