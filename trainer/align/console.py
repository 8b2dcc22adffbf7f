"""The align console: one web page served by `dlrl align` on `align.console_port` (0: off).

    console = Console(aligner, token)       # trainer.align.cli starts it after Aligner.prepare()
    console.start()                          # http://<align.console_host>:<align.console_port>/
    console.close()

    GET  /                 the page (trainer/align/static/index.html + console.js: no build step)
    GET  /api/state        JSON: replicas and the versions they serve, the candidate pipeline with each
                           gate's scores against its thresholds, accuracy / feedback over time,
                           feedback-to-serving latency, recent events, kept versions
    POST /api/rollback     {"version": N}  every serving replica back to a version that served
                           (`dlrl versions --rollback`, the same code); bearer admin token
    POST /api/pause        stop starting promotions (the gate still runs); bearer admin token
    POST /api/resume       bearer admin token

Everything it shows comes from the registry (the store `dlrl versions` reads, on its own
connection), the controller's Prometheus metrics (AlignMetrics / TrainMetrics read in-process) and
the replicas' own GET /health (the version each one serves): no second source of truth. Without the token the page is read-only. It never
sends a token, and shows recorded user text (the last prompts and answers users rated) only with
`align.console_show_text: true`.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from typing import Any

import httpx
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.samples import Sample

from store import open_store
from trainer.align.registry import NO_PRUNE, rollback_replicas
from trainer.align.report import event_line

log = logging.getLogger("dlrl.align")
STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/console.js": ("console.js", "text/javascript")}
MAX_BODY = 4096
REPLICA_TTL_S = 1.0
NUM_EVENTS, NUM_CANDIDATES = 40, 30
THRESHOLDS = ("tolerance", "kl_budget", "max_length_ratio", "max_stop_rate_drop", "max_empty_frac",
              "max_degenerate_frac", "canary_window_s", "canary_min_requests", "rollback_on_error_rate",
              "rollback_on_latency_ratio", "rollback_on_reward_drop")
SCORES = ("accuracy", "serving_accuracy", "kl", "mean_length", "stop_rate", "empty_frac", "degenerate_frac")


def _samples(metric: MetricWrapperBase) -> list[Sample]:
    return [s for fam in metric.collect() for s in fam.samples]


class Console:
    def __init__(self, aligner: Any, token: str) -> None:
        self.al, self.cfg, self.token = aligner, aligner.cfg, token
        self.store = open_store(self.cfg.store, **NO_PRUNE)  # its own connection: reads, and a manual rollback
        self._rollback_lock = threading.Lock()
        self._lock = threading.Lock()  # the page's polls come on several threads
        self._events: deque = deque(maxlen=NUM_EVENTS)
        self._event_id = 0
        self._served_at: tuple[float, dict] = (0.0, {})
        self._texts: deque = deque(maxlen=10)
        self._text_seq = 0
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2] if self._server else (self.cfg.console_host, 0)
        host = host.decode() if isinstance(host, bytes) else host  # an AF_INET server's address is a str
        return f"http://{host}:{port}/"

    def start(self) -> str:
        console = self

        class Handler(_Handler):
            pass

        Handler.console = console
        try:
            self._server = ThreadingHTTPServer((self.cfg.console_host, self.cfg.console_port), Handler)
        except OSError as e:
            raise ValueError(f"align.console_port: cannot serve the console on {self.cfg.console_host}:"
                             f"{self.cfg.console_port}: {e}") from None
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="dlrl-console", daemon=True).start()
        return self.url

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.store.close()

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        al, m = self.al, self.al.metrics
        versions = self.store.versions()
        serving = self.store.serving_version()
        canary = al.promo.canary  # the one replica that should serve the candidate; the others the registry's
        served = self._served()
        replicas = [{"url": url, "version": served[url], "target": canary.cand.version
                     if canary is not None and canary.url == url else serving} for url in self.cfg.serving_replicas]
        gated = [v for v in versions if v.get("eval") and "gate_passed" in v["eval"]][-NUM_CANDIDATES:]
        f2s = {s.name: s.value for s in _samples(m.feedback_to_serving) if s.name.endswith(("_sum", "_count"))}
        count = f2s.get("dlrl_align_feedback_to_serving_seconds_count", 0)
        events = self._recent_events()
        out = {
            "time": time.time(), "run_id": al.run_id, "trainer_version": int(al.run.version),
            "serving_version": serving, "promotion_paused": al.promotion_paused,
            "canary_version": al.status()["canary_version"], "promotion_in_flight": bool(al.promo.busy),
            "waiting_version": al.status()["waiting_version"], "replicas": replicas,
            "thresholds": {k: getattr(self.cfg, k) for k in THRESHOLDS},
            "candidates": [self._candidate(v) for v in reversed(gated)],
            "kept": [v["version"] for v in versions if v["status"] in ("serving", "retired")],
            "history": al.run.prom.history() if al.run.prom is not None else [],
            "accuracy": [{"version": v["version"], "time": v["updated"], "accuracy": v["eval"]["accuracy"],
                          "status": v["status"]} for v in versions
                         if v.get("eval") and v["eval"].get("accuracy") is not None],
            "feedback": {s.labels["outcome"]: s.value for s in _samples(m.feedback) if s.name.endswith("_total")},
            "feedback_rate": m.feedback_rate(),
            "feedback_to_serving": {"count": int(count), "mean_s": f2s.get(
                "dlrl_align_feedback_to_serving_seconds_sum", 0) / count if count else None,
                "last": next((e["detail"].get("feedback_to_serving") for e in reversed(events)
                              if e["kind"] == "promoted" and e["detail"].get("feedback_to_serving")), None)},
            "events": [{"id": e["id"], "time": e["time"], "kind": e["kind"], "version": e["version"],
                        "line": event_line(e)} for e in reversed(events)],
            "show_text": self.cfg.console_show_text,
        }
        if self.cfg.console_show_text:
            out["rated"] = self._rated()
        return out

    def _served(self) -> dict[str, int]:
        """What each serving replica serves now (its GET /health; -1: down), read at most every REPLICA_TTL_S."""
        with self._lock:
            if time.monotonic() - self._served_at[0] > REPLICA_TTL_S:
                out = {}
                for url in self.cfg.serving_replicas:
                    try:
                        out[url] = int(httpx.get(url.rstrip("/") + "/health", timeout=2).json()["version"])
                    except (httpx.HTTPError, ValueError, KeyError, TypeError):
                        out[url] = -1
                self._served_at = (time.monotonic(), out)
            return self._served_at[1]

    def _recent_events(self) -> list[dict]:
        """The last NUM_EVENTS events (read incrementally: the registry keeps every event of the run)."""
        with self._lock:
            for e in self.store.events(after_id=self._event_id):
                self._event_id = e["id"]
                self._events.append(e)
            return list(self._events)

    @staticmethod
    def _candidate(v: dict) -> dict:
        ev = v["eval"]
        return {"version": v["version"], "status": v["status"], "step": v["step"], "time": v["updated"],
                "passed": ev.get("gate_passed"), "reasons": ev.get("reasons") or [],
                "scores": {k: ev.get(k) for k in SCORES}, "feedback": (v.get("data") or {}).get("feedback", 0)}

    def _rated(self) -> list[dict]:
        with self._lock:
            return self._rated_locked()

    def _rated_locked(self) -> list[dict]:
        for lab in self.store.labeled(after_seq=self._text_seq, limit=1000):
            self._text_seq = max(self._text_seq, lab.seq)
            self._texts.append({"prompt": lab.record.prompt, "answer": lab.record.text, "reward": lab.reward,
                                "version": lab.record.version})
        return list(self._texts)[::-1]

    # ------------------------------------------------------------------ actions
    def authorized(self, header: str | None) -> bool:
        if not self.token or not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[7:].strip().encode(), self.token.encode())

    def rollback(self, version: int) -> tuple[int, dict]:
        if self.al.promo.busy:  # it would land after the rollback and undo it
            return 409, {"error": "a promotion is in flight: pause promotion, wait until it is over, then roll back"}
        with self._rollback_lock:
            try:
                result = rollback_replicas(self.cfg, self.token, self.store, version)
            except ValueError as e:
                return 409, {"error": str(e)}
        errors = {u: r for u, r in result["replicas"].items() if r.startswith("error")}
        return (502 if errors else 200), result

    def pause(self, paused: bool) -> dict:
        self.al.pause_promotion(paused, by="console")
        return {"promotion_paused": self.al.promotion_paused}


class _Handler(BaseHTTPRequestHandler):
    console: Console
    server_version = "dlrl-console"

    def log_message(self, fmt: str, *args: Any) -> None:  # the controller's log, at debug
        log.debug("console: " + fmt, *args)

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj, default=str).encode())

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in STATIC:
            name, ctype = STATIC[path]
            return self._send(200, files("trainer.align.static").joinpath(name).read_bytes(), ctype)
        if path == "/api/state":
            try:
                return self._json(200, self.console.state())
            except Exception as e:  # a busy store: the page retries at its next poll
                log.warning("console state failed: %r", e)
                return self._json(503, {"error": f"state unavailable: {type(e).__name__}"})
        self._json(404, {"error": f"no such page: {path}"})
        return None

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/api/rollback", "/api/pause", "/api/resume"):
            return self._json(404, {"error": f"no such action: {path}"})
        if not self.console.token:
            return self._json(403, {"error": "actions are disabled: no admin token configured"})
        header = self.headers.get("Authorization")
        if not header:
            return self._json(401, {"error": "authorization: the admin token is required (Bearer)"})
        if not self.console.authorized(header):
            return self._json(403, {"error": "authorization: wrong admin token"})
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit() or int(length) > MAX_BODY:
            return self._json(413, {"error": f"body: at most {MAX_BODY} bytes"})
        raw = self.rfile.read(int(length)) if int(length) else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return self._json(400, {"error": "body: not JSON"})
        if path == "/api/rollback":
            version = body.get("version") if isinstance(body, dict) else None
            if not isinstance(version, int) or isinstance(version, bool) or version < 0:
                return self._json(400, {"error": "version: a non-negative integer is required"})
            return self._json(*self.console.rollback(version))
        self._json(200, self.console.pause(path == "/api/pause"))
        return None
