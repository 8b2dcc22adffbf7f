"""Admin HTTP client of one server's weight control plane (bodies from weight_sync.protocol).

    c = ControlClient("http://127.0.0.1:8000", token, timeout=300)
    c.begin(BeginRequest(...), my_run_id)       # waits out another run's update (lease), then begins
    c.commit(CommitRequest(...))                # success iff the server applied the version
    c.abort(AbortRequest(version=3, run_id=...))
    c.status()                                  # VersionResponse

`commit` never leaves the two sides disagreeing: a commit answered "pending" (the server
drains in-flight sequences first), one that timed out or lost its connection, are followed
by polling `GET /weights/updates/{v}` until the server says applied or failed; when the
sender's own deadline passes it aborts (refused once the server is applying) and asks once
more, so it reports success exactly when the server applied the update. A server that answers
`unknown` for the version it was committing restarted meanwhile (it lost the staged update):
`ServerRestarted`, so the caller can wait for it and push again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from weight_sync.errors import ServerRestarted, WeightSyncError
from weight_sync.protocol import (
    AbortRequest,
    BeginRequest,
    BeginResponse,
    CommitRequest,
    CommitResponse,
    ConnectRequest,
    ConnectResponse,
    UpdatePhase,
    UpdateState,
    VersionResponse,
)

POLL_S = 0.1
WAIT_LOG_S = 10.0  # a line about a wait for another run's update at least this often
log = logging.getLogger("dlrl.weight_sync")
UNREACHABLE_S = 10.0  # a commit whose server refuses connections this long: the server is gone
# an idle kept-alive connection is dropped here after this, well before the server closes it
# (server.keepalive_timeout_s, 5 s by default): with httpx's own 5 s both ends raced, and a push that
# followed a ~5 s training step reused a connection the server was closing (RemoteProtocolError)
KEEPALIVE_S = 1.0


class HTTPStatusError(WeightSyncError):
    """A server answered a control call with an error status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ControlClient:
    """Admin HTTP calls to one server (httpx, keep-alive)."""

    def __init__(self, url: str, token: str | None, timeout: float):
        import httpx  # lazy: only senders need it

        self.url, self.timeout = url.rstrip("/"), timeout
        self._down_since: float | None = None  # since when the server refuses connections (commit)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                 limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))

    def check(self, resp: Any, step: str) -> dict[str, Any]:
        if resp.status_code < 300:
            return resp.json() if resp.content else {}
        try:
            data = resp.json()
            detail = data.get("detail") or (data.get("error") or {}).get("message") or resp.text
        except (ValueError, AttributeError):
            detail = resp.text
        raise HTTPStatusError(f"{self.url}: {step} failed with HTTP {resp.status_code}: {detail}", resp.status_code)

    def post(self, path: str, body: Any) -> dict[str, Any]:
        return self.check(self.http.post(f"{self.url}{path}", json=body.model_dump()), f"POST {path}")

    def get(self, path: str) -> dict[str, Any]:
        return self.check(self.http.get(f"{self.url}{path}"), f"GET {path}")

    def status(self) -> VersionResponse:
        return VersionResponse.model_validate(self.get("/weights/version"))

    def state(self, version: int) -> UpdateState:
        return UpdateState.model_validate(self.get(f"/weights/updates/{version}"))

    def connect(self, body: ConnectRequest) -> ConnectResponse:
        return ConnectResponse.model_validate(self._post_when_free("/weights/connect", body))

    def begin(self, body: BeginRequest) -> BeginResponse:
        return BeginResponse.model_validate(self._post_when_free("/weights/begin", body))

    def _post_when_free(self, path: str, body: ConnectRequest | BeginRequest) -> dict[str, Any]:
        """POST; while another run's update holds the server, wait for its lease (up to `timeout`)."""
        deadline, idle_retry = time.monotonic() + self.timeout, True
        next_log = time.monotonic()
        while True:
            try:
                return self.post(path, body)
            except HTTPStatusError as e:
                if e.status != 409:
                    raise
                busy = self.status().update
                if busy is None and idle_retry:  # the update that held the server may have just ended
                    idle_retry = False
                    continue
                if busy is None or busy.run_id == body.run_id or busy.phase is not UpdatePhase.RECEIVING \
                        or time.monotonic() > deadline:
                    raise  # a stale version, or nothing to wait for
                idle_retry = True
                if time.monotonic() >= next_log:  # never a silent wait (issue 47)
                    next_log = time.monotonic() + WAIT_LOG_S
                    log.info("%s is receiving run %r's update (version %d, lease %.0f s left): waiting up to %.0f s "
                             "more before %s", self.url, busy.run_id, busy.version, busy.lease_left_s,
                             deadline - time.monotonic(), path)
                time.sleep(min(busy.lease_left_s + 0.1, 1.0))

    def abort(self, body: AbortRequest) -> None:
        self.post("/weights/abort", body)

    def commit(self, body: CommitRequest) -> CommitResponse:
        """Commit and make sure of the outcome; raises WeightSyncError unless the version was applied."""
        import httpx

        t0 = time.monotonic()
        deadline, send, next_log = t0 + self.timeout, True, t0 + WAIT_LOG_S
        self._down_since = None
        while time.monotonic() < deadline:
            if time.monotonic() >= next_log:  # e.g. long in-flight sequences hold the update back: say so
                next_log = time.monotonic() + WAIT_LOG_S
                log.info("waiting for %s to apply version %d (%.0f s so far, at most %.0f s; it applies once "
                         "its in-flight sequences finish, server.weight_sync_drain_timeout_s)", self.url,
                         body.version, time.monotonic() - t0, self.timeout)
            if send:  # (re)send: commit is idempotent on the server
                send = False
                try:
                    resp = CommitResponse.model_validate(self.post("/weights/commit", body))
                    if resp.state == "applied":
                        return resp
                except httpx.TransportError as e:  # timed out or connection lost: the server may still apply
                    self._note_transport_error(e)
                except HTTPStatusError as e:
                    if e.status != 409:  # bad data, non-finite weights, ...: the update failed
                        raise
                    # 409: a commit of this version is already running (a retry raced it): ask
            state = self._state_or_none(body.version)
            if state is not None and state.run_id != body.run_id and state.state is not UpdatePhase.UNKNOWN:
                raise WeightSyncError(f"{self.url}: commit of version {body.version} refused: that update "
                                      f"belongs to run {state.run_id!r}, not to this run {body.run_id!r}")
            if state is not None and state.state is UpdatePhase.APPLIED:
                return CommitResponse(version=body.version, state="applied", served_version=state.served_version)
            if state is not None and state.state is UpdatePhase.UNKNOWN:  # begun and sent, then forgotten
                raise ServerRestarted(self.url, body.version, state.served_version)
            if state is not None and state.state is UpdatePhase.FAILED:
                raise WeightSyncError(f"{self.url}: commit of version {body.version} failed: "
                                      f"{state.reason or state.state}")
            send = state is not None and state.state is UpdatePhase.RECEIVING  # the commit never arrived
            if self._down_since is not None and time.monotonic() - self._down_since > min(UNREACHABLE_S, self.timeout):
                raise WeightSyncError(f"{self.url}: unreachable (connection refused) for "
                                      f"{time.monotonic() - self._down_since:.0f}s during the commit of version "
                                      f"{body.version}: the server is down")
            time.sleep(POLL_S)
        try:  # give up: abort (refused with 409 once applying), then take the server's word
            self.abort(AbortRequest(version=body.version, reason="commit timed out at the sender",
                                    run_id=body.run_id))
        except (WeightSyncError, httpx.TransportError):
            pass
        state = self._state_or_none(body.version)
        if state is not None and state.state is UpdatePhase.APPLIED:
            return CommitResponse(version=body.version, state="applied", served_version=state.served_version)
        raise WeightSyncError(f"{self.url}: commit of version {body.version} did not finish within "
                              f"{self.timeout:g}s (aborted)")

    def _state_or_none(self, version: int) -> UpdateState | None:
        import httpx

        try:
            state = self.state(version)
        except httpx.TransportError as e:
            self._note_transport_error(e)
            return None
        self._down_since = None
        return state

    def _note_transport_error(self, error: Exception) -> None:
        """Remember since when the server refuses connections (a dead process), not a slow answer."""
        import httpx

        if isinstance(error, httpx.ConnectError):
            if self._down_since is None:
                self._down_since = time.monotonic()
        else:
            self._down_since = None

    def close(self) -> None:
        self.http.close()
