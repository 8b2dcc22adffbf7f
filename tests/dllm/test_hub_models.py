"""Hugging Face repo ids wherever a model folder is accepted (issue 24): resolved through
huggingface_hub from an offline hub cache the test writes itself (models--org--name/snapshots/
<rev>/..., refs/main) holding a tiny random SDAR model; HF_HUB_OFFLINE=1, no network."""

import shutil
from pathlib import Path

import httpx
import pytest

from tests.helpers import served_process

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_home(tiny_model_dir, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("hf")
    repo = home / "hub" / "models--acme--tiny-sdar"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / REV)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return home


@pytest.fixture
def offline_cache(hub_home, monkeypatch):
    """huggingface_hub reads HF_HOME / HF_HUB_OFFLINE at import: point its constants at the cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_home


def test_a_hub_id_resolves_from_the_offline_cache_and_says_what_it_used(offline_cache, caplog):
    from dllm.hub import ModelNotFound, resolve_model, served_name

    snap = offline_cache / "hub" / "models--acme--tiny-sdar" / "snapshots" / REV
    with caplog.at_level("INFO", logger="dlrl.hub"):
        assert resolve_model("acme/tiny-sdar", "train.model") == snap
    assert f"train.model: acme/tiny-sdar resolved to {snap} (revision {REV})" in caplog.text
    assert "config.json" in caplog.text and "model.safetensors" in caplog.text
    assert resolve_model(f"acme/tiny-sdar@{REV}") == snap
    assert served_name(f"acme/tiny-sdar@{REV}") == "tiny-sdar"
    with pytest.raises(ModelNotFound, match="server.model: 'acme/not-cached' is not a directory, and the Hugging "
                                            "Face cache has no snapshot"):
        resolve_model("acme/not-cached", "server.model")
    with pytest.raises(ModelNotFound, match="'no/such/dir' is not a directory"):
        resolve_model("no/such/dir")


def test_an_offline_commit_revision_under_huggingface_hub_1x(offline_cache, monkeypatch):
    """huggingface_hub 1.x (1.33, transformers 5.17's, seen on a GPU image) raises OfflineModeIsEnabled
    for an offline commit revision before it looks in the cache: resolve_model then reads the cache."""
    import huggingface_hub
    from huggingface_hub.errors import OfflineModeIsEnabled

    from dllm.hub import resolve_model

    real = huggingface_hub.snapshot_download

    def hub_1x(*args, local_files_only=False, **kwargs):
        if not local_files_only:
            raise OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/models/...: offline mode is enabled.")
        return real(*args, local_files_only=True, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_1x)
    snap = offline_cache / "hub" / "models--acme--tiny-sdar" / "snapshots" / REV
    assert resolve_model(f"acme/tiny-sdar@{REV}") == snap


def test_serve_a_hub_id_with_hf_home_and_offline_mode(hub_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub_home))  # the server subprocess reads the real environment
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with served_process("acme/tiny-sdar", "tok", tmp_path) as srv:
        assert httpx.get(srv.url + "/health").json()["model"] == "tiny-sdar"
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny-sdar", "prompt": "1+2=", "max_tokens": 4})
        assert r.status_code == 200, r.text
    assert f"snapshots/{REV} (revision {REV})" in srv.log_path.read_text()
