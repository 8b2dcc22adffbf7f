"""Admin endpoints: bearer-token auth (401 missing, 403 wrong, 403 disabled), env token, /ready, /health."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import ADMIN_TOKEN  # what the `admin_headers` fixture sends


@pytest.mark.parametrize("headers,status", [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 403),
    ({"Authorization": "Basic c2VjcmV0"}, 401),
    ({"Authorization": "Bearer"}, 401),
])
def test_admin_rejects_bad_tokens(server, headers, status):
    for method, path in (("POST", "/admin/pause"), ("POST", "/admin/resume"), ("GET", "/admin/status")):
        r = httpx.request(method, server.url + path, headers=headers)
        assert r.status_code == status, (path, r.text)
        assert r.json()["error"]["code"] == status
        if status == 401:
            assert r.headers["www-authenticate"] == "Bearer"
    assert not server.engine.is_paused


def test_admin_with_token(make_server, admin_headers):
    srv = make_server(max_batch=2, admin_token=ADMIN_TOKEN)  # its own server: pausing must not touch the shared one
    r = httpx.get(srv.url + "/admin/status", headers=admin_headers)
    assert r.status_code == 200 and r.json() == {"is_paused": False, "version": srv.engine.version,
                                                 "num_running": 0, "num_waiting": 0}
    assert httpx.post(srv.url + "/admin/pause", headers=admin_headers).json()["is_paused"] is True
    assert httpx.get(srv.url + "/ready").status_code == 503
    assert httpx.get(srv.url + "/health").json()["is_paused"] is True
    assert httpx.post(srv.url + "/admin/resume", headers=admin_headers).json()["is_paused"] is False
    assert httpx.get(srv.url + "/ready").status_code == 200


def test_admin_disabled_without_token(make_server):
    srv = make_server(max_batch=2)
    for headers in ({}, {"Authorization": "Bearer anything"}, {"Authorization": "Bearer"}):
        r = httpx.post(srv.url + "/admin/pause", headers=headers)
        assert r.status_code == 403 and "admin disabled" in r.json()["error"]["message"]
    assert not srv.engine.is_paused


def test_admin_token_from_env(make_server, monkeypatch):
    monkeypatch.setenv("DLRL_ADMIN_TOKEN", "from-env")
    srv = make_server(max_batch=2)
    assert httpx.get(srv.url + "/admin/status").status_code == 401
    assert httpx.get(srv.url + "/admin/status", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_health_and_ready(server):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == server.engine.model_name and h["is_paused"] is False
    assert h["is_draining"] is False and h["num_free_slots"] == server.config.max_batch
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")


def test_default_bind_is_loopback():
    from server.config import ServerConfig

    assert ServerConfig().host == "127.0.0.1"
