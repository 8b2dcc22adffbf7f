"""Model correctness: Qwen3 equivalence, KV cache vs dense, training layout vs inference."""

import pytest
import torch

from dllm.config import ConfigValueError, SDARConfig
from dllm.model import KVCache, SDARForCausalLM
from tests.helpers import tiny_config


def test_block_size_1_matches_transformers_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    for tied in (False, True):
        cfg = tiny_config(block_size=1, tie_word_embeddings=tied)
        ours = SDARForCausalLM(cfg).eval()
        qc = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                         rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=tied, attn_implementation="eager")
        ref = Qwen3ForCausalLM(qc).eval()
        ref.load_state_dict(dict(ours.hf_named_tensors()), strict=not tied)
        ids = torch.randint(0, 63, (3, 17))
        with torch.no_grad():
            diff = (ours(ids) - ref(ids).logits).abs().max().item()
        assert diff <= 1e-5, diff
        assert set(dict(ours.hf_named_tensors())) >= {n for n in ref.state_dict() if n != "lm_head.weight" or not tied}


def test_kv_cache_equals_dense_block_causal_forward():
    torch.manual_seed(1)
    m = SDARForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 63, (2, 16))
    with torch.no_grad():
        dense = m(ids)  # [2, 16, V]
        cache = KVCache(m.config, num_pages=16, device="cpu", dtype=torch.float32)
        table = cache.fixed_table(4, 16)[[3, 1]]  # rows 3 and 1 of the fixed layout
        got = [m(ids[:, :8], torch.arange(8).expand(2, 8), cache=cache, page_table=table)]
        got += [m(ids[:, b:b + 4], torch.arange(b, b + 4).expand(2, 4), cache=cache, page_table=table)
                for b in (8, 12)]  # block by block
    assert (torch.cat(got, dim=1) - dense).abs().max().item() < 1e-5


def test_block_causality():
    """Changing a later block never changes logits of an earlier block; same block does."""
    torch.manual_seed(2)
    m = SDARForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 63, (1, 12))
    ids2 = ids.clone()
    ids2[0, 9] = (ids[0, 9] + 1) % 63
    with torch.no_grad():
        a, b = m(ids), m(ids2)
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-6)
    assert not torch.allclose(a[0, 8:], b[0, 8:], atol=1e-4)


def test_training_layout_noisy_copy_equals_inference_on_masked_state():
    torch.manual_seed(3)
    cfg = tiny_config()
    m = SDARForCausalLM(cfg).eval()
    clean = torch.randint(0, 63, (2, 16))
    noisy = clean.clone()
    masked = torch.rand(2, 16) < 0.5
    masked[:, :4] = False
    noisy[masked] = cfg.mask_token_id
    pos = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        train_logits = m.forward_train(noisy, clean, pos, torch.ones(2, 16, dtype=torch.bool))
        for b in range(4):  # inference: clean prefix + this block in its noisy state
            s, e = 4 * b, 4 * b + 4
            x = torch.cat([clean[:, :s], noisy[:, s:e]], dim=1)
            inf = m(x, pos[:, :e])[:, s:e]
            assert (inf - train_logits[:, s:e]).abs().max().item() < 1e-5


def test_padding_in_training_layout_is_ignored():
    torch.manual_seed(4)
    m = SDARForCausalLM(tiny_config()).eval()
    clean = torch.randint(0, 63, (1, 8))
    pos = torch.arange(8)[None]
    valid = torch.tensor([[True] * 6 + [False] * 2])
    other = clean.clone()
    other[0, 6:] = 5
    with torch.no_grad():
        a = m.forward_train(clean, clean, pos, valid)
        b = m.forward_train(other, other, pos, valid)
    assert torch.allclose(a[0, :6], b[0, :6], atol=1e-6)


def test_bad_config_names_the_field():
    with pytest.raises(ConfigValueError, match="model_type"):
        SDARConfig.from_dict({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2})
    with pytest.raises(ConfigValueError, match="num_key_value_heads"):
        SDARForCausalLM(tiny_config(num_key_value_heads=3))
    with pytest.raises(ConfigValueError, match="block_size"):
        tiny_config(block_size=3, max_position_embeddings=512).validate()
    with pytest.raises(ConfigValueError, match="mask_token_id"):
        tiny_config(mask_token_id=64).validate()


def test_compiled_layers_train_like_eager():
    """compile_layers (train.compile_layers): one graph per layer without breaks (fullgraph),
    same loss and gradients as eager, through forward and backward (aot_eager: no C++ build)."""
    torch.manual_seed(0)
    eager = SDARForCausalLM(tiny_config()).train()
    compiled = SDARForCausalLM(tiny_config()).train()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_layers(backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 63, (2, 8))
    pos, valid = torch.arange(8).expand(2, 8), torch.ones(2, 8, dtype=torch.bool)
    noisy = ids.masked_fill(torch.rand(2, 8) < 0.5, 63)
    losses = []
    for m in (eager, compiled):
        loss = m.forward_train(noisy, ids, pos, valid).float().logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], atol=1e-5)
    for (n, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n
