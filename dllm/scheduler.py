"""The scheduler: which sequences run in the next forward, and the one owner of their KV pages and status.

    sched = Scheduler(runner.kv_budget, runner.postprocessor())
    sched.add(seq)                               # NEW -> WAITING
    batch = sched.schedule(version=0)            # retire older versions' cached pages; grow / preempt
                                                 # (optimistic); admit FIFO while a slot and pages are free
    out = runner.run(batch)                      # the runner's step (dllm.runner.BlockRunner)
    ended = sched.postprocess(batch, out)        # stop rules; finish reasons; their pages and slots back

That loop is the whole of standalone decoding (`dllm.decoding.generate`) and of the server's engine
step (server.engine.engine, whose Scheduler extends this one with requests, deadlines and queue
bounds): nano-vllm's and vLLM v1's shape. The scheduler decides; its block manager
(dllm.block_manager: slots, page tables, reference counts, the free list, the prefix cache) holds
the account; a runner only computes. One writer each: a sequence's `status` and `finish_reason`
(`_end`) are written here, its `slot`, `block_table` and `num_cached_tokens` by the block manager, and
its pages and slot come back only through `_release` -- the runner learns of every sequence that
left (`batch.left`) and drops whatever it keeps of it (the native runner keeps nothing).

Admission (`KVBudget`): a sequence is admitted when a slot is free and the free list holds its
pages -- prompt + max_tokens (reserve), or only what its next forward touches (optimistic: its
pages then grow block by block, and when the running sequences' next blocks do not fit the newest
ones are preempted: back to the queue's front, pages given back, re-admitted first; they keep their
tokens, trace and version, and the runner recomputes their prefix, vLLM's preemption by recompute).
Prefix sharing: the pages of a sequence's cached prompt blocks are shared, not taken (the block
manager). A sequence is stamped with the served `version` at its first admission (a preempted one
keeps its own), and the block manager keys its cached pages by it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from dllm.block_manager import BlockManager, KVBudget
from dllm.postprocess import Postprocessor, StepOutput
from dllm.sequence import SeqStatus, Sequence
from dllm.trace import FinishReason

S = TypeVar("S", bound=Sequence)  # the sequences scheduled (the server's ServerSequence)


@dataclass
class ScheduledBatch(Generic[S]):
    """One engine step, as the scheduler planned it."""

    running: list[S]  # the forward's batch, oldest first (admitted ones included)
    admitted: list[S]  # new in this step: slot and pages given (seq.block_table), prefix found (num_cached_tokens)
    preempted: list[S] = field(default_factory=list)  # out of the batch, back to waiting: pages taken back
    left: list[S] = field(default_factory=list)  # left since the last step (ended, aborted, failed): pages and
    # slot already back; the runner drops what it keeps of them (Runner.release)
    tables: np.ndarray | None = None  # [num_slots, max_pages] the block manager's page tables (read-only)
    released: list[S] = field(default_factory=list)  # (server) aborted while running: out of the batch, done
    dropped: list[S] = field(default_factory=list)  # (server) aborted while waiting (deadline): done, never ran
    num_cache_refused: int = 0  # waiting sequences a free slot could take but the KV pages could not


class Scheduler(Generic[S]):
    def __init__(self, kv: KVBudget, post: Postprocessor) -> None:
        self.kv, self.post = kv, post
        self.blocks = BlockManager(kv)
        self._waiting: deque[S] = deque()
        self._running: list[S] = []
        self._left: list[S] = []  # released since the last schedule (batch.left)

    # ------------------------------------------------------------------ reading
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_slots(self) -> int:
        return self.blocks.num_free_slots

    @property
    def free_pages(self) -> int:
        """Pages a new sequence may take now (free, or cached by no running sequence)."""
        return self.blocks.num_free_pages

    @property
    def has_left(self) -> bool:
        """Sequences released since the last schedule: the runner has yet to hear of them (batch.left)."""
        return bool(self._left)

    @property
    def is_done(self) -> bool:
        """Nothing runs, nothing waits (standalone decoding is over)."""
        return not (self._running or self._waiting)

    # ------------------------------------------------------------------ transitions
    def add(self, seq: S) -> None:
        """NEW -> WAITING (standalone decoding; the server's enqueue does this for a whole request)."""
        seq.status = SeqStatus.WAITING
        self._waiting.append(seq)

    def schedule(self, *, version: int, paused: bool = False, now: float = 0.0) -> ScheduledBatch[S]:
        """One step's batch: older versions' cached pages retired; the running sequences' next pages
        (optimistic; the newest preempted while they do not fit); waiting ones admitted FIFO while a slot
        and their pages are free (`paused`: only preempted ones go on). `now`: the server's clock."""
        self.blocks.retire(version)
        preempted = self._grow() if self.kv.optimistic and self.kv.num_pages else []
        admitted, refused = self._admit(version, paused, {s.seq_id for s in preempted})
        left, self._left = self._left, []
        return ScheduledBatch(list(self._running), admitted, preempted, left, self.blocks.tables,
                              num_cache_refused=refused)

    def _grow(self) -> list[S]:
        """Optimistic admission: every running sequence gets the pages of its next forward, the newest
        preempted (back to the queue's front) while they do not fit; returns the preempted."""
        preempted: list[S] = []
        while len(self._running) > 1 and self.blocks.deficit(self._running):
            seq = self._running.pop()  # the newest admitted
            self.blocks.release(seq)
            seq.status = SeqStatus.WAITING
            seq.num_preemptions += 1
            self._waiting.appendleft(seq)
            preempted.append(seq)
        for s in self._running:
            self.blocks.grow(s)
        return preempted

    def _admit(self, version: int, only_preempted: bool, just: set[int]) -> tuple[list[S], int]:
        """WAITING -> RUNNING, FIFO, while a slot and the pages are free; (admitted, how many more waiting
        ones a free slot could take but the pages could not). `just`: preempted by this very step."""
        admitted: list[S] = []
        while self._waiting:
            seq = self._waiting[0]
            if seq.seq_id in just or (only_preempted and not seq.num_preemptions):
                break
            own = seq.trace.version if seq.num_preemptions else version  # a preempted one keeps its version
            if not self.blocks.can_admit(seq, own):
                break
            self._waiting.popleft()
            seq.trace.version = own
            self.blocks.admit(seq, own)
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
        self._running.extend(admitted)
        return admitted, min(len(self._waiting), self.blocks.num_free_slots)

    def postprocess(self, batch: ScheduledBatch[S], out: StepOutput, now: float = 0.0) -> list[S]:
        """The runner's outputs -> the sequences that ended (stop ids, stop strings, max_tokens, a failed
        row): finish reason written, pages and slot back, out of the running batch."""
        self.blocks.confirm()  # the step ran: the prompt pages it computed may serve later sequences
        of = {s.seq_id: s for s in batch.running}
        ended = []
        for e in self.post.decide(out.outputs):  # outputs of batch.running
            seq = of[e.seq.seq_id]
            self._end(seq, e.reason, e.error)
            self._release(seq)
            ended.append(seq)
        if ended:
            gone = {s.seq_id for s in ended}
            self._running = [s for s in self._running if s.seq_id not in gone]
        return ended

    def fail_forward(self, seqs: Seq[S], error: str) -> None:
        """A forward that raised: its sequences end ("error"), nothing it was to compute is cached."""
        self.blocks.forget_owed()
        gone = {s.seq_id for s in seqs}
        for s in seqs:
            self._end(s, FinishReason.ERROR, error)
            self._release(s)
        self._running = [s for s in self._running if s.seq_id not in gone]

    # ------------------------------------------------------------------ the one writer of each part
    def _end(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Write why `seq` ended (once: a reason already written stays)."""
        if seq.finish_reason is None:
            seq.finish_reason = reason
            if error is not None and seq.error is None:
                seq.error = error

    def _release(self, seq: S) -> None:
        """Its pages and slot back (once); the runner hears of it (batch.left) if it ever ran."""
        if self.blocks.holds(seq):
            self.blocks.release(seq)
            self._left.append(seq)
