"""`dlrl serve` as it runs by default (issue 46): the engine core in its own process, HTTP in API processes.

    .venv/bin/python -m pytest -q tests/server/test_server_split.py

Real `dlrl serve` processes on loopback, real signals (SIGKILL, SIGTERM): /health reports both
processes and /metrics both processes' families; kill -9 of the engine core (requests in flight get a
503 naming it, the server exits non-zero, nothing is left running); kill -9 of one of two API
processes (the engine core aborts its requests and keeps serving the other, which answers; the dead
one is started again); SIGTERM during a weight push (in-flight generations finish, the push gets a
clear error or completes, exit 0). "Nothing left": every process of the server's tree gone, its
channel folder removed, no shared-memory segment of ours in /dev/shm.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil

from tests.helpers import wait_until

TOKEN = "split-admin-token"
LONG = {"prompt": "1+1=", "max_tokens": 64, "ignore_eos": True, "strategy": "static", "steps": 4}  # 64 forwards
SHORT = {"prompt": "1+1=", "max_tokens": 8}


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def gone(procs: list[psutil.Process]) -> list[str]:
    """The processes of `procs` still running (zombies count as gone: their parent reaps them)."""
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
        except psutil.NoSuchProcess:
            pass
    return left


def run_dir(procs: list[psutil.Process]) -> Path:
    """The server's channel folder (from its engine core's --address ipc:///tmp/dlrl-serve-XXXX/core.sock)."""
    for p in procs:
        cmd = p.cmdline()
        if "core" in cmd and "--address" in cmd:
            return Path(cmd[cmd.index("--address") + 1].removeprefix("ipc://")).parent
    raise AssertionError("no engine core in the server's process tree")


def segments(procs: list[psutil.Process]) -> set[str]:
    """Shared-memory segments of weight sync made by a process of `procs` or this test (dlrl_ws_<tag>_<pid>_*)."""
    pids = {str(p.pid) for p in procs} | {str(os.getpid())}
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("dlrl_ws_*") if p.name.split("_")[-2] in pids} if shm.is_dir() else set()


def left_behind(procs: list[psutil.Process], folder: Path) -> list[str]:
    """What a stopped server left: processes, its channel folder, shared-memory segments."""
    return gone(procs) + ([str(folder)] if folder.exists() else []) + sorted(segments(procs))


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def pids(url: str) -> dict[str, int]:
    return {p["role"]: p["pid"] for p in health(url)["processes"]}


