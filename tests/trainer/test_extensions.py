"""DeepSpeed's JIT op cache (issue 38, friction 2): `dlrl train` defaults TORCH_EXTENSIONS_DIR to one
stable folder, says once, before the build, what it builds and where; later runs print nothing
(DeepSpeed's "built successfully" included)."""

from __future__ import annotations

import os
import sys

from trainer.extensions import CPU_OP, announced_build, ensure_extensions_dir


def test_default_folder_is_stable_and_kept_when_set(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)  # no virtual environment: the user's cache
    assert ensure_extensions_dir() == tmp_path / "cache" / "dlrl" / "torch_extensions"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))  # a virtual environment: its own folder
    assert ensure_extensions_dir() == tmp_path / "venv" / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert ensure_extensions_dir() == tmp_path / "mine"


def test_one_line_before_the_first_build_and_nothing_after(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    with announced_build(cpu=True):
        print(f"DeepSpeed {CPU_OP} built successfully")  # what deepspeed.comm prints on every run
        print("other output")
        (tmp_path / CPU_OP).mkdir()
        (tmp_path / CPU_OP / f"{CPU_OP}.so").write_bytes(b"")  # the build's product
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and f"building DeepSpeed's CPU communication op ({CPU_OP}) once" in err
    assert str(tmp_path) in err and out == "other output\n"
    with announced_build(cpu=True):  # a later run: cached
        print(f"DeepSpeed {CPU_OP} built successfully")
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("LOCAL_RANK", "1")
    (tmp_path / CPU_OP / f"{CPU_OP}.so").unlink()
    with announced_build(cpu=True):  # other local ranks wait for the same build quietly
        pass
    assert capsys.readouterr() == ("", "")


DS_IMPORT_PROBE = """
import importlib.util, json, sys
from trainer.infra.ds_import import import_deepspeed
ds = import_deepspeed()
from deepspeed.autotuning import autotuner
out = {"mlflow_during": "mlflow" in sys.modules, "has_mlflow": autotuner.has_mlflow,
       "same": import_deepspeed() is ds, "installed": importlib.util.find_spec("mlflow") is not None}
if out["installed"]:
    import mlflow  # the tracker's import afterwards is untouched
    out["after"] = mlflow.__name__
print(json.dumps(out))
"""


def test_deepspeed_is_imported_without_the_autotuners_mlflow():
    """trainer.infra.ds_import: a fresh process imports DeepSpeed without mlflow (its autotuner's, ~2.7 s of
    CPU), and mlflow still imports afterwards for train.report_to."""
    import json
    import os
    import subprocess

    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", DS_IMPORT_PROBE], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["mlflow_during"] is False and out["has_mlflow"] is False and out["same"] is True
    assert out.get("after", "mlflow") == "mlflow"


def test_the_environments_own_ninja_builds_whatever_path_says(monkeypatch, tmp_path):
    """ninja 1.11 and 1.13 hash .ninja_log's commands differently: a process that found another ninja on PATH
    rebuilt the op the others had built. After ensure_extensions_dir() every process finds this Python's."""
    import shutil

    own = tmp_path / "venv" / "bin"
    own.mkdir(parents=True)
    (own / "ninja").write_text("#!/bin/sh\necho 1.13.2\n")
    (own / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(own / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    ensure_extensions_dir()
    assert shutil.which("ninja") == str(own / "ninja")
    assert os.environ["PATH"] == f"{own}:/usr/bin:/bin"
    ensure_extensions_dir()  # once: not prepended again
    assert os.environ["PATH"] == f"{own}:/usr/bin:/bin"

