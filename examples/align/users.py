"""Simulated users for `make align`: requests to the serving replicas, the task's exact-match reward as feedback.

    python -m examples.align.users --config configs/align.yaml [users.num_users=8 users.duration_s=60 ...]

Each of `num_users` users loops: a question of the embedded task (its training split, never the
held-out split the gate evaluates on) -> `POST /v1/completions` on a replica (round robin, as a
load balancer would) -> after a short delay `POST /v1/feedback {id: record_id, reward}` with the
feedback token (env DLRL_FEEDBACK_TOKEN) and the exact-match reward of the answer. Every
request, error and the version that answered is counted; `users.stats_path` (JSON, rewritten
every few seconds and at exit) holds the totals, the accuracy users saw per version and per
minute, and the first error messages. SIGTERM / SIGINT: stop, write the stats, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from dlrl_config import ConfigError, load_sections
from trainer.align.config import UsersConfig


class Stats:
    def __init__(self) -> None:
        self.t0 = time.time()
        self.requests = self.errors = self.feedback = self.feedback_errors = 0
        self.by_version: dict[int, list[int]] = {}  # version -> [answers, correct]
        self.by_minute: dict[int, list[int]] = {}  # minute -> [answers, correct]
        self.error_messages: list[str] = []

    def answer(self, version: int, correct: bool) -> None:
        for table, key in ((self.by_version, version), (self.by_minute, int((time.time() - self.t0) // 60))):
            row = table.setdefault(key, [0, 0])
            row[0] += 1
            row[1] += int(correct)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_messages) < 20:
            self.error_messages.append(what[:300])

    def to_dict(self) -> dict:
        return {"seconds": round(time.time() - self.t0, 1), "requests": self.requests, "errors": self.errors,
                "feedback": self.feedback, "feedback_errors": self.feedback_errors,
                "versions_seen": sorted(self.by_version),
                "accuracy_by_version": {str(v): {"answers": n, "accuracy": c / n}
                                        for v, (n, c) in sorted(self.by_version.items())},
                "accuracy_by_minute": {str(m): {"answers": n, "accuracy": c / n}
                                       for m, (n, c) in sorted(self.by_minute.items())},
                "error_messages": self.error_messages}

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)


async def _feedback(http, url: str, token: str, record_id: str, reward: float, delay: float, stats: Stats) -> None:
    await asyncio.sleep(delay)
    try:
        r = await http.post(f"{url}/v1/feedback", json={"id": record_id, "reward": reward},
                            headers={"Authorization": f"Bearer {token}"})
        if r.status_code == 200:
            stats.feedback += 1
            return
        stats.feedback_errors += 1
    except Exception:  # noqa: BLE001 - counted; a user gives up on feedback that did not go through
        stats.feedback_errors += 1


async def _user(i: int, cfg: UsersConfig, prompts: list[dict], token: str, stats: Stats, stop: asyncio.Event) -> None:
    import httpx

    from trainer.rewards.registry import exact_match

    rng = random.Random(cfg.seed * 1000 + i)
    pending: set[asyncio.Task] = set()
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s) as http:
        n = i
        while not stop.is_set():
            ex = prompts[rng.randrange(len(prompts))]
            url = cfg.replicas[n % len(cfg.replicas)]
            n += 1
            stats.requests += 1
            try:
                r = await http.post(f"{url}/v1/completions", json={"prompt": ex["prompt"], "max_tokens": cfg.max_tokens,
                                                                   "temperature": cfg.temperature})
                if r.status_code != 200:
                    stats.error(f"{url}: HTTP {r.status_code}: {r.text[:200]}")
                else:
                    body = r.json()
                    choice = body["choices"][0]
                    reward = exact_match(choice["text"], ex)
                    stats.answer(int(choice.get("version") or body.get("version") or 0), reward >= 1.0)
                    if token and choice.get("record_id") and rng.random() < cfg.feedback_prob:
                        task = asyncio.create_task(_feedback(http, url, token, choice["record_id"], reward,
                                                             rng.uniform(0, cfg.feedback_delay_s), stats))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
            except Exception as e:  # noqa: BLE001 - every failure a user sees is counted
                stats.error(f"{url}: {type(e).__name__}: {e}")
            try:
                await asyncio.wait_for(stop.wait(), timeout=rng.uniform(0.5, 1.5) * cfg.think_time_s)
            except TimeoutError:
                pass
        if pending:
            await asyncio.wait(pending, timeout=cfg.feedback_delay_s + 10)


async def run_users(cfg: UsersConfig, prompts: list[dict], token: str) -> Stats:
    stats, stop = Stats(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    users = [asyncio.create_task(_user(i, cfg, prompts, token, stats, stop)) for i in range(cfg.num_users)]
    path, deadline = Path(cfg.stats_path), time.monotonic() + (cfg.duration_s or float("inf"))
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            await asyncio.wait_for(stop.wait(), timeout=min(5.0, max(0.01, deadline - time.monotonic())))
        except TimeoutError:
            stats.write(path)
    stop.set()
    await asyncio.gather(*users)
    stats.write(path)
    return stats


def main(argv: list[str] | None = None) -> int:
    from dllm.embedded.task import ArithmeticTask

    ap = argparse.ArgumentParser(prog="python -m examples.align.users", description="simulated users of dlrl align")
    ap.add_argument("--config", default="configs/align.yaml")
    ap.add_argument("overrides", nargs="*", help="users.key=value (or key=value) and task.key=value overrides")
    args = ap.parse_args(argv)
    try:
        root = load_sections(args.config, args.overrides, {"users": UsersConfig, "task": ArithmeticTask},
                             primary="users")
        cfg, task = root["users"], root["task"]
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    token = os.environ.get("DLRL_FEEDBACK_TOKEN", "")
    if not token:
        print("align_users: no DLRL_FEEDBACK_TOKEN: answers get no feedback", file=sys.stderr)
    prompts = task.split("train", 20_000, seed=task.seed + 7)
    stats = asyncio.run(run_users(cfg, prompts, token))
    print(json.dumps({k: v for k, v in stats.to_dict().items() if k != "accuracy_by_minute"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
