"""The scheduler's transitions and the engine's pause state, made explicit: a sequence moves
waiting -> running -> (releasing ->) done only through Scheduler methods (an invalid one raises),
and pause() waits for the drain on a future the engine thread resolves -- it never polls."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import server.engine.engine
from dllm.sampling import SamplingParams
from dllm.trace import FinishReason
from server.engine.engine import Engine, EngineEvent, EngineState
from server.engine.scheduler import InvalidTransition, Request, Scheduler
from server.engine.sequence import SeqStatus
from tests.server.test_server_scheduler import FakeBackend


class GatedBackend(FakeBackend):
    """A FakeBackend whose forwards wait for `gate` (so a test holds a forward in flight)."""

    def __init__(self, max_batch: int = 2):
        super().__init__(max_batch)
        self.gate, self.in_step = threading.Event(), threading.Event()

    def run(self, batch):
        self.in_step.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().run(batch)


class NoSleep:
    """`asyncio` for the engine module, without `sleep`: a pause() that polled would fail."""

    def __getattr__(self, name):
        return getattr(asyncio, name)

    @staticmethod
    async def sleep(*args, **kwargs):
        raise AssertionError("pause() polled with asyncio.sleep")


def make_request(backend, loop, *max_tokens):
    seqs = [backend.new_sequence([i + 2], SamplingParams(max_tokens=n)) for i, n in enumerate(max_tokens)]
    return Request(f"r{max_tokens}", seqs, loop)


def test_scheduler_transitions():
    loop, backend = asyncio.new_event_loop(), FakeBackend()
    try:
        sched = Scheduler(max_queue=8, kv=backend.kv_budget, post=backend.postprocessor())
        a, b = make_request(backend, loop, 3, 3), make_request(backend, loop, 2)
        sched.enqueue(a)
        sched.enqueue(b)
        with pytest.raises(InvalidTransition, match="already scheduled"):
            sched.enqueue(a)
        with pytest.raises(InvalidTransition, match="still waiting"):  # a waiting one must be aborted first
            sched.finish(b.seqs[0])
        assert sched.num_waiting == 3 and sched.waiting_tokens == 3 * 1 + 3 + 3 + 2

        assert sched.schedule(paused=False, version=0, now=0.0).admitted == a.seqs  # two slots: a's two
        assert sched.running == tuple(a.seqs) and sched.waiting == tuple(b.seqs)
        assert all(s.status is SeqStatus.RUNNING for s in a.seqs) and sched.num_free_slots == 0
        assert not sched.is_idle and sched.request_of(a.seqs[0]) is a and sched.requests() == [a, b]

        assert sched.abort(b) == b.seqs and b.seqs[0].finish_reason == FinishReason.ABORT  # waiting: dropped
        assert sched.finish(b.seqs[0]) is b and b.is_finished and sched.waiting_tokens == 0
        assert sched.abort(a) == [] and sched.running == tuple(a.seqs)  # running: released next iteration
        assert sched.take_releases() == a.seqs and sched.running == () and sched.is_idle
        assert [sched.finish(s) for s in a.seqs] == [a, a] and a.is_finished and sched.num_free_slots == 2
        assert {s.status for s in a.seqs} == {SeqStatus.FINISHED}
        assert sched.finish(a.seqs[0]) is None  # done already: nothing left to hand back

        c, d = make_request(backend, loop, 4), make_request(backend, loop, 5, 6)
        sched.enqueue(c)
        sched.enqueue(d)
        sched.schedule(paused=False, version=0, now=0.0)
        assert [(s, r) for s, r in sched.fail(list(sched.running))] == [(c.seqs[0], c), (d.seqs[0], d)]
        assert sched.is_idle and sched.waiting == (d.seqs[1],)
        assert sched.take_all() == [d.seqs[1]] and sched.num_waiting == 0 and sched.waiting_tokens == 0
        assert sched.finish(d.seqs[1]) is d and sched.requests() == []
    finally:
        loop.close()


def test_pause_waits_on_the_drain_without_polling(monkeypatch):
    engine = Engine(GatedBackend(), max_queue=8).start()

    async def main():
        req = engine.submit(engine.make_sequences([[2]], SamplingParams(max_tokens=2)))
        assert await asyncio.to_thread(engine.backend.in_step.wait, 30)  # a forward is in flight

        monkeypatch.setattr(server.engine.engine, "asyncio", NoSleep())  # the engine module's asyncio only
        with pytest.raises(TimeoutError, match="did not drain within 0.05s"):
            await engine.pause(timeout=0.05)  # the forward is still running
        assert engine.state is EngineState.PAUSED and not engine.is_drained and not engine._drain_waiters

        pause = asyncio.create_task(engine.pause())
        await asyncio.wait([pause], timeout=0.2)
        assert not pause.done()  # waits for the forward and the sequence's second one
        t0 = time.monotonic()
        engine.backend.gate.set()
        await asyncio.wait_for(pause, 10)  # woken by the engine thread once drained
        woke_s = time.monotonic() - t0
        monkeypatch.undo()
        assert engine.is_paused and engine.is_drained and req.is_finished
        kinds = [kind async for kind, _, _ in engine.events(req)]
        assert kinds == [EngineEvent.DONE] and kinds == ["done"]  # a str enum: the same on the wire
        late = engine.submit(engine.make_sequences([[3]], SamplingParams(max_tokens=1)))
        await asyncio.sleep(0.1)
        assert engine.num_waiting == 1 and not late.is_finished  # paused: nothing is admitted
        await engine.resume()
        assert engine.state is EngineState.RUNNING
        await engine.wait(late)
        return woke_s

    try:
        assert asyncio.run(main()) < 5
    finally:
        engine.backend.gate.set()
        engine.shutdown()


def test_pause_abort_inflight_and_stopped_state():
    engine = Engine(GatedBackend(), max_queue=8).start()

    async def main():
        req = engine.submit(engine.make_sequences([[2]], SamplingParams(max_tokens=50)))
        assert await asyncio.to_thread(engine.backend.in_step.wait, 30)
        pause = asyncio.create_task(engine.pause(abort_inflight=True))
        await asyncio.sleep(0.05)
        engine.backend.gate.set()  # the forward in flight ends; then the sequence is released
        await asyncio.wait_for(pause, 10)
        (seq,) = await engine.wait(req)
        assert seq.finish_reason == FinishReason.ABORT and engine.num_aborted == 1 and engine.is_drained
        engine.shutdown()
        assert engine.state is EngineState.STOPPED and not engine.is_running
        await engine.resume()  # a stopped engine stays stopped: pause and resume are no-ops
        await engine.pause(timeout=0)
        assert engine.state is EngineState.STOPPED and engine.is_drained

    try:
        asyncio.run(main())
    finally:
        engine.backend.gate.set()
        engine.shutdown()
