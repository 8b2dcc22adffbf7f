"""The refusal gate (issue 37) on a real server: a flood of over-quota requests is answered 429
on one kept-alive connection without its bodies being read (a malformed body is never parsed),
counted in dlrl_requests_total, logged once per interval with a count and left out of the
access log; a large body is refused with `Connection: close`; other keys are served meanwhile."""

from __future__ import annotations

import logging
import re

import httpx
import pytest
import yaml

FLOOD, POLITE = "sk-flood-0123456789abcdef", "sk-polite-0123456789abcdef"


@pytest.fixture(scope="module")
def gated(make_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("gate") / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": {"flood": {"key": FLOOD, "requests_per_s": 0.01},
                                             "polite": {"key": POLITE}}}))
    return make_server(max_batch=2, max_model_len=64, api_keys_file=str(path))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_flood_of_refusals_is_cheap_and_quiet(gated, caplog):
    url = gated.url
    caplog.set_level(logging.INFO)
    access, access_log = _Records(), logging.getLogger("uvicorn.access")
    level = access_log.level
    access_log.addHandler(access)  # before the client's connection opens: uvicorn logs its requests
    access_log.setLevel(logging.INFO)
    try:
        _flood(url)
    finally:
        access_log.removeHandler(access)
        access_log.setLevel(level)
    assert any('" 200' in line for line in access.lines) and not any('" 429' in line for line in access.lines)
    refused = [r for r in caplog.records if "refused /generate 429" in r.getMessage()]
    assert 1 <= len(refused) <= 2, [r.getMessage() for r in refused]  # once per interval, not 50 times
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert re.search(r'^dlrl_requests_total\{(?=[^}]*endpoint="/generate")(?=[^}]*status="429")[^}]*\} 51\.0$',
                     metrics, re.M), metrics


def _flood(url: str) -> None:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {FLOOD}"}, timeout=30) as client:
        assert client.post("/generate", json={"prompt": "1+1=", "max_tokens": 2}).status_code == 200  # its one
        codes = [client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
                 for _ in range(50)]
    assert {r.status_code for r in codes} == {429}  # the body was never parsed: not a 400
    assert all("connection" not in r.headers and int(r.headers["Retry-After"]) >= 1 for r in codes)
    assert all("x-request-id" not in r.headers for r in codes)  # nothing of the per-request path ran
    polite = httpx.post(url + "/generate", json={"prompt": "1+1=", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {POLITE}"}, timeout=30)
    assert polite.status_code == 200 and polite.headers["x-request-id"]
    big = httpx.post(url + "/generate", content=b"x" * 100_000, timeout=30,
                     headers={"Authorization": f"Bearer {FLOOD}", "content-type": "application/json"})
    assert big.status_code == 429 and big.headers["connection"] == "close"  # its unread body: not kept (51st)
