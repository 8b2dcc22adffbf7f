"""KV cache sized from memory: the plan on SDAR-1.7B shapes, the startup log, and a clear startup error."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dllm.config import SDARConfig
from dlrl_config import ConfigError
from server.config import ServerConfig, load_server_config
from server.engine.backends.native import GIB, NativeBackend, available_memory, plan_kv_cache

SDAR_1_7B = dict(model_type="sdar", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 block_size=4, mask_token_id=151669, eos_token_id=151643, max_position_embeddings=32768)


def test_plan_on_sdar_1_7b_shapes():
    cfg = SDARConfig.from_dict(SDAR_1_7B)
    # before: 16 slots x 8192 tokens preallocated = 14 GiB of bf16 K/V, whatever the machine had
    plan = plan_kv_cache(cfg, torch.bfloat16, max_batch=16, max_len=8192, memory=0, fraction=0.5,
                         available=8 * (1 << 30))
    assert plan.bytes_per_token == 2 * 28 * 8 * 128 * 2  # 112 KiB: keys + values, every layer
    assert plan.num_bytes <= 4 * (1 << 30) and plan.num_full_sequences == 4  # 4 GiB / 0.875 GiB
    assert "4 sequences of max_model_len=8192" in plan.describe()
    ample = plan_kv_cache(cfg, torch.bfloat16, max_batch=16, max_len=8192, memory=100 * (1 << 30), fraction=0.5,
                          available=0)
    assert ample.num_pages == 16 * 8192 // 4 and "capped at max_batch=16" in ample.describe()
    with pytest.raises(ConfigError, match="server.kv_cache_memory or server.kv_cache_fraction.*max_model_len"):
        plan_kv_cache(cfg, torch.bfloat16, max_batch=16, max_len=8192, memory=512 << 20, fraction=0.5, available=0)


def test_memory_option_parsing():
    def memory(value: str) -> int:
        return load_server_config(None, [f"server.kv_cache_memory={value}"]).kv_cache_memory

    assert ServerConfig().kv_cache_memory == 0 and memory("0") == 0  # 0: kv_cache_fraction decides
    assert memory("4GiB") == 4 << 30 and memory("512MB") == 512_000_000 and memory("1048576") == 1 << 20
    for bad in ("lots", "-1GiB", "-5", "''"):
        with pytest.raises(ConfigError, match="server.kv_cache_memory"):
            memory(bad)
    for bad in ("1.5", "0", "-0.1", "nan"):
        with pytest.raises(ConfigError, match="server.kv_cache_fraction"):
            load_server_config(None, [f"kv_cache_fraction={bad}"])


def test_cpu_budget_leaves_room_for_kept_weight_versions(monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 10 << 30})())
    cpu = torch.device("cpu")
    assert available_memory(cpu) == 10 << 30 and available_memory(cpu, 4 << 30) == 6 << 30
    assert available_memory(cpu, 12 << 30) == 0


def test_backend_logs_the_plan(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="dlrl.server"):
        backend = NativeBackend.from_pretrained(tiny_model_dir, device="cpu", dtype="float32", max_batch=4,
                                                max_model_len=64, kv_cache_memory=64 * 1024)
    plan = backend.kv_plan
    assert plan.num_bytes <= 64 * 1024 and backend.cache.num_pages == plan.num_pages
    assert any("KV cache" in r.message and "kv_cache_memory" in r.message for r in caplog.records)
    assert backend.cache.num_bytes <= plan.num_bytes + plan.page_tokens * plan.bytes_per_token
    assert plan.num_bytes / GIB < 1


@pytest.mark.slow
def test_serve_refuses_a_cache_too_small_for_one_sequence(tiny_model_dir):
    cmd = [sys.executable, "-m", "server.cli", "--model", tiny_model_dir, "server.max_model_len=256",
           "server.kv_cache_memory=8KiB"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "one sequence of max_model_len=256" in proc.stderr and "server.kv_cache_memory" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cuda_graphs_need_a_cuda_device():
    from dllm.model import SDARForCausalLM
    from tests.helpers import tiny_config

    with pytest.raises(ConfigError, match="server.cuda_graphs"):
        NativeBackend(SDARForCausalLM(tiny_config()).to(torch.device("cpu")), None, max_batch=2,
                      kv_cache_memory=1 << 20, cuda_graphs=True)
