"""The soak test's traffic (benchmarks/soak.py runs it): closed-loop clients of mixed requests,
cache-exhausting long requests, a flood from one API key over its quota, and feedback workers.

Every response's `record_id`s (the acknowledged records) and every feedback answered 200 are
collected in `Stats`, so soak.py can check at the end that the store holds all of them.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

KINDS = ["completions", "completions_stream", "chat", "chat_stream", "generate"]


@dataclass
class Stats:
    # (start, end, client class, kind, outcome); class: normal | long | flood
    records: list[tuple[float, float, str, str, str]] = field(default_factory=list)
    pushes: list[tuple[float, float, int, str]] = field(default_factory=list)  # (start, end, version, transport)
    push_errors: list[str] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    acked: set[str] = field(default_factory=set)  # record ids handed to a client
    null_ids: int = 0  # samples answered with record_id null (store down / slow: not acknowledged)
    feedback_acked: dict[str, float] = field(default_factory=dict)  # record id -> reward, answered 200
    feedback_outcomes: dict[str, int] = field(default_factory=dict)
    flood_windows: list[tuple[float, float]] = field(default_factory=list)
    pg_down: list[tuple[float, float]] = field(default_factory=list)
    feedback_queue: asyncio.Queue | None = None  # acknowledged ids for the feedback workers


def _body(kind: str, rng: random.Random, max_tokens: tuple[int, int], n: tuple[int, int]) -> tuple[str, dict]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    common = {"max_tokens": rng.randint(*max_tokens), "temperature": rng.choice([0.0, 0.7, 1.0]),
              "strategy": rng.choice(["static", "dynamic", "sequential"]), "seed": rng.randint(0, 1 << 30)}
    if rng.random() < 0.2:
        common["stop"] = [str(rng.randint(0, 9))]
    if kind.startswith("completions"):
        return "/v1/completions", {"prompt": f"{a}+{b}=", "stream": kind.endswith("stream"),
                                   "logprobs": rng.choice([None, 2]), **common}
    if kind.startswith("chat"):
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"{a}+{b}"}],
                                        "stream": kind.endswith("stream"), **common}
    return "/generate", {"prompt": [f"{a}+{b}="], "n": rng.randint(*n), **common}


def _record_ids(obj, stats: Stats) -> None:
    """Collect every `record_id` in a response (or stream chunk) body; in a stream only a
    choice's last chunk (with its finish_reason) carries one."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "record_id" and obj.get("finish_reason", "") is None:
                continue  # a stream chunk before the choice's last
            if k == "record_id":
                if isinstance(v, str):
                    stats.acked.add(v)
                    if stats.feedback_queue is not None:
                        stats.feedback_queue.put_nowait(v)
                elif v is None:
                    stats.null_ids += 1
            else:
                _record_ids(v, stats)
    elif isinstance(obj, list):
        for v in obj:
            _record_ids(v, stats)


def _status(code: int, text: str) -> str:
    if 400 <= code < 500:
        return f"4xx:{code}"
    return f"5xx:{code} {text[:120]}" if code >= 500 else f"error:{code} {text[:120]}"


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict, stats: Stats,
               cut_after: int = 0) -> str:
    """Send one request; returns its outcome ("200", "4xx:<code>", "5xx:...", "error:<what>",
    "disconnect_mid_stream" when the client hung up after `cut_after` stream chunks)."""
    if body.get("stream"):
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return _status(r.status_code, r.text)
            lines = []
            async for line in r.aiter_lines():
                if not line:
                    continue
                lines.append(line)
                if cut_after and len(lines) >= cut_after:
                    return "disconnect_mid_stream"  # leaving the block closes the connection
            errors = [line for line in lines if '"error"' in line]
            if errors:  # a status after the 200 went out: a 4xx/5xx in the stream
                err = json.loads(errors[0][6:]).get("error", {})
                code = err.get("code") or 0
                code = code if isinstance(code, int) else 0
                return f"stream_{_status(code, err.get('message', ''))}" if code else f"error:stream {errors[0][:160]}"
            if not lines or lines[-1] != "data: [DONE]":
                return f"error:bad stream ({lines[-1][:80] if lines else 'empty'})"
            for line in lines[:-1]:
                if line.startswith("data: "):
                    _record_ids(json.loads(line[6:]), stats)
            return "200"
    r = await client.post(url, json=body, headers=headers)
    if r.status_code != 200:
        return _status(r.status_code, r.text)
    _record_ids(r.json(), stats)
    return "200"


