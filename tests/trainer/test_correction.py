"""Train-serve mismatch corrections (trainer.rl.correction): TIS and MIS weights at token and
sequence level, and the mismatch statistics, on hand-computed cases."""

import math

import pytest
import torch

from trainer.rl.correction import is_weights, mismatch_stats

# two samples over two rows: sample 0 has tokens (0,0), (0,1), (1,0); sample 1 has (1,2)
MASK = torch.tensor([[True, True, False], [True, False, True]])
SAMPLE = torch.tensor([[0, 0, -1], [0, -1, 1]])
LOG_RATIO = torch.tensor([[math.log(3.0), math.log(0.8), 0.0], [math.log(0.25), 0.0, math.log(1.5)]])


def test_token_level_tis_truncates_at_the_cap():
    w, stats = is_weights(LOG_RATIO, MASK, SAMPLE, "tis", "token", cap=2.0)
    assert w[MASK].tolist() == pytest.approx([2.0, 0.8, 0.25, 1.5])
    assert w[~MASK].tolist() == [0.0, 0.0]
    assert stats["is_truncated_frac"] == pytest.approx(0.25) and stats["is_dropped_frac"] == 0


def test_token_level_mis_drops_outside_the_band():
    w, stats = is_weights(LOG_RATIO, MASK, SAMPLE, "mis", "token", cap=2.0)
    assert w[MASK].tolist() == pytest.approx([0.0, 0.8, 0.0, 1.5])  # 3 > 2 and 0.25 < 1/2 are dropped
    assert stats["is_dropped_frac"] == pytest.approx(0.5)


def test_sequence_level_uses_the_product_over_the_sample():
    rho0 = 3.0 * 0.8 * 0.25  # sample 0: 0.6
    w, _ = is_weights(LOG_RATIO, MASK, SAMPLE, "tis", "sequence", cap=2.0)
    assert w[MASK].tolist() == pytest.approx([rho0, rho0, rho0, 1.5])
    w, _ = is_weights(LOG_RATIO, MASK, SAMPLE, "mis", "sequence", cap=1.4)
    assert w[MASK].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0])  # 0.6 < 1/1.4, 1.5 > 1.4
    w, _ = is_weights(LOG_RATIO, MASK, SAMPLE, "none", "sequence", cap=2.0)
    assert w[MASK].tolist() == [1.0] * 4


def test_mismatch_stats_and_bad_options():
    behaviour = torch.zeros(2, 3)
    stats = mismatch_stats(LOG_RATIO, behaviour, MASK)
    assert stats["mismatch_abs_max"] == pytest.approx(math.log(4.0))
    assert stats["mismatch_abs_mean"] == pytest.approx(sum(abs(x) for x in LOG_RATIO[MASK].tolist()) / 4)
    assert mismatch_stats(LOG_RATIO, behaviour, torch.zeros(2, 3, dtype=torch.bool)) == {}
    with pytest.raises(ValueError, match="is_correction"):
        is_weights(LOG_RATIO, MASK, SAMPLE, "clip", "token", 2.0)
    with pytest.raises(ValueError, match="is_cap"):
        is_weights(LOG_RATIO, MASK, SAMPLE, "tis", "token", 0.5)


def test_rollout_requests_carry_the_stop_settings():
    from rollout_client.protocol.native import GenerateRequest
    from trainer.config import TrainConfig
    from trainer.rl.rollouts import sampling_kwargs

    kw = sampling_kwargs(TrainConfig(stop=["<|im_end|>", "\n\n"], stop_token_ids=[151645]))
    assert kw["stop"] == ["<|im_end|>", "\n\n"] and kw["stop_token_ids"] == [151645]
    GenerateRequest.model_validate({"prompt_ids": [1, 2], **kw})  # the server's schema accepts them
    assert "stop" not in sampling_kwargs(TrainConfig())


@pytest.mark.parametrize("argv,code", [
    (["train", "--check-config", "nproc=2", "objective=dipo"], 0),
    (["serve", "--check-config", "server.max_batch=4"], 0),
    (["eval", "--check-config", "num_samples=2"], 0),
    (["sft", "--check-config", "steps=5"], 0),
    (["train", "--check-config", "no_such_key=1"], 2),
    (["serve", "--check-config", "server.port=99999"], 2),
])
def test_check_mode_parses_command_and_config_only(argv, code, capsys):
    """`dlrl <cmd> --check-config`: what deploy manifests are validated with (exit 0, or 2 naming the
    error); `--check` also checks files, imports, ports and tokens (tests/dlrl/test_fail_early.py)."""
    from dlrl.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == code
    out = capsys.readouterr()
    if code == 0:
        assert f"dlrl {argv[0]} --check" in out.out and ": ok" in out.out  # a summary (JSON with --json)
    else:
        assert "error" in out.err
