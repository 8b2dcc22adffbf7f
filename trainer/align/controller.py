"""`dlrl align`: the trainer in continuous mode, built from the parts of `dlrl train`.

    al = Aligner(run, align_cfg, store, pool, should_stop)    # run = trainer.run.build_run(...)
    al.prepare()               # serving version, its weights and scores; replicas reconciled
    align_loop(al)             # train_loop(run, should_stop, al): until stopped, max_steps or max_seconds

The Aligner is the training loop's hooks (`trainer.loop.LoopHooks`): `rl_step` and `train_loop`
run the step, the stop, the checkpoints and the log; the Aligner adds what continuous mode does
around them (the batch, the registry, the gate and the promotions).

One step (`trainer.loop.rl_step` with `Aligner.collect` and `Aligner.stepped`): new feedback read
from the store -> the step's share of feedback records (none staler
than `align.max_staleness` versions) -> on-policy rollouts for the rest (`trainer.loop.collect`,
prompts from the growing source) -> `trainer.loop.learn` on the mixed batch (feedback rewards
are the users'; importance weights from the recorded behaviour log-probs, `trainer.rl.correction`;
advantages: see `trainer.align.data`) -> push to the rollout servers (`Publisher.push`) -> the
new version in the registry (parent, step, data consumed). Every `align.promote_every` steps the
policy is a candidate: the gate (`trainer.align.gate`) on the rollout servers, then the rolling
promotion to the serving replicas (`trainer.align.promote`), watched between the next steps (the
gate runs when due even during a promotion; a candidate that passes then waits for it, and a
newer one that passes replaces it: status `superseded`). A candidate stopped by the gate or rolled back on the canary sends the policy back to the serving
weights (`align.on_gate_fail=revert`, Adam moments reset) or lets it train on (`continue`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from dllm.weights import copy_into_model, parse_dtype
from trainer.align.bank import WeightBank
from trainer.align.data import AlignReward, FeedbackBuffer, MixedBatch, PromptPool
from trainer.align.gate import Gate, GateResult
from trainer.align.metrics import AlignMetrics, CountedStore
from trainer.align.promote import Candidate, FeedbackTally, Promoter
from trainer.align.report import plot_serving
from trainer.infra.ds_engine import named_full_params
from trainer.loop import LoopHooks, collect, rl_step, train_loop
from trainer.monitor.metrics_log import plot_curves
from trainer.monitor.train_metrics import TrainMetrics
from trainer.rl.rollouts import Batch

if TYPE_CHECKING:
    from store import FeedbackStore
    from trainer.align.config import AlignConfig
    from trainer.align.replicas import ServingPool
    from trainer.run import Run

log = logging.getLogger("dlrl.align")


def policy_weights(run: Run) -> dict:
    """CPU copies of the policy's parameters ({name: tensor})."""
    return dict(named_full_params(run.learner.engine))


