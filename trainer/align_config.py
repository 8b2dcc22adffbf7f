"""AlignConfig: every knob of `dlrl align` (section `align` of configs/align.yaml).

    cfg = load_section(AlignConfig, "configs/align.yaml", "align", ["promote_every=5"])

The trainer's own knobs (objective, lr, group size, ...) stay in the `train` section
(`trainer.config.TrainConfig`); `dlrl align` builds its run from `train` with
`train.servers = align.rollout_servers` and the gate's held-out set from `align.eval_*`.
Any field can be overridden on the command line as `key=value` or `align.key=value`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ON_GATE_FAIL = ("revert", "continue")


@dataclass
class AlignConfig:
    # the two pools of servers
    rollout_servers: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8100"])  # every push
    serving_replicas: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8101",
                                                                 "http://127.0.0.1:8102"])  # promoted only
    store: str = "runs/feedback.db"  # the servers' feedback store, also the version registry
    output_dir: str = "runs/align"
    # data: prompts and feedback
    prompt_source: str = "store"  # store | task (train.data or the embedded split) | path of a JSONL (tailed)
    accept_reward: float = 1.0  # store source: a completion rewarded at least this is a reference answer
    feedback_ratio: float = 0.25  # share of each step's samples taken from feedback records
    max_staleness: int = 12  # versions: records generated more than this many versions ago are dropped
    feedback_buffer: int = 4096  # labeled records waiting to be trained on (the newest are kept)
    prompt_wait_s: float = 600.0  # how long a step waits for prompts/feedback before giving up
    # when to promote, when to stop
    promote_every: int = 3  # steps between candidates
    max_steps: int = 0  # 0 = until stopped (SIGTERM); >0: a bounded run
    max_seconds: float = 0.0  # 0 = no time bound
    # the gate: held-out evaluation, KL to the serving version, sanity monitors
    eval_data: str = ""  # held-out JSONL as `dlrl eval` reads it; empty = the task's held-out split
    eval_size: int = 200
    tolerance: float = 0.02  # candidate accuracy >= serving accuracy - tolerance
    kl_budget: float = 0.5  # mean per-token KL(candidate || serving) on held-out rollouts (nats)
    kl_prompts: int = 64  # held-out prompts sampled once each (temperature train.temperature) for the KL
    max_length_ratio: float = 2.0  # candidate mean length within [serving / r, serving * r]
    max_stop_rate_drop: float = 0.1  # share of samples ending by stop may fall at most this much
    max_empty_frac: float = 0.05  # empty answers
    max_degenerate_frac: float = 0.1  # answers made of one repeated character or word
    on_gate_fail: str = "revert"  # revert: the policy goes back to the serving weights; continue: keep training
    # promotion: canary, then a rolling update; automatic rollback of the canary
    canary_window_s: float = 30.0
    canary_min_requests: int = 10  # the window lasts until the canary served this many (or canary_max_s)
    canary_max_s: float = 300.0
    rollback_on_error_rate: float = 0.01  # canary error rate above the others' + this
    rollback_on_latency_ratio: float = 2.0  # canary mean latency above the others' x this
    rollback_on_reward_drop: float = 0.1  # canary feedback reward below the others' - this
    rollback_min_feedback: int = 30  # feedback records per side before the reward is compared
    rollback_z: float = 1.645  # ... and the drop must be significant (one-sided z-test, 95%)
    keep_versions: int = 3  # promoted versions' weights kept in host memory (older ones on disk)
    reconcile_every_s: float = 5.0  # replicas checked against the serving version this often
    admin_token: str = ""  # empty: train.admin_token, env DLRL_ADMIN_TOKEN, server.admin_token_file
    metrics_port: int = 0  # Prometheus metrics of the controller on this port (0: off)
    metrics_host: str = "127.0.0.1"
    # testing
    # steps (1-based) trained on 1 - reward, Adam's moments reset at the first of a run of them: a bad candidate
    flip_reward_steps: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if not self.rollout_servers:
            raise ValueError("align.rollout_servers: need at least one server URL")
        if not self.serving_replicas:
            raise ValueError("align.serving_replicas: need at least one server URL")
        both = set(self.rollout_servers) & set(self.serving_replicas)
        if both:
            raise ValueError(f"align.serving_replicas: {sorted(both)[0]} is also a rollout server; the two pools "
                             "must be disjoint (serving replicas receive only promoted versions)")
        if not self.store:
            raise ValueError("align.store: need the path of the feedback store")
        if not 0.0 <= self.feedback_ratio <= 1.0:
            raise ValueError(f"align.feedback_ratio: must be in [0, 1], got {self.feedback_ratio}")
        for name in ("promote_every", "eval_size", "kl_prompts", "feedback_buffer", "keep_versions"):
            if getattr(self, name) < 1:
                raise ValueError(f"align.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_staleness", "max_steps", "canary_min_requests", "rollback_min_feedback", "metrics_port"):
            if getattr(self, name) < 0:
                raise ValueError(f"align.{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("max_seconds", "tolerance", "kl_budget", "canary_window_s", "canary_max_s",
                     "rollback_on_error_rate", "rollback_on_reward_drop", "prompt_wait_s", "reconcile_every_s",
                     "max_stop_rate_drop", "rollback_z"):
            if getattr(self, name) < 0:
                raise ValueError(f"align.{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("max_empty_frac", "max_degenerate_frac"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"align.{name}: must be in [0, 1], got {getattr(self, name)}")
        for name in ("max_length_ratio", "rollback_on_latency_ratio"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"align.{name}: must be >= 1, got {getattr(self, name)}")
        if self.canary_max_s < self.canary_window_s:
            raise ValueError(f"align.canary_max_s: must be >= canary_window_s ({self.canary_window_s}), "
                             f"got {self.canary_max_s}")
        if self.on_gate_fail not in ON_GATE_FAIL:
            raise ValueError(f"align.on_gate_fail: unknown {self.on_gate_fail!r} (known: {', '.join(ON_GATE_FAIL)})")
        if any(s < 1 for s in self.flip_reward_steps):
            raise ValueError(f"align.flip_reward_steps: steps are 1-based, got {self.flip_reward_steps}")
        if self.metrics_port > 65535:
            raise ValueError(f"align.metrics_port: must be a TCP port (0-65535), got {self.metrics_port}")

    def uses_feedback(self) -> bool:
        return self.feedback_ratio > 0


def check_train(align: AlignConfig, train) -> None:
    """What `dlrl align` needs of the `train` section (ValueError naming the key)."""
    if align.uses_feedback() and train.is_correction == "none":
        raise ValueError("train.is_correction: align.feedback_ratio > 0 trains on feedback records, which are "
                         "off-policy; set train.is_correction=tis (or mis) so their recorded behaviour "
                         "log-probs give the importance weights")
    if train.mode != "sync":
        raise ValueError(f"train.mode: dlrl align runs in sync mode (got {train.mode!r})")
    if align.on_gate_fail == "revert" and (train.zero_stage != 0 or train.dtype != "fp32"):
        raise ValueError("align.on_gate_fail=revert copies the serving weights back into the policy, which needs "
                         "train.zero_stage=0 and train.dtype=fp32 (or set align.on_gate_fail=continue)")
    if align.uses_feedback() and align.feedback_ratio * train.prompts_per_step * train.group_size < train.group_size:
        raise ValueError(f"align.feedback_ratio: {align.feedback_ratio} of {train.prompts_per_step} x "
                         f"{train.group_size} samples is less than one group of {train.group_size} records")
