"""Real-shape smoke run: `dlrl serve`, `dlrl eval` and `dlrl train` on a random SDAR model with
the shapes of SDAR-1.7B-Chat (fewer layers), the stand-in Qwen tokenizer and a math JSONL.

    .venv/bin/python benchmarks/real_shape.py                       # 1 layer, 2 train steps
    .venv/bin/python benchmarks/real_shape.py --layers 2 --workdir /tmp/rs --json out.json

Every command runs as its real CLI in a subprocess: the server (bf16 on CPU) stays up; eval
(chat template, math reward, static and dynamic decoding) and train (math reward, DiPO,
shm weight push) talk to it. Reports wall time and peak RSS (`wait4`) of each process and
checks that chat turns stop at `<|im_end|>` with the stop token in the trace. The random
model gets every math answer wrong, so the train steps use `filter_zero_variance=false`
(zero advantages: the whole step still runs: replay, loss, backward, optimizer, push).
tests/dllm/test_real_shape_smoke.py runs this script; its numbers are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT / "tests" / "fixtures" / "sdar-1.7b-chat.config.json"
PROBLEMS = [("What is 2 + 3?", "5"), ("Compute 7 * 6.", "42"), ("What is 100 - 1?", "99"),
            ("Simplify 1/2 + 1/2.", "1"), ("What is 3^2?", "9"), ("What is 12 / 4?", "3")]


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768+), so that the many outgoing
    connections of a busy machine cannot take it between this check and its use."""
    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def write_inputs(work: Path, model: Path, port: int, args) -> Path:
    data = work / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "solution": f"... so the answer is $\\boxed{{{a}}}$.",
                                        "answer": a}) + "\n" for q, a in PROBLEMS))  # MATH500 layout
    url = f"http://127.0.0.1:{port}"
    common = {"model": str(model), "data": str(data), "chat_template": True}
    config = {
        "server": {"model": str(model), "port": port, "device": "cpu", "dtype": args.server_dtype, "max_batch": 8,
                   "max_model_len": 256, "admin_token_file": str(work / "admin_token"), "log_level": "warning",
                   "keep_versions": 0},  # no rollback copies: the peaks below are serve + train alone
        "eval": {**common, "servers": [url], "start_server": False, "reward": "math", "max_tokens": args.max_tokens,
                 "static_steps": [1], "dynamic_thresholds": [0.9], "limit": 4, "output": str(work / "eval.json")},
        "train": {**common, "servers": [url], "start_server": False, "reward": "math", "objective": "dipo",
                  "num_steps": args.steps, "prompts_per_step": 1, "group_size": 2,
                  "dtype": args.train_dtype, "max_tokens": args.max_tokens,
                  "strategy": "static", "denoise_steps": 1, "filter_zero_variance": False, "eval_every": 0,
                  "grad_accum": 1, "sync_transport": "shm", "tensorboard": False,
                  "output_dir": str(work / "train")},
    }
    path = work / "run.yaml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return path


def wait_rusage(proc: subprocess.Popen, timeout: float) -> tuple[int | str, float]:
    """Reap `proc` with wait4 (never proc.poll(), which would reap it first): exit code (or
    "timeout", then killed) and its peak RSS in MiB."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss / 1024
        time.sleep(0.2)
    proc.kill()
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = -9
    return "timeout", usage.ru_maxrss / 1024


def run_cli(cmd: list[str], log: Path, timeout: float) -> dict:
    """Run `dlrl ...` to completion; wall time, exit code and peak RSS (MiB) of the process."""
    t0 = time.perf_counter()
    env = dict(os.environ, MASTER_PORT=str(free_port()))  # the trainer's torch.distributed store
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dlrl.cli", *cmd], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
        rc, peak = wait_rusage(proc, timeout)
    return {"rc": rc, "seconds": time.perf_counter() - t0, "peak_rss_mib": peak}


def check_chat_stop(url: str, im_end: int, max_tokens: int) -> dict:
    """A chat completion through the template ends with <|im_end|>, which is in the trace."""
    body = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": max_tokens, "n": 4,
            "temperature": 1.0, "seed": 1, "return_trace": True}
    choices = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()["choices"]
    stops = [c for c in choices if c["finish_reason"] == "stop"]
    ok = bool(stops) and all(c["completion_ids"][-1] == im_end and len(c["trace"]["steps"]) == len(c["completion_ids"])
                             and "<|im_end|>" not in c["message"]["content"] for c in stops)
    return {"num_choices": len(choices), "num_stopped_at_im_end": len(stops), "stop_token_in_trace": ok}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "real-shape"))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--server-dtype", default="bfloat16")
    ap.add_argument("--train-dtype", default="fp32", help="trainer dtype: fp32 | bf16 (bf16 keeps fp32 master weights)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default="", help="also write the summary here")
    ap.add_argument("--reuse", action="store_true", help="keep the model folder of an earlier run")
    args = ap.parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    from dllm.embedded.standin import build_real_shape_folder

    t0 = time.perf_counter()
    model = work / "model"
    if not (args.reuse and (model / "model.safetensors.index.json").is_file()):
        build_real_shape_folder(model, FIXTURE, num_hidden_layers=args.layers)
    summary: dict = {"layers": args.layers, "build_seconds": time.perf_counter() - t0,
                     "params_millions": sum(json.loads((model / "model.safetensors.index.json").read_text())
                                            ["metadata"].values()) / 2 / 1e6}
    port = free_port()
    config = write_inputs(work, model, port, args)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    server_log = open(work / "serve.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "dlrl.cli", "serve", "--config", str(config)], cwd=ROOT,
                              stdout=server_log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
    try:
        while True:
            pid, status = os.waitpid(server.pid, os.WNOHANG)
            if pid:
                server.returncode = os.waitstatus_to_exitcode(status)
            if pid or time.perf_counter() - t0 > args.timeout:
                raise RuntimeError(f"dlrl serve did not become ready (see {work / 'serve.log'})")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        summary["serve_ready_seconds"] = time.perf_counter() - t0
        summary["chat"] = check_chat_stop(url, 151645, args.max_tokens)
        summary["eval"] = run_cli(["eval", "--config", str(config)], work / "eval.log", args.timeout)
        summary["train"] = run_cli(["train", "--config", str(config)], work / "train.log", args.timeout)
    finally:
        if server.returncode is None:
            server.send_signal(signal.SIGTERM)
            summary["serve_rc"], summary["serve_peak_rss_mib"] = wait_rusage(server, 60)
        server_log.close()
    summary["peak_rss_sum_gib"] = (summary.get("serve_peak_rss_mib", 0) + summary.get("train", {}).get(
        "peak_rss_mib", 0)) / 1024
    metrics = work / "train" / "metrics.jsonl"
    summary["train_steps_logged"] = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    if (work / "eval.json").is_file():
        res = json.loads((work / "eval.json").read_text())["results"]
        summary["eval_settings"] = [{k: r[k] for k in ("pass_at", "mean_response_tokens", "tokens_per_forward",
                                                       "wall_seconds", "finish_reasons")} | {"name": r["setting"]["name"]}
                                    for r in res]
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