def post_async(url: str, body: dict, out: list, stream: bool = False) -> threading.Thread:
    """POST in a thread; `out` gets (status, json or the SSE events) or ("error", text)."""
    def run() -> None:
        try:
            if stream:
                with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                    out.append((r.status_code, [ln for ln in r.iter_lines() if ln.startswith("data: ")]))
            else:
                r = httpx.post(url + "/generate", json=body, timeout=120)
                out.append((r.status_code, r.json()))
        except httpx.HTTPError as e:
            out.append(("error", f"{type(e).__name__}: {e}"))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_both_processes_serve_report_and_stop_on_sigterm_mid_push(serve_process, tiny_model_dir):
    """/health and /metrics report both processes; then SIGTERM comes half-way through a weight push's data while a
    generation runs: the generation finishes (drained), the push is applied in the drain window or fails with a
    clear error, the server exits 0 and nothing of it is left."""
    from dllm.weights import load_pretrained
    from weight_sync import WeightSender, WeightSyncError

    srv = serve_process("server.max_batch=2", "server.shutdown_timeout=30", env={"DLRL_ADMIN_TOKEN": TOKEN})
    procs = tree(srv.proc.pid)
    folder = run_dir(procs)
    roles = {p["role"]: p for p in health(srv.url)["processes"]}
    assert roles["engine_core"]["mode"] == "process" and roles["engine_core"]["alive"]
    assert roles["api"]["pid"] != roles["engine_core"]["pid"] != srv.proc.pid
    assert {p.pid for p in procs} >= {srv.proc.pid, roles["api"]["pid"], roles["engine_core"]["pid"]}
    r = httpx.post(srv.url + "/generate", json={**SHORT, "n": 2, "seed": 3}, timeout=60)
    assert r.status_code == 200 and len(r.json()["samples"]) == 2
    events: list = []
    post_async(srv.url, {**SHORT, "seed": 3}, events, stream=True).join(60)
    assert events[0][0] == 200 and events[0][1][-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[0][1][:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == r.json()["samples"][0]["text"]
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text.splitlines()
    steps = [ln for ln in metrics if ln.startswith("dlrl_step_seconds_count")]
    assert steps and float(steps[0].split()[-1]) > 0, "the engine core's families"
    assert any(ln.startswith('dlrl_requests_total{endpoint="/generate"') and 'status="200"' in ln
               and float(ln.split()[-1]) == 1 for ln in metrics), "the API process's families"
    assert len([ln for ln in metrics if ln.startswith("# TYPE dlrl_step_seconds ")]) == 1
    unseeded = httpx.post(srv.url + "/v1/completions", json={"prompt": "1+1=", "max_tokens": 4, "n": 2}, timeout=60)
    scored = httpx.post(srv.url + "/v1/completions", json={"prompt": "1+1=2", "max_tokens": 0, "echo": True,
                                                          "logprobs": 1}, timeout=60)
    assert unseeded.status_code == scored.status_code == 200, (unseeded.text, scored.text)
    # only the engine core holds torch: the supervisor and the API process never import it (each starts in a
    # fraction of the time and memory), also after generations, unseeded samples and prompt log-likelihoods
    maps = {role: Path(f"/proc/{pid}/maps").read_text() for role, pid in
            (("supervisor", srv.proc.pid), ("api", roles["api"]["pid"]), ("core", roles["engine_core"]["pid"]))}
    assert {role: "libtorch" in text for role, text in maps.items()} == {"supervisor": False, "api": False, "core": True}

    named = [(k, v.detach() + 0.001) for k, v in load_pretrained(tiny_model_dir).hf_named_tensors()]
    gen: list = []
    generation = post_async(srv.url, LONG, gen)
    wait_until(lambda: health(srv.url)["num_running"] == 1, 60, "a request decoding")
    outcome: list = []

    def source():  # SIGTERM comes half-way through the push's data
        for i, item in enumerate(named):
            if i == len(named) // 2:
                srv.proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)
            yield item

    def push() -> None:
        try:
            with WeightSender([srv.url], transport="http", token=TOKEN, bucket_bytes=1 << 14, timeout=60) as sender:
                outcome.append(("ok", sender.push(source(), version=1)))
        except (WeightSyncError, httpx.HTTPError) as e:
            outcome.append(("error", f"{type(e).__name__}: {e}"))

    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    pusher.join(120)
    generation.join(120)
    assert gen and gen[0][0] == 200, gen  # the generation in flight was drained, not cut
    assert len(gen[0][1]["samples"][0]["completion_ids"]) == 64
    assert outcome and (outcome[0][0] == "ok" or outcome[0][1]), outcome  # applied in the drain window, or a clear error
    assert srv.proc.wait(90) == 0, srv.log()[-3000:]
    assert not left_behind(procs, folder)


def test_kill_9_of_the_engine_core(serve_process, tmp_path):
    store = tmp_path / "fb.db"
    srv = serve_process("server.max_batch=2", "server.record=all", f"server.store={store}")
    procs = tree(srv.proc.pid)
    folder = run_dir(procs)
    core = pids(srv.url)["engine_core"]
    done = httpx.post(srv.url + "/generate", json=SHORT, timeout=60).json()["samples"][0]  # acknowledged before
    plain, streamed = [], []
    threads = [post_async(srv.url, LONG, plain), post_async(srv.url, LONG, streamed, stream=True)]
    wait_until(lambda: health(srv.url)["num_running"] == 2, 60, "both requests decoding")
    psutil.Process(core).send_signal(signal.SIGKILL)
    for t in threads:
        t.join(60)
    status, body = plain[0]
    assert status == 503 and "engine core" in body["error"]["message"], plain  # the reason, not a hang
    status, events = streamed[0]
    assert status == 200 and any('"code": 503' in e and "engine core" in e for e in events), events
    code = srv.proc.wait(60)
    assert code != 0, "the server exits non-zero when its engine core died"
    assert not left_behind(procs, folder), left_behind(procs, folder)
    assert "exited with signal SIGKILL" in srv.log()
    from store import open_store

    record = open_store(str(store)).get_record(done["record_id"])  # what was acknowledged is kept
    assert record is not None and record.completion_ids == done["completion_ids"]


def test_kill_9_of_an_api_process_the_core_serves_the_other(serve_process):
    srv = serve_process("server.api_processes=2", "server.max_batch=4")
    procs = tree(srv.proc.pid)
    apis = {p.pid for p in procs if "api" in p.cmdline()}
    assert len(apis) == 2
    results: list = []
    longer = {**LONG, "max_tokens": 256}  # ~1 s of decoding on an idle box: a window wide enough to see them
    port = int(srv.url.rsplit(":", 1)[1])

    def held() -> dict[int, int]:
        """Open client connections each API process accepted (the kernel picks the process per connection)."""
        return {pid: sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
                         for c in psutil.Process(pid).net_connections("tcp")) for pid in apis}

    threads: list[threading.Thread] = []
    while len(threads) < 12 and (len(threads) < 6 or min(held().values()) == 0):  # on both processes, if it may
        threads += [post_async(srv.url, longer, results) for _ in range(2)]
        time.sleep(0.05)
    counts = held()
    victim = max(counts, key=lambda pid: counts[pid])  # the one holding requests (the kernel may give one all)
    assert counts[victim] > 0, counts
    survivor_held = sum(n for pid, n in counts.items() if pid != victim)
    psutil.Process(victim).send_signal(signal.SIGKILL)
    for t in threads:
        t.join(120)
    ok = [r for r in results if r[0] == 200]
    failed = [r for r in results if r[0] != 200]
    assert all(r[0] == "error" for r in failed), results  # cut connections, never a wrong 200
    assert ok or not survivor_held, (counts, results)  # the other process's requests finished
    assert all(len(r[1]["samples"][0]["completion_ids"]) == 256 for r in ok)
    def freed() -> bool:
        try:  # a connection the killed process had just accepted is reset: ask again
            return health(srv.url)["num_running"] == 0
        except httpx.TransportError:
            return False

    wait_until(freed, 60, "the dead process's sequences freed")
    for _ in range(4):  # whichever process accepts, it answers
        assert httpx.post(srv.url + "/generate", json=SHORT, timeout=60).status_code == 200
    wait_until(lambda: len({p.pid for p in tree(srv.proc.pid) if "api" in p.cmdline()} - {victim}) == 2, 120,
               "the dead API process started again")
    assert "API process" in srv.log() and "starting it again" in srv.log()
    procs, folder = tree(srv.proc.pid), run_dir(tree(srv.proc.pid))
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    assert not left_behind(procs, folder)
