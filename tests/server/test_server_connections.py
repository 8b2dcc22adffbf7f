"""Slow, idle and too many connections, and failing tokens, against a real `dlrl serve` process.

    .venv/bin/python -m pytest -q tests/server/test_server_connections.py

One server per HTTP protocol (server.http=h11 on asyncio; httptools on uvloop, the default when
installed), started with a file limit of 256 descriptors (RLIMIT_NOFILE set in the child) and
short bounds: header timeout 2 s, read timeout 1.5 s, keep-alive
1 s, max_connections 1000 (lowered at start to fit the file limit: 256 - fd_reserve 208
- 8 reserved = 40), 30 per client address, 8 reserved slots, a listen backlog of 100 (the
kernel queues the whole flood: no SYN retries on a loaded box). Floods come from other
loopback addresses (127.0.0.2, 127.0.0.3) than the probes (127.0.0.1):
- past the caps a connection gets an immediate 503 and is closed; /health and admin calls
  still answer (reserved slots), a generation request there is a 503;
- connections that dribble their headers are closed (408) after the header timeout,
  however slowly they keep sending; a stalled body after the read timeout; an idle
  kept-alive connection after the keep-alive timeout; request headers over 16 KiB at once
  (431, or h11's own 400);
- refusals are counted in /metrics and logged a bounded number of times (once per interval
  with a count);
- an event loop that runs out of descriptors logs "out of system resource" once per
  interval with a count (a small asyncio server under a flood, with server.api.connections'
  handler), never once per failed accept;
- repeated wrong admin tokens are counted and logged, then throttled: 429 with Retry-After.
"""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "conn-token"
NOFILE = 256
OVERRIDES = ["server.header_timeout_s=2", "server.read_timeout_s=1.5", "server.keepalive_timeout_s=1",
             "server.max_connections=1000", "server.max_connections_per_ip=30", "server.reserved_connections=8",
             "server.fd_reserve=208", "server.listen_backlog=100", "server.resource_log_interval_s=1",
             "server.auth_max_failures=5", "server.auth_throttle_s=3"]


def _limit_files(n: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


PROTOCOLS = {"h11": ["server.http=h11", "server.loop=asyncio"], "httptools": []}  # httptools: the default (auto)
BOTH = pytest.mark.parametrize("srv", list(PROTOCOLS), indirect=True)


@pytest.fixture(scope="module")
def srv(request, tiny_model_dir, tmp_path_factory):
    http = request.param
    port = free_port()
    log_path = tmp_path_factory.mktemp("conn") / "server.log"
    cmd = [sys.executable, "-m", "server.cli", "--model", tiny_model_dir, "--port", str(port), "server.device=cpu",
           "server.dtype=float32", "server.max_batch=2", "server.max_model_len=64", f"server.admin_token={TOKEN}",
           *OVERRIDES, *PROTOCOLS[http]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("DLRL_ADMIN_TOKEN", None)
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                preexec_fn=_limit_files(NOFILE))
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, log_path.read_text()
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 120, "dlrl serve")
    loop = "asyncio" if http == "h11" else "uvloop"
    assert f"HTTP protocol {http} on the {loop} event loop" in log_path.read_text()
    proc.url, proc.port, proc.log_path, proc.http = url, port, log_path, http
    yield proc
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def connect_from(src: str, port: int, first: bytes = b"GET /health HTTP/1.1\r\nHo") -> socket.socket:
    s = socket.socket()
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    if first:
        s.sendall(first)
    return s


def read_all(s: socket.socket, timeout: float) -> bytes | None:
    """What the server sent until it closed (None: still open after `timeout`)."""
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def refused(s: socket.socket) -> bool:
    data = read_all(s, 0.3)
    return data is not None and data.startswith(b"HTTP/1.1 503") and b"too many connections" in data


