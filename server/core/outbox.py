"""Outbox: the engine's request events gathered into one Outputs message per API process per step.

    outbox = Outbox(loop, send, load)               # the engine core's (server.core.engine_core)
    engine.add_step_listener(outbox.stepped)        # a step's events go out together, once it delivered them
    req = engine.submit(seqs, stream=True, sink=outbox.sink)
    outbox.own(req, peer=b"api-0", rid=7)           # whose request it is (before the loop runs again)
    outbox.drop_peer(b"api-0")                      # that API process is gone: its events are dropped

The engine hands each event to `sink` on its own thread with its lock held (server.engine.engine:
`submit(sink=...)`): the sink only appends it. The engine's step listener (`stepped`, called once a
step delivered all its events) then wakes the core's event loop once; events that come from another
thread (an abort, a shutdown) wake it at once, and those of the engine thread outside a step (a
deadline passed while nothing runs, a failed forward) go with the next heartbeat flush
(server.core.engine_core). `flush` (on the loop) turns everything gathered into messages: a
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
import time
from collections.abc import Callable
from dataclasses import dataclass

from server.core.messages import Done, Event, Failed, Load, Outputs, TraceEnd, Update
from server.engine.engine import EngineEvent, EngineEventTuple, EventPayload
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
                     list(t.tail_steps), t.cache_mode, t.canvas_len, t.trace_free, t.backend, t.block_origin,
                     t.schedule, t.further_horizon, t.logit_bias)
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
        self._events: list[tuple[Request, EngineEventTuple]] = []
        self._scheduled = False
        self._engine_thread: int | None = None  # learnt from the first step
        self._since = 0.0  # when the first event since the last flush came
        self._owned: dict[str, _Owned] = {}  # request_id -> whose it is

    def sink(self, req: Request, event: EngineEventTuple) -> None:
        """Gather one event; from another thread than the engine's, wake the loop (once until the flush)."""
        with self._lock:
            if not self._events:
                self._since = time.monotonic()
            self._events.append((req, event))
            if self._scheduled or threading.get_ident() == self._engine_thread:
                return
            self._scheduled = True
        self._wake()

    def stepped(self, stats: object = None) -> None:
        """(engine thread, the step listener) The step delivered its events: wake the loop to send them."""
        self._engine_thread = threading.get_ident()
        with self._lock:
            if self._scheduled or not self._events:
                return
            self._scheduled = True
        self._wake()

    def stale(self, age_s: float) -> bool:
        """Events have waited longer than `age_s` without a flush (the engine thread's, outside a step)."""
        return bool(self._events) and time.monotonic() - self._since > age_s

    def _wake(self) -> None:
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
    def _event(owned: _Owned, req: Request, kind: EngineEvent, index: int, payload: EventPayload) -> Event | None:
        if kind == EngineEvent.UPDATE and isinstance(payload, tuple):
            ids = payload[0]
            new = ids[owned.sent[index]:]
            owned.sent[index] = len(ids)
            return Update(owned.rid, index, new) if new else None
        if kind == EngineEvent.DONE:
            return done_event(owned.rid, index, req.seqs[index], owned.sent[index])
        return Failed(owned.rid, index, str(payload), req.expired, req.deadline_status if req.expired else 0)


__all__ = ["Outbox", "done_event"]
