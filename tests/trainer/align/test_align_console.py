"""The align console as an operator uses it (issue 25): a short real `dlrl align` run (one rollout
server, two serving replicas, simulated users; a gate every step that lets every candidate pass),
its console page driven in headless Chromium (Playwright with Debian's `chromium`).

Checked: the page renders both replicas and a promotion, it is read-only without the admin token
(buttons disabled, the API answers 401) and never holds the token; with the token, "Pause promotion"
then "Roll back" to the initial version, clicked on the page, change the version every replica
serves (read through the replicas' own admin API) and the registry's serving version; the
controller's /metrics port parses with prometheus_client and counts the promotion, the training
steps and the candidates. The screenshot taken here is docs/align-console.png's source.
"""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from examples.align.local import LocalAlign
from store import open_store
from tests.helpers import admin_get, free_port, wait_until
from tests.server.test_metrics_scrape import families, value
from trainer.align.registry import NO_PRUNE

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
# every candidate passes the gate and the canary: the test is about the console, not the gate
PERMISSIVE = ["tolerance=1", "kl_budget=1000", "max_length_ratio=100", "max_stop_rate_drop=1", "max_empty_frac=1",
              "max_degenerate_frac=1", "canary_window_s=1", "canary_min_requests=1", "canary_max_s=20",
              "rollback_on_error_rate=1", "rollback_on_latency_ratio=100", "rollback_min_feedback=1000000"]


def _config(tmp: Path) -> Path:
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "align.yaml").read_text())
    cfg["train"].update({"tensorboard": False, "prompts_per_step": 4, "group_size": 4, "max_tokens": 6,
                         "filter_zero_variance": False})  # a random model: rewards all 0, still new versions
    cfg["users"].update({"num_users": 2, "think_time_s": 0.3, "feedback_delay_s": 0.3})
    # every promotion stays rollback-able: the page rolls back to the first one's predecessor, and on a quiet
    # box more than 3 promotions can land before it does (the default keeps 3: version 0 was gone)
    cfg["server"]["keep_versions"] = 64
    path = tmp / "align.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _promoted(db: Path) -> list[dict]:
    with open_store(db, **NO_PRUNE) as st:
        return [e for e in st.events() if e["kind"] == "promoted" and not e["detail"].get("initial")]


def _serving(db: Path) -> int | None:
    with open_store(db, **NO_PRUNE) as st:
        return st.serving_version()


