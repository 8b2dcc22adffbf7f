"""`dlrl <command> --help` and `--check` import neither torch nor DeepSpeed (issue 38: they took ~20 s
on a busy box): each runs in a fresh interpreter that then reports which heavy modules it imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "deepspeed", "transformers", "fastapi")
PROBE = """
import json, sys
from dlrl.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "heavy": [m for m in HEAVY if m in sys.modules]}), file=sys.stderr)
""".replace("HEAVY", repr(HEAVY))


def _probe(*argv: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("command", ["train", "serve", "eval", "align", "versions", "sft", "generate"])
def test_help_imports_no_heavy_module(command):
    got = _probe(command, "--help")
    assert got == {"rc": 0, "heavy": []}, got


@pytest.mark.parametrize("argv", [
    ("train", "--check", "start_server=true"), ("serve", "--check"), ("eval", "--check"),
    ("align", "--check"), ("sft", "--check"), ("generate", "--check", "model=runs/none", "prompt=1+1=")])
def test_check_imports_no_heavy_module(argv, tmp_path):
    port = free_port()
    extra = {"train": [f"servers=[http://127.0.0.1:{port}]", f"output_dir={tmp_path / 'run'}"],
             "serve": [f"server.port={port}"], "eval": [f"servers=[http://127.0.0.1:{port}]"]}.get(argv[0], [])
    got = _probe(*argv, *extra)
    assert got["heavy"] == [], got  # whatever the verdict (rc 0, or 2 naming a problem)
