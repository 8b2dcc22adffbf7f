"""Graceful shutdown of a real `dlrl serve` process by a real SIGTERM.

In-flight requests finish (or, past `server.shutdown_timeout`, end with finish_reason
"abort"), new requests are answered 503, `/ready` turns 503, and the process exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

# sequential decoding, one token per forward: long enough that a quiet, fast box cannot finish the
# request before the signal (or within the 0.5 s deadline) - the model below allows 4096 positions
LONG = {"strategy": "sequential", "ignore_eos": True, "seed": 0}
DRAIN_TOKENS, ABORT_TOKENS = 2000, 4000


@pytest.fixture(scope="module")
def long_model(tiny_model_dir, tmp_path_factory) -> list[str]:
    """The tiny random model with 4096 positions (RoPE has no length limit of its own): `--model` args."""
    import shutil

    path = tmp_path_factory.mktemp("tiny-long") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return ["--model", str(path)]


def _wait_for(cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        time.sleep(0.02)


def _num_running(url: str) -> int:
    return httpx.get(url + "/health", timeout=10).json()["num_running"]


def _post_status(url: str) -> int:
    try:
        return httpx.post(url + "/generate", json={"prompt": "1", "max_tokens": 2}, timeout=10).status_code
    except httpx.TransportError:
        return -1


@pytest.mark.slow
def test_sigterm_drains_inflight_stream_refuses_new_and_exits_0(serve_process, long_model):
    srv = serve_process(*long_model, "server.shutdown_timeout=300", "server.max_batch=2")
    events: list[dict] = []

    def stream() -> None:
        body = {"prompt": "7", "stream": True, "return_trace": True, "max_tokens": DRAIN_TOKENS, **LONG}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=300) as r:
            events.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))

    reader = threading.Thread(target=stream)
    reader.start()
    _wait_for(lambda: any(e["choices"] and e["choices"][0]["text"] for e in events), what="first streamed block")
    srv.proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: _post_status(srv.url) == 503, what="503 for new requests")
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "shutting down" in r.json()["error"]["message"]
    assert httpx.get(srv.url + "/ready").status_code == 503
    assert httpx.get(srv.url + "/health").json()["is_draining"] is True
    reader.join(timeout=300)
    final = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["finish_reason"] == "length" and len(final[0]["completion_ids"]) == DRAIN_TOKENS
    assert srv.proc.wait(timeout=60) == 0
    log = srv.log()
    assert "received SIGTERM: shutting down gracefully" in log and "drained: no request in flight" in log


@pytest.mark.slow
def test_sigterm_deadline_aborts_what_is_left_and_exits_0(serve_process, long_model):
    srv = serve_process(*long_model, "server.shutdown_timeout=0.5", "server.max_batch=2")
    result: dict = {}

    def generate() -> None:
        result["response"] = httpx.post(srv.url + "/generate", json={"prompt": "3", "max_tokens": ABORT_TOKENS, **LONG},
                                        timeout=300)

    caller = threading.Thread(target=generate)
    caller.start()
    _wait_for(lambda: _num_running(srv.url) == 1, what="a running sequence")
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    caller.join(timeout=120)
    sample = result["response"].json()["samples"][0]
    assert result["response"].status_code == 200 and sample["finish_reason"] == "abort"
    assert len(sample["completion_ids"]) < ABORT_TOKENS
    assert srv.proc.wait(timeout=60) == 0
    assert time.monotonic() - t0 < 30
    assert "shutdown deadline (0.5s) passed: aborted 1 request(s)" in srv.log()