async def client(i: int, base: str, key: str, stop_at: float, stats: Stats, disconnect: float,
                 cls: str = "normal", max_tokens: tuple[int, int] = (4, 24), n: tuple[int, int] = (1, 2),
                 deadline_s: float = 0.0) -> None:
    """A closed-loop client. A `disconnect` share of requests hang up: half part-way through a
    stream (after 1-3 chunks), half after a random 10-500 ms (whatever stage the request is in)."""
    rng = random.Random(f"{cls}{i}")
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=300) as http:
        while time.monotonic() < stop_at:
            kind = rng.choice(KINDS)
            path, body = _body(kind, rng, max_tokens, n)
            if deadline_s and rng.random() < 0.5:
                body["timeout"] = deadline_s  # the request's own deadline: a 408 past it
            t0 = time.monotonic()
            hang_up = rng.random() < disconnect
            try:
                if hang_up and body.get("stream") and rng.random() < 0.5:
                    outcome = await _one(http, base + path, body, headers, stats, cut_after=rng.randint(1, 3))
                elif hang_up:
                    await asyncio.wait_for(_one(http, base + path, body, headers, stats), rng.uniform(0.01, 0.5))
                    outcome = "200"  # finished before the client hung up
                else:
                    outcome = await _one(http, base + path, body, headers, stats)
            except TimeoutError:
                outcome = "disconnect"
            except httpx.HTTPError as e:
                outcome = f"error:{type(e).__name__}"
            stats.records.append((t0, time.monotonic(), cls, kind, outcome))
            if outcome.startswith("4xx:429"):
                await asyncio.sleep(rng.uniform(0.2, 1.0))  # a polite client backs off


def flood_process(base: str, key: str, t_start: float, stop_at: float, rps: float, window: float, conn) -> None:
    """`flood` in a process of its own (so its client-side work does not slow the other
    clients' event loop); sends its records, windows and acknowledged ids back over `conn`."""
    stats = Stats()
    asyncio.run(flood(base, key, t_start, stop_at, stats, rps, window))
    conn.send((stats.records, stats.flood_windows, stats.acked, stats.null_ids))
    conn.close()


async def flood(base: str, key: str, t_start: float, stop_at: float, stats: Stats, rps: float,
                window: float) -> None:
    """One API key over its quota: `rps` requests/s (not waiting for answers, ignoring
    Retry-After) during every other `window` seconds from `t_start`, starting with a quiet one."""
    rng = random.Random("flood")
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        async def fire() -> None:
            t0 = time.monotonic()
            path, body = _body("completions", rng, (4, 8), (1, 1))
            try:
                outcome = await _one(http, base + path, body, headers, stats)
            except httpx.HTTPError as e:
                outcome = f"error:{type(e).__name__}"
            stats.records.append((t0, time.monotonic(), "flood", "completions", outcome))

        tasks: set[asyncio.Task] = set()
        while time.monotonic() < stop_at:
            k = int((time.monotonic() - t_start) // window)
            w0, w1 = t_start + k * window, min(t_start + (k + 1) * window, stop_at)
            if k % 2 == 0:
                await asyncio.sleep(max(0.0, w1 - time.monotonic()))
                continue
            stats.flood_windows.append((w0, w1))
            while time.monotonic() < w1:
                if len(tasks) < 64:  # at most 64 in flight from the flooder itself
                    task = asyncio.create_task(fire())
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.sleep(1.0 / rps)
        await asyncio.gather(*tasks, return_exceptions=True)


async def feedback_worker(base: str, token: str, queue: asyncio.Queue, stats: Stats, share: float) -> None:
    """Post feedback on a `share` of acknowledged records; a 503 (store down) is retried every
    second for up to 120 s, as a product backend would."""
    rng = random.Random("feedback")
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(timeout=60) as http:
        while True:
            rid = await queue.get()
            if rid is None:
                return
            if rng.random() >= share:
                continue
            reward = round(rng.random(), 3)
            give_up = time.monotonic() + 120
            while True:
                try:
                    r = await http.post(base + "/v1/feedback", json={"id": rid, "reward": reward}, headers=headers)
                    code = str(r.status_code)
                except httpx.HTTPError as e:
                    code = f"error:{type(e).__name__}"
                stats.feedback_outcomes[code] = stats.feedback_outcomes.get(code, 0) + 1
                if code == "200":
                    stats.feedback_acked[rid] = reward
                    break
                if code not in ("503", "429") or time.monotonic() > give_up:
                    break
                await asyncio.sleep(1.0)
