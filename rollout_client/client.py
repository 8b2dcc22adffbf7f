"""RolloutClient: THE client of one or more dlrl servers — generation, readiness and admin.

    import asyncio
    from rollout_client import RolloutClient

    async def main():
        async with RolloutClient(["http://127.0.0.1:8000"], timeout=120, token="admin-token") as client:
            await client.wait_ready(timeout=60)
            rollouts = await client.generate(["12+7=", "3*4="], n=4, max_tokens=16,
                                             temperature=1.0, strategy="dynamic", seed=0)
            for r in rollouts:   # ordered by (prompt_index, sample_index)
                print(r.prompt_index, r.version, r.finish_reason, r.text, r.trace.steps, r.logprobs)
            print(await client.admin("http://127.0.0.1:8000", "GET", "/weights/version"))

    asyncio.run(main())

Prompts are split into contiguous chunks (all `n` samples of a prompt stay on one server),
one request per chunk, sent concurrently; `policy` picks a server per chunk: "round_robin"
or "least_loaded" (fewest prompts in flight from this client). Connection errors,
timeouts, 429 and 503 are retried (on another server) up to `max_retries` times with
exponential backoff (stamina); other errors raise `RolloutError` with the server's message.
`admin(server, method, path, body)` calls the bearer-token admin API of one server
(`/weights/*`, `/admin/*`) and raises `AdminError` naming the server on any failure.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Sequence
from typing import Any, cast

import httpx
import stamina

from rollout_client.protocol.native import GenerateRequest, GenerateResponse
from rollout_client.protocol.rollout import Rollout
from rollout_client.protocol.service import HealthResponse

POLICIES = ("round_robin", "least_loaded")
_RETRY_STATUS = (429, 502, 503, 504)
Prompt = str | list[int]


class RolloutError(RuntimeError):
    """A generation request failed (after retries); `status` is the last HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class AdminError(RuntimeError):
    """An admin call failed; the message names the server, `status` is the HTTP status (None:
    the server did not answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Retryable(Exception):
    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


def _error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
        err = data.get("error") or {}
        if not err and "detail" in data:
            return f"{resp.status_code} {data['detail']}"
        return f"{resp.status_code} {err.get('message', resp.text)} (param={err.get('param')})"
    except (ValueError, AttributeError):
        return f"{resp.status_code} {resp.text[:200]}"


class RolloutClient:
    def __init__(self, servers: Sequence[str], timeout: float = 600.0, max_retries: int = 3,
                 policy: str = "round_robin", retry_backoff: float = 0.25, chunk_size: int | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, token: str | None = None) -> None:
        if not servers:
            raise ValueError("servers: at least one server URL is required")
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {POLICIES}")
        self.servers = [s.rstrip("/") for s in servers]
        self.policy, self.max_retries, self.retry_backoff = policy, max_retries, retry_backoff
        self.chunk_size = chunk_size
        self.inflight = dict.fromkeys(self.servers, 0)
        self._rr = itertools.cycle(range(len(self.servers)))
        self._token = token
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)),
                                       transport=transport)

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _pick(self, exclude: str | None = None) -> str:
        candidates = [s for s in self.servers if s != exclude] or self.servers
        if self.policy == "least_loaded":
            return min(candidates, key=lambda s: self.inflight[s])
        while True:
            server = self.servers[next(self._rr)]
            if server in candidates:
                return server

    def _chunks(self, prompts: list[Prompt]) -> list[tuple[int, list[Prompt]]]:
        """Contiguous (start index, prompts) chunks, each homogeneous (all text or all ids)."""
        size = self.chunk_size or max(1, math.ceil(len(prompts) / len(self.servers)))
        chunks: list[tuple[int, list[Prompt]]] = []
        for i, p in enumerate(prompts):
            last = chunks[-1] if chunks else None
            if last and len(last[1]) < size and isinstance(last[1][0], str) == isinstance(p, str):
                last[1].append(p)
            else:
                chunks.append((i, [p]))
        return chunks

    # ------------------------------------------------------------------ generation
    async def generate(self, prompts: Prompt | Sequence[Prompt], n: int = 1, **sampling: Any) -> list[Rollout]:
        """Sample `n` completions per prompt (text or token ids); sampling kwargs as in GenerateRequest."""
        many: Sequence[Prompt] = (
            [cast(Prompt, prompts)] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else cast(Sequence[Prompt], prompts))
        prompts = [p if isinstance(p, str) else list(p) for p in many]
        if not prompts:
            return []
        sampling.setdefault("return_trace", True)
        chunks = self._chunks(prompts)
        requests = []
        for _, chunk in chunks:  # validate client-side with the shared schema before sending anything
            key = "prompt" if isinstance(chunk[0], str) else "prompt_ids"
            requests.append(GenerateRequest.model_validate({key: chunk, "n": n, **sampling}))
        results = await asyncio.gather(*(self._send(req) for req in requests))
        rollouts: list[Rollout] = []
        for (start, _), (server, resp) in zip(chunks, results):
            rollouts += [Rollout.from_sample(s, start, n, server) for s in resp.samples]
        rollouts.sort(key=lambda r: (r.prompt_index, r.sample_index))
        return rollouts

    async def _send(self, req: GenerateRequest) -> tuple[str, GenerateResponse]:
        body = req.model_dump(exclude_unset=True)
        num_prompts = len(req.prompt_list())
        server: str | None = None
        try:
            async for attempt in stamina.retry_context(
                    on=_Retryable, attempts=self.max_retries + 1, timeout=None, wait_initial=self.retry_backoff,
                    wait_max=max(self.retry_backoff, 10.0), wait_jitter=0.0):
                with attempt:
                    server = self._pick(exclude=server)
                    return server, await self._post_generate(server, body, num_prompts)
        except _Retryable as e:
            raise RolloutError(f"generation failed after {self.max_retries + 1} attempt(s): {e}", e.status) from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _post_generate(self, server: str, body: dict, num_prompts: int) -> GenerateResponse:
        self.inflight[server] += num_prompts
        try:
            resp = await self._http.post(f"{server}/generate", json=body)
        except (httpx.TransportError, httpx.TimeoutException) as e:
            raise _Retryable(f"{server}: {type(e).__name__}: {e}", None) from None
        finally:
            self.inflight[server] -= num_prompts
        if resp.status_code == 200:
            return GenerateResponse.model_validate_json(resp.content)
        message = f"{server}: {_error_message(resp)}"
        if resp.status_code in _RETRY_STATUS:
            raise _Retryable(message, resp.status_code)
        raise RolloutError(message, resp.status_code)

    # ------------------------------------------------------------------ service / admin
    async def health(self) -> dict[str, HealthResponse | None]:
        """GET /health of every server: its HealthResponse, or None when unreachable."""
        async def one(server: str) -> HealthResponse | None:
            try:
                resp = await self._http.get(f"{server}/health", timeout=10.0)
                return HealthResponse.model_validate_json(resp.content) if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None
        results = await asyncio.gather(*(one(s) for s in self.servers))
        return dict(zip(self.servers, results))

    async def is_ready(self, server: str) -> bool:
        try:
            return (await self._http.get(f"{server}/ready", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_ready(self, timeout: float = 60.0, interval: float = 0.2,
                         servers: Sequence[str] | None = None) -> None:
        """Wait until every server (default: all) answers GET /ready with 200; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        pending = [s.rstrip("/") for s in (servers or self.servers)]
        while pending:
            ready = await asyncio.gather(*(self.is_ready(s) for s in pending))
            pending = [s for s, ok in zip(pending, ready) if not ok]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"servers not ready after {timeout:.0f}s: {', '.join(pending)}")
            if pending:
                await asyncio.sleep(interval)

    async def metrics(self, server: str, timeout: float = 10.0) -> str:
        """GET /metrics of `server`: the Prometheus text exposition (RolloutError naming it on failure)."""
        try:
            resp = await self._http.get(f"{server.rstrip('/')}/metrics", timeout=timeout)
        except httpx.HTTPError as e:
            raise RolloutError(f"server {server} did not answer GET /metrics: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise RolloutError(f"server {server}: GET /metrics answered {_error_message(resp)}", resp.status_code)
        return resp.text

    async def admin(self, server: str, method: str, path: str, body: dict[str, Any] | None = None,
                    timeout: float | None = 60.0) -> dict[str, Any]:
        """One admin call (bearer token) to `server`; AdminError naming the server on failure."""
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        url = f"{server.rstrip('/')}{path}"
        try:
            resp = await self._http.request(method, url, json=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as e:
            raise AdminError(f"server {server} did not answer {method} {path}: {type(e).__name__}: {e}") from None
        if resp.status_code >= 300:
            raise AdminError(f"server {server}: {method} {path} answered {_error_message(resp)}", resp.status_code)
        return resp.json() if resp.content else {}
