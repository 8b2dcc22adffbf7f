"""Engine + Scheduler with a fake backend: continuous batching order, failures, versions, backends."""

from __future__ import annotations

import asyncio

import pytest

from dllm.decoding import Postprocessor, SeqOutput, StepOutput
from dllm.sampling import SamplingParams
from server.engine.backends import BackendUnavailable, create_backend
from server.engine.backends.base import Runner, RunnerInfo
from server.engine.engine import Engine, QueueFull
from server.engine.scheduler import KVBudget
from server.engine.sequence import ServerSequence


class FakeBackend(Runner):
    """Commits one token per step (blocks of one token); a sequence finishes at max_tokens."""

    name, model, tokenizer = "fake", None, None
    block_size, max_len, mask_token_id, vocab_size = 1, 64, 1, 10
    info = RunnerInfo("sdar")

    def __init__(self, max_batch: int = 2):
        self.max_batch, self.batches, self.fail, self.left = max_batch, [], False, []

    @property
    def kv_budget(self):
        return KVBudget(self.max_batch)

    def postprocessor(self):
        return Postprocessor(eos_ids=[], tokenizer=None, max_len=self.max_len, block_size=self.block_size)

    def new_sequence(self, prompt_ids, params):
        return ServerSequence(prompt_ids, params, self.block_size, self.mask_token_id)

    def run(self, batch):
        if self.fail:
            raise RuntimeError("boom")
        self.batches.append(sorted(s.prompt_ids[0] for s in batch.running))
        for s in batch.running:
            if s.block_done:
                s.next_block(owe_cache=False)
            s.block_ids, s.block_done = [5], True
        return StepOutput([SeqOutput(s, True) for s in batch.running], len(batch.running))

    def release(self, seqs):
        self.left += seqs  # the engine's one call: every sequence whose slot came back

    def top_logprobs(self, seq, k):
        raise NotImplementedError

    def close(self):
        pass


def run_engine(fn, max_batch=2, max_queue=8):
    engine = Engine(FakeBackend(max_batch), max_queue=max_queue).start()
    try:
        return asyncio.run(fn(engine))
    finally:
        engine.shutdown()


def seqs(engine, first_id, max_tokens):
    return engine.make_sequences([[first_id]], SamplingParams(max_tokens=max_tokens))


def test_sequences_join_and_leave_the_running_batch():
    async def main(engine):
        await engine.pause()  # queue all three first, so the schedule is deterministic
        reqs = [engine.submit(seqs(engine, i, n)) for i, n in ((2, 2), (3, 5), (4, 3))]
        await engine.resume()
        await asyncio.gather(*(engine.wait(r) for r in reqs))
        return engine.backend.batches

    batches = run_engine(main)
    # 2 and 3 start together; 4 takes 2's slot as soon as it finishes, while 3 keeps running
    assert batches[:2] == [[2, 3], [2, 3]] and batches[2:5] == [[3, 4]] * 3


def test_version_stamped_at_admission_and_n_seeds():
    async def main(engine):
        await engine.apply_update(7, lambda: None)  # the served version, set the one way it is
        s = engine.make_sequences([[2]], SamplingParams(max_tokens=1, seed=10), n=3)
        assert [x.params.seed for x in s] == [10, 11, 12]
        return await engine.wait(engine.submit(s))

    assert {s.trace.version for s in run_engine(main, max_batch=4)} == {7}


def test_step_failure_fails_requests_and_engine_survives():
    async def main(engine):
        engine.backend.fail = True
        with pytest.raises(RuntimeError, match="boom"):
            await engine.wait(engine.submit(seqs(engine, 2, 3)))
        engine.backend.fail = False
        for _ in range(500):  # the engine thread tells the runner at its next schedule, maybe after the error
            if engine.backend.left:
                break
            await asyncio.sleep(0.01)
        failed = list(engine.backend.left)  # the failed sequence's slot came back, and the runner heard of it
        done = await engine.wait(engine.submit(seqs(engine, 3, 2)))
        return done, failed, engine.scheduler.num_free_slots

    done, failed, free = run_engine(main)
    assert done[0].finish_reason == "length" and free == 2 and [s.prompt_ids for s in failed] == [[2]]


def test_queue_full_and_abort_waiting():
    async def main(engine):
        await engine.pause()  # nothing is admitted while paused
        a = engine.submit(seqs(engine, 2, 3) + seqs(engine, 3, 3))
        with pytest.raises(QueueFull):
            engine.submit(seqs(engine, 4, 3))
        engine.abort(a)
        assert [s.finish_reason for s in await engine.wait(a)] == ["abort", "abort"]
        assert engine.num_waiting == 0
        await engine.resume()

    run_engine(main, max_queue=2)


def test_listener_errors_do_not_stop_decoding():
    async def main(engine):
        engine.add_step_listener(lambda stats: 1 / 0)
        return await engine.wait(engine.submit(seqs(engine, 2, 2)))

    assert run_engine(main)[0].finish_reason == "length"


def test_backend_factory_errors(tiny_model_dir):
    with pytest.raises(BackendUnavailable, match="server.backend=lmdeploy: the lmdeploy package is not installed"):
        create_backend("lmdeploy", tiny_model_dir)  # a real backend, whose package this CPU venv lacks
    with pytest.raises(BackendUnavailable, match="unknown"):
        create_backend("vllm", tiny_model_dir)
