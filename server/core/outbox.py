"""Outbox: the engine's request events gathered into one Outputs message per API process per step.

    outbox = Outbox(loop, send, load)               # the engine core's (server.core.engine_core)
    req = engine.submit(seqs, stream=True, sink=outbox.sink)
    outbox.own(req, peer=b"api-0", rid=7)           # whose request it is (before the loop runs again)
    outbox.drop_peer(b"api-0")                      # that API process is gone: its events are dropped

The engine hands each event to `sink` on its own thread with its lock held (server.engine.engine:
`submit(sink=...)`): the sink only appends it and, for the first event since the last flush, wakes
the core's event loop once. `flush` (on the loop) turns everything gathered into messages: a
streamed sequence's new completion ids (`Update`: only the ids it did not send yet), an ended one's
final record (`Done`: the rest of its ids, its trace, error, top log-probabilities, timings), a
failed one's error (`Failed`); grouped by API process, each group one `Outputs` with the core's
load. So a step of 256 streamed sequences costs the engine thread 256 appends and one wake-up,
and its API process one message. Text is not sent: API processes detokenise (server.core.client), block
by block as the core commits them (every request streams inside the core; the API process passes
the updates of those that asked for a stream on to them).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.core.messages import Done, Event, Failed, Load, Outputs, TraceEnd, Update
from server.engine.engine import EngineEvent
from server.engine.scheduler import Request
from server.engine.sequence import ServerSequence


@dataclass
class _Owned:
    peer: bytes
    rid: int
    left: int  # sequences whose end (Done / Failed) was not sent yet
    sent: list[int]  # per sequence: completion ids sent in Updates


def done_event(rid: int, index: int, seq: ServerSequence, num_sent: int) -> Done:
    t = seq.trace
    trace = TraceEnd(list(t.steps), list(t.logprobs), t.version, t.finish_reason, list(t.tail_ids),
                     list(t.tail_steps), t.cache_mode, t.canvas_len, t.trace_free, t.backend)
    top = [[(int(i), float(v)) for i, v in row] for row in seq.top_logprobs] if seq.top_logprobs is not None else None
    return Done(rid, index, list(seq.completion_ids[num_sent:]), trace, seq.error, seq.num_forwards, top,
                seq.params.stop_token_ids, (seq.arrived_at, seq.admitted_at, seq.first_token_at, seq.finished_at))


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop, send: Callable[[bytes, Outputs], None],
                 load: Callable[[], Load], ended: Callable[[bytes, int], None] | None = None):
        """`send(peer, outputs)` sends a message; `load()` is the core's load now; `ended(peer, rid)` is told
        when a request's last event went out."""
        self._loop, self._send, self._load, self._ended = loop, send, load, ended
        self._lock = threading.Lock()
        self._events: list[tuple[Request, tuple[Any, ...]]] = []
        self._scheduled = False
        self._owned: dict[str, _Owned] = {}  # request_id -> whose it is

    def sink(self, req: Request, event: tuple[Any, ...]) -> None:
        """(engine thread, or the loop) Gather one event; wake the loop for the first since the last flush."""
        with self._lock:
            self._events.append((req, event))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self.flush)
        except RuntimeError:  # the loop is closed: the core is stopping
            pass

    def own(self, req: Request, peer: bytes, rid: int) -> None:
        """(loop) Record whose request `req` is: call before the loop runs anything else (flush needs it)."""
        self._owned[req.request_id] = _Owned(peer, rid, len(req.seqs), [0] * len(req.seqs))

    def drop_peer(self, peer: bytes) -> None:
        """(loop) Forget an API process's requests: their later events go nowhere."""
        for key in [k for k, o in self._owned.items() if o.peer == peer]:
            del self._owned[key]

    @property
    def num_owned(self) -> int:
        return len(self._owned)

    def flush(self) -> set[bytes]:
        """(loop) Send what was gathered: one Outputs per API process; returns the processes sent to."""
        with self._lock:
            events, self._events, self._scheduled = self._events, [], False
        if not events:
            return set()
        by_peer: dict[bytes, list[Event]] = {}
        for req, (kind, index, payload) in events:
            owned = self._owned.get(req.request_id)
            if owned is None:
                continue
            event = self._event(owned, req, kind, index, payload)
            if event is None:
                continue
            by_peer.setdefault(owned.peer, []).append(event)
            if not isinstance(event, Update):
                owned.left -= 1
                if owned.left <= 0:
                    del self._owned[req.request_id]
                    if self._ended is not None:
                        self._ended(owned.peer, owned.rid)
        if by_peer:
            load = self._load()
            for peer, out in by_peer.items():
                self._send(peer, Outputs(out, load))
        return set(by_peer)

    @staticmethod
    def _event(owned: _Owned, req: Request, kind: Any, index: int, payload: Any) -> Event | None:
        if kind == EngineEvent.UPDATE:
            ids = payload[0]
            new = ids[owned.sent[index]:]
            owned.sent[index] = len(ids)
            return Update(owned.rid, index, new) if new else None
        if kind == EngineEvent.DONE:
            return done_event(owned.rid, index, req.seqs[index], owned.sent[index])
        return Failed(owned.rid, index, str(payload), req.expired, req.deadline_status if req.expired else 0)


__all__ = ["Outbox", "done_event"]
