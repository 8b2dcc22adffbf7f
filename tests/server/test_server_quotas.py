"""Per-key quotas (issue 26) on a real server: API keys from a file (the official OpenAI client as
a keyed client), 401/403 without or with a wrong key, request rate, token rate and concurrency
caps answered 429 with Retry-After while another key is unaffected, the admin token still
accepted for rollouts and the feedback token still only for feedback, the feedback concurrency
cap, and bad key files refused with the key named."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from dlrl_config import ConfigError
from server.api.quotas import load_keys

ADMIN, FEEDBACK = "quota-admin-token", "quota-feedback-token"
ALICE, BOB, CAROL = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef00", "sk-carol-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed(make_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": {
        "alice": {"key": ALICE, "requests_per_s": 1, "burst_s": 2},                  # 2 at once, then 1/s
        "bob": {"key": BOB, "max_concurrent": 1},
        "carol": {"key": CAROL, "tokens_per_s": 20, "burst_s": 2}}}))               # 40 tokens, then 20/s
    return make_server(max_batch=8, max_model_len=64, api_keys_file=str(path), admin_token=ADMIN,
                       feedback_token=FEEDBACK, record="all", store=str(path.parent / "fb.db"),
                       max_concurrent_feedback=1)


def _gen(url: str, key: str | None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/generate", json={"prompt": "1+1=", "max_tokens": 4, **body}, headers=headers, timeout=60)


def test_keys_rates_and_roles(keyed):
    url = keyed.url
    assert _gen(url, None).status_code == 401
    assert _gen(url, "sk-nobody-0123456789abcdef").status_code == 403
    assert _gen(url, FEEDBACK).status_code == 403               # the feedback token is not an API key
    assert all(_gen(url, ADMIN).status_code == 200 for _ in range(4))  # rollouts: the admin token, no quota

    codes = [_gen(url, ALICE) for _ in range(3)]                 # burst of 2, then over 1 request/s
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert "requests/s" in codes[2].json()["error"]["message"] and int(codes[2].headers["Retry-After"]) >= 1
    assert _gen(url, BOB).status_code == 200                     # another key is unaffected
    time.sleep(1.1)
    assert _gen(url, ALICE).status_code == 200                   # refilled

    client = openai.OpenAI(base_url=url + "/v1", api_key=CAROL, max_retries=0)
    client.completions.create(model=keyed.engine.model_name, prompt="1+2=", max_tokens=30)  # ~34 of 40 tokens
    with pytest.raises(openai.RateLimitError, match="tokens/s"):
        client.completions.create(model=keyed.engine.model_name, prompt="1+2=", max_tokens=30)
    too_big = _gen(url, CAROL, max_tokens=50)
    assert too_big.status_code == 413 and too_big.json()["error"]["param"] == "max_tokens"
    assert httpx.post(url + "/admin/pause", headers={"Authorization": f"Bearer {ALICE}"}, timeout=10).status_code == 403


def test_concurrency_caps_on_generation_and_feedback(keyed):
    url = keyed.url
    slow = {"max_tokens": 56, "ignore_eos": True, "strategy": "static", "steps": 4}
    with ThreadPoolExecutor(4) as pool:
        codes = sorted(r.status_code for r in pool.map(lambda _: _gen(url, BOB, **slow), range(4)))
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
    rids = [s["record_id"] for s in _gen(url, ADMIN, n=8).json()["samples"]]
    fb = {"Authorization": f"Bearer {FEEDBACK}"}
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda r: httpx.post(url + "/v1/feedback", json={"id": r, "reward": 1.0}, headers=fb,
                                                      timeout=30).status_code, rids))
    assert set(statuses) <= {200, 429} and 200 in statuses
    assert httpx.post(url + "/v1/feedback", json={"id": rids[0], "reward": 1.0}, headers=fb,
                      timeout=30).status_code == 200  # nothing stays counted in flight


@pytest.mark.parametrize("text,named", [
    ("keys: {a: {key: short}}", "keys.a.key"),
    ("keys: {a: {key: sk-0123456789abcdef, requests_per_s: -1}}", "keys.a.requests_per_s"),
    ("keys: {a: {key: sk-0123456789abcdef, rate: 1}}", "keys.a.rate"),
    ("keys: {a: {key: sk-0123456789abcdef}, b: {key: sk-0123456789abcdef}}", "share one key"),
    ("keys: [", "not YAML"),
])
def test_bad_key_files_name_the_key(tmp_path, text, named):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_keys(str(path))


def test_several_api_processes_each_enforce_their_share(monkeypatch):
    """server.api_processes=2: each process refills a key's rates at half speed (bursts: the whole bucket) and
    takes half of its concurrency cap and of the feedback cap, rounded up."""
    from server.api.errors import APIError
    from server.api.quotas import KeySpec, Quotas

    clock = [100.0]
    monkeypatch.setattr("server.api.quotas.time.monotonic", lambda: clock[0])
    spec = KeySpec(key="sk-share-0123456789abcdef", requests_per_s=10, max_concurrent=3)
    quotas = Quotas({"k": spec}, max_concurrent_feedback=5, share=0.5)
    key = quotas.keys[0]
    assert (key.max_concurrent, quotas.max_feedback, key.requests.capacity) == (2, 3, 10)
    for _ in range(2):
        quotas.admit(key)
    with pytest.raises(APIError, match=r"max_concurrent=3, 2 in this API process"):
        quotas.admit(key)
    quotas.release(key)
    quotas.release(key)
    for _ in range(8):  # the burst: the key's whole bucket (10, 2 taken above)
        quotas.admit(key)
        quotas.release(key)
    with pytest.raises(APIError, match="over 10 requests/s"):
        quotas.admit(key)
    clock[0] += 1.0  # refilled at 5/s here, the other process refills the other 5
    for _ in range(5):
        quotas.admit(key)
        quotas.release(key)
    with pytest.raises(APIError):
        quotas.admit(key)