class Aligner(LoopHooks):
    """The controller of `dlrl align`: the training loop's hooks for continuous mode."""

    def __init__(self, run: Run, cfg: AlignConfig, store: FeedbackStore, pool: ServingPool,
                 should_stop: Callable[[], bool] = lambda: False) -> None:
        self.metrics = AlignMetrics()
        store = cast("FeedbackStore", CountedStore(store, self.metrics))  # outcomes counted from the events it logs
        self.run, self.cfg, self.store, self.pool, self.should_stop = run, cfg, store, pool, should_stop
        self.tally = FeedbackTally()
        max_len = run.learner.engine.module.config.max_position_embeddings
        self.feedback = FeedbackBuffer(store, run.block_size, max_len, cfg.feedback_buffer)
        reference = copy.deepcopy(run.learner.engine.module).eval().requires_grad_(False)
        self.bank = WeightBank(run.out / "promoted", reference, cfg.keep_versions)
        self.base_reward = run.reward_fn
        self.step_no = run.start_step
        run.reward_fn = AlignReward(self.base_reward)
        self.gate = Gate(cfg, run.cfg, run.eval_examples, self.base_reward, run.prompt_ids, run.mask_id,
                         run.block_size, run.pad_id)
        self.run_id = run.fleet.sync_options.get("run_id") or run.out.name
        self.pending: list[tuple[int, float]] = []  # (version trained on it, feedback time), not serving yet
        self.serving_scores: dict = {}
        self.last_candidate = -1
        self.waiting: Candidate | None = None  # passed the gate while a promotion was in flight
        self.taken: list = []  # the feedback samples of the step in flight
        self.stale_before = 0
        self.t_start: float | None = None
        self.promoter: Promoter | None = None
        self.counts = {"promotions": 0, "rollbacks": 0, "gate_failed": 0, "reverts": 0}
        self.promotion_paused = False  # the console's pause: candidates that pass the gate wait (newest kept)
        if run.prom is None:  # the training step metrics on the controller's port (trainer.monitor.train_metrics)
            run.prom = TrainMetrics(self.metrics.registry)

    @property
    def promo(self) -> Promoter:
        """The promoter, which prepare() opens (RuntimeError before)."""
        if self.promoter is None:
            raise RuntimeError("the aligner is not prepared: prepare() opens its promoter")
        return self.promoter

    # ------------------------------------------------------------------ start
    def prepare(self) -> None:
        """Versions past the registry's, the serving version's weights and scores, replicas reconciled."""
        run, store = self.run, self.store
        serving = store.serving_version()
        if serving is None:
            serving = self._register_initial()
        elif not self.bank.has(serving):
            raise RuntimeError(f"align.output_dir: the registry's serving version {serving} has no saved weights "
                               f"in {self.bank.root} (was align.output_dir changed?)")
        top = max([v["version"] for v in store.versions()] + [v for v in self.pool.versions().values() if v])
        if run.publisher.adopt(top):  # never reuse a version number a replica or the registry knows
            run.publisher.check_fleet()  # the rollout servers get the policy under that number
        self.bank.set_reference(serving)
        self.promoter = Promoter(self.cfg, store, self.pool, self.bank, self.metrics, self.tally,
                                 serving_version=serving, poll=self.poll_feedback, on_promoted=self._promoted,
                                 on_rejected=self._canary_rejected, on_adopted=self._adopted)
        if run.resumed_extra:
            self.load_state_dict(run.resumed_extra)
        self.promo.reconcile()
        self.serving_scores = self._scores_of(serving)
        self.metrics.serving_version.set(serving)
        self.metrics.serving_accuracy.set(self.serving_scores["accuracy"])
        self.metrics.trainer_version.set(run.version)
        if self.cfg.metrics_port:
            self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        log.info("serving version %d (held-out accuracy %.1f%%), trainer at version %d", serving,
                 100 * self.serving_scores["accuracy"], run.version)

    def _register_initial(self) -> int:
        """First run on this store: the replicas' version is the serving one; they must hold the
        trainer's starting weights (checked by digest)."""
        versions = {u: v for u, v in self.pool.versions().items() if v is not None}
        if not versions:
            raise RuntimeError("align.serving_replicas: no serving replica answers")
        serving = max(versions.values())
        self.bank.put(serving, policy_weights(self.run))
        for url in versions:
            served = self.pool.served_dtype(url)
            if self.pool.checksum(url) != self.bank.digest(serving, parse_dtype(served) if served else None):
                raise RuntimeError(f"align.serving_replicas: {url} serves other weights than the trainer's model "
                                   f"{self.run.model_dir} and the registry ({self.cfg.store}) names no serving "
                                   "version; start the replicas with the same model")
        self.store.register_version(serving, None, self.run.start_step, self.run_id,
                                    {"initial": str(self.run.model_dir)})
        self.store.update_version(serving, status="serving")
        self.store.log_event("promoted", serving, detail={"initial": True})
        return serving

    def _scores_of(self, version: int) -> dict:
        """Held-out scores of a serving version: from the registry, else evaluated on the replicas."""
        registered = self._row(version).get("eval") or {}
        if registered.get("accuracy") is not None:
            return registered
        scores = self.gate.scores(self.pool.generate)
        self.store.update_version(version, eval=scores)
        return scores

    # ------------------------------------------------------------------ one step
    def poll_feedback(self) -> None:
        before = dict(self.feedback.counts)
        self.feedback.poll(lambda s: self.tally.add(s.feedback_time, s.rollout.version, s.reward))
        self.metrics.count_feedback({k: self.feedback.counts[k] - before.get(k, 0) for k in self.feedback.counts})

    def step(self, step: int) -> dict[str, Any]:
        """One training step (0-based `step`); returns its metrics."""
        return rl_step(self.run, step, self)

    def collect(self, run: Run, step: int) -> Batch:
        """The step's batch: its share of feedback records, on-policy rollouts for the rest."""
        cfg, G = self.cfg, run.cfg.group_size
        self.step_no = step
        self.poll_feedback()
        self.stale_before = self.feedback.counts["stale"]
        serving = self.promo.serving_version  # its records (and its canary's) are never stale
        self.feedback.drop_stale(run.version, cfg.max_staleness, serving)
        want = int(cfg.feedback_ratio * run.cfg.prompts_per_step) * G
        self.taken = self.feedback.take(min(want, len(self.feedback) // G * G), run.version, cfg.max_staleness,
                                        serving)
        if not isinstance(run.sampler, PromptPool):
            raise TypeError("dlrl align draws its prompts from a PromptPool (trainer.align.cli)")
        run.sampler.batch_size = run.cfg.prompts_per_step - len(self.taken) // G
        return MixedBatch(collect(run), self.taken, G)

    def version_data(self, step: int) -> dict[str, Any]:
        """More of what the registry records of the version step `step` (0-based) pushed."""
        return {}

    def stepped(self, run: Run, step: int, batch: Batch, parent: int) -> dict[str, Any]:
        """The step's feedback counted, its version (if it pushed one) in the registry."""
        taken, stale = self.taken, self.feedback.counts["stale"] - self.stale_before
        self.metrics.count_feedback({"used": len(taken), "stale": stale})
        if run.version != parent:
            on_policy = batch.num_on_policy if isinstance(batch, MixedBatch) else len(batch.examples)
            self.store.register_version(run.version, parent, step + 1, self.run_id, {
                "on_policy": len(batch.rollouts) - len(taken), "feedback": len(taken), "feedback_stale": stale,
                "prompts": on_policy, **self.version_data(step)})
            self.pending += [(run.version, s.feedback_time) for s in taken]
        self.metrics.steps.inc()
        self.metrics.trainer_version.set(run.version)
        return {"feedback_used": len(taken), "feedback_stale": stale, "feedback_waiting": len(self.feedback),
                "feedback_rate": self.metrics.feedback_rate()}

    def done(self, run: Run, step: int) -> bool:
        """`align.max_steps` taken or `align.max_seconds` gone (0: neither; until stopped)."""
        if self.t_start is None:
            self.t_start = time.monotonic()
        cfg = self.cfg
        return bool((cfg.max_steps and step >= cfg.max_steps)
                    or (cfg.max_seconds and time.monotonic() - self.t_start >= cfg.max_seconds))

    def after(self, run: Run, step: int, metrics: dict[str, Any], should_stop: Callable[[], bool]) -> dict[str, Any]:
        """The gate when due, the promotion in flight watched, a waiting candidate started."""
        out = self.maybe_promote(step)
        self.promo.tick()
        if not should_stop():
            self.start_waiting()
        return out | self.status()

    def logged(self, run: Run, step: int, metrics: dict[str, Any]) -> None:
        if metrics.get("candidate_version"):
            _plot(run)

    def stopping(self) -> None:
        self.stop_promotions("stopped by a signal")

    def extra(self) -> dict[str, Any]:
        return self.state_dict()

    def finish(self, run: Run, step: int, metrics: dict[str, Any], should_stop: Callable[[], bool]) -> dict[str, Any]:
        """The promotion in flight, then the one of the candidate that waited for it; a checkpoint."""
        for _ in range(2):
            self.promo.finish(self.cfg.canary_max_s + 120, should_stop)
            if not should_stop():
                self.start_waiting()
        if should_stop():
            self.stopping()
        run.checkpoint(step, metrics, extra=self.state_dict())
        _plot(run)
        return metrics | self.status()

    # ------------------------------------------------------------------ gate and promotion
    def maybe_promote(self, step: int) -> dict:
        """After step `step` (1-based): gate the policy if it is due; returns gate metrics.

        The gate runs on the rollout servers, so it runs when due even while a promotion is in
        flight on the serving replicas: a bad policy is stopped (and reverted) at once, not one
        promotion later. A candidate that passes while a promotion is in flight waits for it
        (`start_waiting`; a newer one that passes replaces it)."""
        run, cfg = self.run, self.cfg
        if step % cfg.promote_every:
            return {}
        self.promo.reconcile()  # the serving version to compare with (a manual rollback wins)
        if run.version in (self.last_candidate, self.promo.serving_version):
            return {}
        v = self.last_candidate = run.version
        t0 = time.perf_counter()
        cand = self.gate.scores(run.fleet.generate)  # the rollout servers hold version v
        cand |= self.gate.kl(run.fleet.generate, run.learner.engine.module, self.bank.reference, seed=step)
        result = self.gate.check(cand, self.serving_scores)
        self._record_gate(v, result)
        self.metrics.gate.labels(result="pass" if result.passed else "fail").inc()
        for name, ok in result.checks.items():
            self.metrics.gate_check.labels(check=name).set(float(ok))
        self.metrics.candidate_accuracy.set(cand["accuracy"])
        self.metrics.candidate_kl.set(cand["kl"])
        out = {"eval_accuracy": cand["accuracy"], "candidate_version": v, "candidate_kl": cand["kl"],
               "gate_passed": int(result.passed), "time_gate": time.perf_counter() - t0}
        if result.passed:
            log.info("version %d passed the gate (accuracy %.1f%% vs serving %.1f%%, KL %.4f)", v,
                     100 * cand["accuracy"], 100 * self.serving_scores["accuracy"], cand["kl"])
            feedback_times = [ft for ver, ft in self.pending if ver <= v]
            candidate = Candidate(v, step, policy_weights(run), result, feedback_times)
            self.store.log_event("gate_passed", v, detail={
                "scores": cand, "serving_accuracy": self.serving_scores["accuracy"],
                "serving_version": self.promo.serving_version})
            self.supersede(f"version {v} passed the gate after it")
            if self.promo.busy or self.promotion_paused:
                self.waiting = candidate
                self.store.update_version(v, status="candidate")
                canary = self.promo.canary  # not None when not paused: busy
                log.info("version %d waits: %s", v, "promotion is paused" if self.promotion_paused or canary is None
                         else f"the promotion of version {canary.cand.version} is in flight")
            else:
                self.promo.start(candidate)
        else:
            self._gated_out(v, result.reasons, cand)
            self._rejected(Candidate(v, step, {}, result), result.reasons)
        return out

    def start_waiting(self) -> None:
        """The candidate that passed the gate during a promotion starts its own when that one is
        over, checked again against the serving version's scores if the serving version changed."""
        cand = self.waiting
        if cand is None or self.promo.busy or self.promotion_paused:
            return
        self.waiting = None
        if cand.gate.serving != self.serving_scores:
            result = self.gate.check(cand.gate.candidate, self.serving_scores)
            if not result.passed:  # no better than the version promoted meanwhile; the policy trains on
                self._record_gate(cand.version, result)  # the registry keeps the check that stopped it
                self._gated_out(cand.version, result.reasons, cand.gate.candidate,
                                serving_version=self.promo.serving_version)
                return
            cand.gate = result
        self.promo.start(cand)

    def _record_gate(self, v: int, result: GateResult) -> None:
        """The gate's scores and verdict for version `v`, against the serving version, in the registry."""
        self.store.update_version(v, eval={**result.candidate, "gate_passed": result.passed,
                                           "reasons": result.reasons, "serving_version": self.promo.serving_version,
                                           "serving_accuracy": result.serving["accuracy"]})

    def _gated_out(self, v: int, reasons: list[str], scores: dict, **extra: object) -> None:
        log.warning("version %d stopped by the gate: %s", v, "; ".join(reasons))
        self.store.update_version(v, status="gated_out")
        self.store.log_event("gate_failed", v, detail={"reasons": reasons, "scores": scores, **extra})
        self.counts["gate_failed"] += 1

    def pause_promotion(self, paused: bool, by: str = "") -> None:
        """The console's pause / resume: while paused no promotion starts (the gate still runs; the
        newest candidate that passes waits, and starts after resume). Recorded in the registry."""
        if paused != self.promotion_paused:
            self.promotion_paused = paused
            self.metrics.promotion_paused.set(float(paused))
            self.store.log_event("promotion_paused" if paused else "promotion_resumed",
                                 self.promo.serving_version, detail={"by": by})
            log.warning("promotion %s%s", "paused" if paused else "resumed", f" ({by})" if by else "")

    def stop_promotions(self, why: str) -> None:
        """A stop: the promotion in flight is aborted (the canary goes back to the serving version)
        and the waiting candidate dropped; the policy is kept as it is for the checkpoint."""
        self.promo.abort(why)
        self.supersede(why)

    def supersede(self, why: str) -> None:
        """The candidate waiting for a promotion is dropped (a newer one, a revert, the end of the run)."""
        if self.waiting is not None:
            v, self.waiting = self.waiting.version, None
            self.store.update_version(v, status="superseded")
            self.store.log_event("superseded", v, detail={"reason": why})
            log.info("version %d will not be promoted: %s", v, why)

    def _promoted(self, cand: Candidate) -> None:
        self.serving_scores = dict(cand.gate.candidate)
        self.bank.set_reference(cand.version)
        self.pending = [(ver, ft) for ver, ft in self.pending if ver > cand.version]
        self.metrics.serving_accuracy.set(self.serving_scores["accuracy"])
        self.counts["promotions"] += 1

    def _adopted(self, version: int) -> None:
        """The registry's serving version changed outside this process (a manual rollback)."""
        if not self.bank.has(version):
            raise RuntimeError(f"the registry's serving version is now {version}, whose weights are not saved in "
                               f"{self.bank.root}; roll back to a version this run promoted")
        self.bank.set_reference(version)
        self.serving_scores = self._scores_of(version)
        self.metrics.serving_accuracy.set(self.serving_scores["accuracy"])
        self.metrics.rollbacks.labels(kind="manual").inc()

    def _canary_rejected(self, cand: Candidate, reasons: list[str]) -> None:
        self.counts["rollbacks"] += 1
        self._rejected(cand, reasons)

    def _rejected(self, cand: Candidate, reasons: list[str]) -> None:
        if self.cfg.on_gate_fail != "revert":
            return
        self.supersede(f"the policy was reverted (version {cand.version} was stopped)")
        self.revert()
        self.pending = [(ver, ft) for ver, ft in self.pending if ver > cand.version]

    def revert(self) -> None:
        """The policy goes back to the serving version's weights, or to the candidate on the canary
        when a promotion is in flight (it passed the gate; if the canary rolls it back, the policy
        goes back again, to the serving version), Adam moments reset; pushed to the rollout servers
        as a new version whose parent is that version."""
        run, canary = self.run, self.promo.canary
        to = canary.cand.version if canary is not None else self.promo.serving_version
        weights = self.bank.get(to)
        if weights is None:
            raise RuntimeError(f"align.output_dir: version {to} has no saved weights in {self.bank.root}")
        copy_into_model(run.learner.engine.module, list(weights.items()))
        self.reset_optimizer()
        run.publisher.push()
        self.store.register_version(run.version, to, self.step_no + 1, self.run_id,
                                    {"reverted_to": to, **self.version_data(self.step_no)})
        self.counts["reverts"] += 1
        log.warning("policy reverted to the %s version %d (now version %d on the rollout servers)",
                    "canary" if canary is not None else "serving", to, run.version)

    def _row(self, version: int) -> dict:
        """The registry's row of `version` ({} when it is not registered)."""
        return next((r for r in self.store.versions() if r["version"] == version), {})

    def reset_optimizer(self) -> None:
        """Forget Adam's moments (the torch optimizer inside the DeepSpeed engine starts afresh)."""
        opt = self.run.learner.engine.optimizer
        getattr(opt, "optimizer", opt).state.clear()

    # ------------------------------------------------------------------ state
    def status(self) -> dict:
        p = self.promo
        return {"serving_version": p.serving_version, "serving_accuracy": self.serving_scores.get("accuracy"),
                "canary_version": p.canary.cand.version if p.canary else 0,
                "waiting_version": self.waiting.version if self.waiting else 0,
                "promotion_paused": int(self.promotion_paused), **self.counts}

    def state_dict(self) -> dict:
        return {"feedback": self.feedback.state_dict(), "last_candidate": self.last_candidate,
                "pending": self.pending, "counts": self.counts}

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state["feedback"])
        self.last_candidate = int(state.get("last_candidate", -1))
        self.pending = [(int(v), float(t)) for v, t in state.get("pending", [])]
        self.counts.update(state.get("counts") or {})

    def close(self) -> None:
        self.metrics.close()


def align_loop(al: Aligner) -> dict[str, Any]:
    """Steps until stopped (StopRequested after a checkpoint), `max_steps` or `max_seconds`."""
    return train_loop(al.run, al.should_stop, al)


def _plot(run: Run) -> None:
    plot_curves(run.out / "metrics.jsonl", run.out / "curves.png")
    plot_serving(run.out / "metrics.jsonl", run.out / "serving.png")
