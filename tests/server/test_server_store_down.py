"""A hung store stalls nothing else (issue 37): with the PostgreSQL store frozen (every process of
the cluster SIGSTOPped: connections stay open, queries never answer) while 24 feedback posts
hang on it, the admin weight routes (GET /weights/checksum, /weights/version), /health and
generation answer within their normal time, and feedback past `server.max_concurrent_feedback`
is refused 429 before its body is read. Also: the test cluster commits synchronously (what
"an id returned is always valid" needs)."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import psycopg

ADMIN, FEEDBACK = "store-down-admin", "store-down-feedback"


def _cluster(postgres) -> list[psutil.Process]:
    pid = int((postgres.data / "postmaster.pid").read_text().split()[0])
    main = psutil.Process(pid)
    return [main, *main.children(recursive=True)]


def _timed(url: str, path: str) -> float:
    t0 = time.monotonic()
    r = httpx.get(url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_the_test_cluster_commits_synchronously(postgres):
    with psycopg.connect(postgres.url()) as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "on"


def test_admin_and_weight_routes_answer_while_feedback_hangs_on_a_frozen_store(make_server, postgres):
    srv = make_server(max_batch=4, max_model_len=64, admin_token=ADMIN, feedback_token=FEEDBACK, record="all",
                      store=postgres.new_database("t_store_down"), max_concurrent_feedback=16)
    url, fb = srv.url, {"Authorization": f"Bearer {FEEDBACK}"}
    ids = [s["record_id"] for s in httpx.post(url + "/generate", json={"prompt": "1+1=", "max_tokens": 4, "n": 4},
                                              timeout=60).json()["samples"]]
    assert all(ids)
    normal = max(_timed(url, "/weights/checksum") for _ in range(3))
    frozen = _cluster(postgres)
    statuses: list[int] = []
    lock = threading.Lock()

    def post(i: int) -> None:
        try:
            status = httpx.post(url + "/v1/feedback", json={"id": ids[i % 4], "reward": 1.0}, headers=fb,
                                timeout=60).status_code
        except httpx.HTTPError:
            status = 0
        with lock:
            statuses.append(status)

    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(24) as pool:
            for i in range(24):
                pool.submit(post, i)
            time.sleep(2)  # up to 16 posts hold (or wait for) the store's threads, the rest are refused
            during = [_timed(url, path) for path in ("/weights/checksum", "/weights/version", "/weights/checksum")]
            health = _timed(url, "/health")
            gen = httpx.post(url + "/generate", json={"prompt": "2+2=", "max_tokens": 4}, timeout=30)
            assert gen.status_code == 200  # answered (its record waits for the store: no record_id)
            for p in frozen:
                p.send_signal(signal.SIGCONT)
    finally:
        for p in frozen:
            p.send_signal(signal.SIGCONT)
    assert statuses.count(429) >= 1, statuses  # over the cap, at once
    assert max(during) <= max(1.0, 5 * normal), (during, normal)
    assert health <= 1.0
    assert len(statuses) == 24 and set(statuses) <= {200, 429, 503}, statuses  # the held ones end once it thaws
