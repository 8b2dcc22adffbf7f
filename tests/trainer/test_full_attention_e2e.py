"""`dlrl train` against a real `dlrl serve` process of a full-attention folder: a tiny official-layout
LLaDA (exact mode) and Dream (prefix-cache mode) are trained a step, the new weights are pushed in place
under their official names (shm / http), the server's checksum equals the export's, and the export is the
official layout again."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from dllm.embedded.full_folders import build_dream_folder, build_llada_folder
from dllm.full.model import FullAttentionLM
from dllm.weights import load_pretrained
from tests.helpers import (
    ServerProcess,
    admin_get,
    launch_server_process,
    wait_server_ready,
    write_train_config,
)
from weight_sync import weights_digest

TOKEN = "fa-e2e-token"
SERVE = {"llada": ("server.cache_mode=exact",), "dream": ("server.cache_mode=prefix",)}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, ServerProcess]]]:
    root = tmp_path_factory.mktemp("fa-e2e")
    folders = {"llada": str(build_llada_folder(root / "llada")), "dream": str(build_dream_folder(root / "dream"))}
    servers = {family: launch_server_process(folder, TOKEN, root, "server.block_size=4", *SERVE[family])
               for family, folder in folders.items()}
    try:
        wait_server_ready(list(servers.values()))  # the two load side by side
        yield {family: (folders[family], srv) for family, srv in servers.items()}
    finally:
        for srv in servers.values():
            srv.kill(signal.SIGTERM)


@pytest.mark.parametrize("family,overrides", [
    ("llada", ["objective=tracerl", "sync_transport=shm"]),
    ("dream", ["objective=dipo", "kl_coef=0.1", "is_correction=tis", "sync_transport=http"]),
])
def test_one_step_pushes_official_names_in_place(served: dict, tmp_path: Path, family: str,
                                                 overrides: list[str]) -> None:
    from trainer.cli import main

    folder, srv = served[family]
    card = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["family"] == family
    v0 = admin_get(srv.url, "/weights/version", TOKEN)["version"]
    cfg = write_train_config(tmp_path, [srv.url], folder, TOKEN, num_steps=1, block_size=4, max_tokens=6)
    assert main(["--config", str(cfg), *overrides]) == 0
    final = load_pretrained(tmp_path / "run" / "final")
    assert isinstance(final, FullAttentionLM) and final.family == family
    before = dict(load_pretrained(folder).hf_named_tensors())
    assert set(before) == {n for n, _ in final.hf_named_tensors()}  # official names, both ways
    assert any(not torch.equal(p, before[n]) for n, p in final.hf_named_tensors())
    assert json.loads((tmp_path / "run" / "final" / "config.json").read_text())["model_type"] == card_type(family)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert admin_get(srv.url, "/weights/version", TOKEN)["version"] == row["version"] > v0
    assert admin_get(srv.url, "/weights/checksum", TOKEN)["digest"] == weights_digest(final.hf_named_tensors())
    assert row["num_rows"] > 0 and "mismatch_abs_mean" in row
    if family == "llada":
        assert row["mismatch_abs_max"] < 1e-3  # exact mode: the trainer's replay is the sampler's distribution
    else:
        assert "is_weight_mean" in row  # prefix cache: the TIS correction ran on the measured mismatch


def card_type(family: str) -> str:
    return "llada" if family == "llada" else "Dream"