@BOTH
def test_caps_reserve_and_header_timeout(srv):
    log = srv.log_path.read_text()
    assert "server.max_connections lowered from 1000 to 40" in log, log[-2000:]
    flood2 = [connect_from("127.0.0.2", srv.port) for _ in range(60)]   # 30 per address, then 2 reserved slots
    time.sleep(0.3)
    flood3 = [connect_from("127.0.0.3", srv.port) for _ in range(20)]   # 10 until 40 in all, then 2 reserved
    time.sleep(0.3)
    t0 = time.monotonic()
    num_refused = sum(refused(s) for s in flood2[32:]) + sum(refused(s) for s in flood3[12:])
    assert num_refused == 28 + 8
    r = httpx.get(srv.url + "/health", timeout=5)   # a reserved slot
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.get(srv.url + "/weights/version", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert r.status_code == 200
    r = httpx.post(srv.url + "/generate", json={"prompt": "1+2=", "max_tokens": 2}, timeout=5)
    assert r.status_code == 503 and "too many connections" in r.json()["error"]["message"]
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=5) as flooder:
        r = flooder.post(srv.url + "/generate", json={"prompt": "1+2=", "max_tokens": 2})  # no slot left at all
        assert r.status_code == 503 and "too many connections" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
    admitted = flood2[:32] + flood3[:12]
    for s in admitted:  # closed with a 408 once the header timeout (2 s) passed
        data = read_all(s, max(0.1, t0 + 4 - time.monotonic()))
        assert data is not None and data.startswith(b"HTTP/1.1 408"), data
    assert time.monotonic() - t0 < 4.5
    for s in flood2 + flood3:
        s.close()
    r = httpx.post(srv.url + "/generate", json={"prompt": "1+2=", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    metrics = httpx.get(srv.url + "/metrics", timeout=5).text
    assert float(re.search(r'dlrl_connections_refused_total\{model_name="[^"]+",reason="limit"\} (\S+)', metrics)[1]) >= 36
    assert float(re.search(r'dlrl_connections_refused_total\{model_name="[^"]+",reason="header_timeout"\} (\S+)', metrics)[1]) >= 44
    health = httpx.get(srv.url + "/health", timeout=5).json()
    assert health["num_kv_pages_total"] > 0 and 0 <= health["num_kv_pages_used"] <= health["num_kv_pages_total"]
    assert health["num_free_slots"] == 2
    time.sleep(1.2)  # the interval passes: the held-back counts are logged
    lines = [ln for ln in srv.log_path.read_text().splitlines() if "closed: too many connections" in ln]
    assert 1 <= len(lines) <= 6, lines
    assert any("times in the last 1s" in ln for ln in lines), lines


@BOTH
def test_dribbled_headers_stalled_body_and_idle_keepalive_are_closed(srv):
    dribbler = connect_from("127.0.0.2", srv.port, b"G")
    t0, closed_after = time.monotonic(), None
    for byte in b"ET /health HTTP/1.1\r\nX-Slow: " + b"a" * 100:
        try:
            dribbler.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - t0
            break
        time.sleep(0.1)
        if read_all(dribbler, 0.01) is not None:  # the server answered 408 and closed
            closed_after = time.monotonic() - t0
            break
    assert closed_after is not None and 1.9 < closed_after < 3.5, closed_after
    stalled = connect_from("127.0.0.2", srv.port, b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: "
                           b"application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\"")
    t0 = time.monotonic()
    data = read_all(stalled, 4)
    assert data is not None and data.startswith(b"HTTP/1.1 408") and 1.4 < time.monotonic() - t0 < 3.5, data
    idle = connect_from("127.0.0.2", srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    t0 = time.monotonic()
    data = read_all(idle, 4)  # the answer, then the close after keep-alive 1 s
    assert data is not None and data.startswith(b"HTTP/1.1 200") and 0.9 < time.monotonic() - t0 < 3, data
    for s in (dribbler, stalled, idle):
        s.close()


@BOTH
def test_oversized_headers_are_refused_and_closed(srv):
    big = connect_from("127.0.0.2", srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n")
    try:
        for _ in range(64):  # 64 x 1 KiB of headers, never ending: over the 16 KiB bound
            big.sendall(b"X-Big: " + b"a" * 1017 + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # closed while sending: the answer was sent first
    data = read_all(big, 3)
    big.close()
    status = b"431" if srv.http == "httptools" else b"400"  # h11 bounds the headers itself (16 KiB too)
    assert data is not None and data.startswith(b"HTTP/1.1 " + status), data
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("srv", ["httptools"], indirect=True)  # not a connection bound: one protocol is enough
def test_failing_admin_tokens_are_counted_logged_and_throttled(srv):
    bad = {"Authorization": "Bearer wrong"}
    with httpx.Client(base_url=srv.url, timeout=5) as c:
        statuses = [c.get("/weights/version", headers=bad).status_code for _ in range(5)]
        assert statuses == [403] * 5
        r = c.get("/weights/version", headers=bad)
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 3, r.text
        r = c.get("/weights/version", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 429  # throttled before the token is compared
        time.sleep(int(r.headers["retry-after"]) + 0.2)
        assert c.get("/weights/version", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        metrics = c.get("/metrics").text
    assert float(re.search(r'dlrl_auth_failures_total\{model_name="[^"]+",status="403",what="admin"\} (\S+)', metrics)[1]) == 5
    assert float(re.search(r'dlrl_auth_failures_total\{model_name="[^"]+",status="429",what="admin"\} (\S+)', metrics)[1]) == 2
    log = srv.log_path.read_text()
    assert "admin authentication failed (HTTP 403) from 127.0.0.1" in log
    assert "127.0.0.1 failed 5 times within 60s: throttled (429) for 3s" in log


EMFILE_SERVER = '''
import asyncio, logging, resource, sys
from server.api.connections import RateLimitedLog, install_resource_log
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
held = []
class Hold(asyncio.Protocol):
    def connection_made(self, transport):
        held.append(transport)
async def main():
    limiter = RateLimitedLog(1.0)
    install_resource_log(asyncio.get_running_loop(), limiter)
    server = await asyncio.get_running_loop().create_server(Hold, "127.0.0.1", int(sys.argv[1]), backlog=128)
    print("listening", flush=True)
    for _ in range(30):
        await asyncio.sleep(0.1)
        limiter.flush()
asyncio.run(main())
'''


def test_out_of_descriptors_is_logged_once_per_interval():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", EMFILE_SERVER, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "listening"
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]  # the kernel queues them
    out, _ = proc.communicate(timeout=30)
    for c in clients:
        c.close()
    lines = [ln for ln in out.splitlines() if "out of system resource" in ln]
    assert 2 <= len(lines) <= 5, out[-3000:]  # ~3 s at one line per second, not one per failed accept
    assert any(re.search(r"\((\d+) times in the last 1s", ln) for ln in lines), lines
    assert "Traceback" not in out


def test_limits_fit_the_file_limit_and_bad_keys_are_named():
    from dlrl_config import ConfigError
    from server.api.connections import ConnectionLimits
    from server.config import ServerConfig

    config = ServerConfig(max_connections=1000, fd_reserve=100, reserved_connections=8)
    assert ConnectionLimits.from_config(config, nofile=4096).max_connections == 1000
    assert ConnectionLimits.from_config(config, nofile=300).max_connections == 192
    with pytest.raises(ConfigError, match="server.fd_reserve: the file limit"):
        ConnectionLimits.from_config(config, nofile=100)
    with pytest.raises(ValueError, match="server.listen_backlog: 200 must be below server.fd_reserve"):
        ServerConfig(listen_backlog=200, fd_reserve=100)
    limits = ConnectionLimits(3, 2, 4, 1.0, 1.0)
    slots = [limits.admit(ip) for ip in ("a", "a", "a", "a", "a", "b", "b", "c", "c")]
    assert slots == ["normal", "normal", "reserve", None, None, "normal", "reserve", "reserve", None]
    limits.release("a", "normal")
    assert limits.admit("c") == "normal"


def test_protocol_choice_and_missing_packages_are_named(monkeypatch):
    import server.config
    from dlrl_config import ConfigError, build
    from server.api.connections import ConnectionBounds, ConnectionLimits, bounded_protocol
    from server.config import ServerConfig

    limits = ConnectionLimits(3, 2, 4, 1.0, 1.0)
    for http, base in (("h11", "H11Protocol"), ("httptools", "HttpToolsProtocol")):
        cls = bounded_protocol(limits, http)
        assert issubclass(cls, ConnectionBounds) and cls.limits is limits
        assert [c.__name__ for c in cls.__mro__].index("ConnectionBounds") < [c.__name__ for c in cls.__mro__].index(base)
    assert (ServerConfig().resolved_http(), ServerConfig().resolved_loop()) == ("httptools", "uvloop")
    monkeypatch.setattr(server.config, "_installed", lambda module: False)
    assert (ServerConfig().resolved_http(), ServerConfig().resolved_loop()) == ("h11", "asyncio")
    for key, module in (("http", "httptools"), ("loop", "uvloop")):
        with pytest.raises(ConfigError, match=f"server.{key}: {module} is not installed"):
            build(ServerConfig, {key: module}, "server")