def test_console_shows_the_loop_and_rolls_back_from_the_page(chromium, tiny_model_dir, tmp_path):
    from playwright.sync_api import sync_playwright

    db, console_port, metrics_port = tmp_path / "feedback.db", free_port(), free_port()
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    overrides = [f"rollout_servers=[{urls[0]}]", f"serving_replicas=[{urls[1]},{urls[2]}]", f"store={db}",
                 f"output_dir={tmp_path / 'align'}", f"train.model={tiny_model_dir}", "max_steps=0",
                 "promote_every=1", "prompt_source=task", "eval_size=8", "kl_prompts=4", "reconcile_every_s=1",
                 f"console_port={console_port}", f"metrics_port={metrics_port}", *PERMISSIVE]
    stack = LocalAlign(str(_config(tmp_path)), overrides)
    log = lambda: (stack.logs / "align.log").read_text()[-4000:]  # noqa: E731
    console = stack.console_url
    try:
        stack.start_servers()
        stack.start_users()
        align = stack.start_align()
        wait_until(lambda: _promoted(db) or align.poll() is not None, 400, "a promotion")
        assert align.poll() is None, log()
        assert f"dlrl align console: {console}" in log()
        initial = min(v for v in [_promoted(db)[0]["detail"]["previous"]])

        fams = families(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text)
        assert value(fams, "dlrl_align_promotions", "dlrl_align_promotions_total") >= 1
        assert value(fams, "dlrl_align_candidates", "dlrl_align_candidates_total", outcome="promoted") >= 1
        assert value(fams, "dlrl_train_steps", "dlrl_train_steps_total") >= 1
        assert value(fams, "dlrl_train_step_seconds", phase="rollout") > 0
        assert httpx.post(console + "api/pause", timeout=10).status_code == 401  # no token: read-only
        assert httpx.post(console + "api/pause", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 403
        assert httpx.get(console + "api/nothing", timeout=10).status_code == 404

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, bypass_csp=True)  # eval in waits
            page.goto(console)
            page.wait_for_function("document.querySelectorAll('#replicas tr.replica').length === 2")
            page.wait_for_selector("#events li.ev-promoted")
            replicas = page.eval_on_selector_all("#replicas tr.replica", "rows => rows.map(r => r.dataset.url)")
            assert sorted(replicas) == sorted(urls[1:])
            assert page.locator("#candidates tr.candidate").count() >= 1
            # the charts have axis values (issue 38): 0 / 50 / 100 % and wall-clock times
            page.wait_for_function("document.querySelectorAll('#accuracy-chart text.axis.x').length === 3")
            ys = page.eval_on_selector_all("#accuracy-chart text.axis.y", "ts => ts.map(t => t.textContent)")
            assert ys == ["0%", "50%", "100%"], ys
            xs = page.eval_on_selector_all("#accuracy-chart text.axis.x", "ts => ts.map(t => t.textContent)")
            assert all(re.fullmatch(r"\d{1,2}:\d{2}:\d{2}( [AP]M)?", x) for x in xs), xs
            assert page.locator("#feedback-chart text.axis.y").count() in (0, 3)  # no feedback yet: no chart
            assert page.is_disabled("#rollback") and page.is_disabled("#pause")  # read-only without the token
            assert stack.admin_token not in page.content() and stack.feedback_token not in page.content()

            page.fill("#token", stack.admin_token)
            page.click("#pause")
            page.wait_for_function("document.getElementById('paused').textContent.includes('PAUSED')")
            # no promotion in flight before the rollback (none starts while paused)
            wait_until(lambda: not httpx.get(console + "api/state", timeout=10).json()["promotion_in_flight"], 120,
                       "the promotion in flight to finish")
            # hostile rollback bodies, each refused naming what is wrong (asked while no promotion is in flight,
            # which would be refused first: promote_every=1 keeps one in flight most of the time)
            auth = {"Authorization": f"Bearer {stack.admin_token}"}
            for body, status, field in ((b"{not json", 400, "body"), (b'{"version": "x"}', 400, "version"),
                                        (b'{"version": true}', 400, "version"), (b'{"version": 987654}', 409, "987654"),
                                        (b"[" * 5000, 413, "body")):
                r = httpx.post(console + "api/rollback", content=body, headers=auth, timeout=30)
                assert r.status_code == status and field in r.json()["error"], (body[:20], r.text)
            assert _serving(db) not in (None, 987654)  # nothing half-applied
            before = {u: admin_get(u, "/weights/version", stack.admin_token)["version"] for u in urls[1:]}
            assert initial not in before.values()
            page.wait_for_selector(f"#rollback-version option[value='{initial}']", state="attached")
            page.select_option("#rollback-version", str(initial))
            page.click("#rollback")
            page.wait_for_function("document.getElementById('action-result').dataset.action === '/api/rollback' && "
                                   "document.getElementById('action-result').dataset.status !== 'pending'",
                                   timeout=120_000)
            assert page.get_attribute("#action-result", "data-status") == "200", page.text_content("#action-result")
            for u in urls[1:]:
                assert admin_get(u, "/weights/version", stack.admin_token)["version"] == initial
            assert _serving(db) == initial
            page.wait_for_function(f"document.getElementById('serving-version').textContent === '{initial}'")
            page.wait_for_function("[...document.querySelectorAll('#replicas tr.replica')].every(r => "
                                   f"r.dataset.version === '{initial}' && r.cells[2].textContent === '{initial}')")
            page.wait_for_selector("#events li.ev-rollback")
            shot = tmp_path / "align-console.png"
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        docs = ROOT / "docs" / "align-console.png"
        if not docs.exists():  # the committed screenshot came from this test; refresh it by deleting it
            shutil.copy(shot, docs)
        assert align.poll() is None, log()
        assert stack.stop("align", signal.SIGTERM, grace_s=120) == 0, log()
    finally:
        stack.stop_all()
    with open_store(db, **NO_PRUNE) as st:
        kinds = [e["kind"] for e in st.events()]
    assert "promotion_paused" in kinds and "gate_passed" in kinds and "rollback" in kinds


@pytest.fixture(scope="session")
def chromium() -> str:
    from tests.browser import ensure_chromium

    return ensure_chromium()
