"""AlignConfig: every knob of `dlrl align` (section `align` of configs/align.yaml).

    root = load_sections("configs/align.yaml", ["promote_every=5"], align_sections(), primary="align")
    cfg = root["align"]         # AlignConfig; root["train"], ["model"], ["task"], ["sft"], ["server"] too

The trainer's own knobs (objective, lr, group size, ...) stay in the `train` section
(`trainer.config.TrainConfig`); `dlrl align` builds its run from `train` with
`train.servers = align.rollout_servers` and the gate's held-out set from `align.eval_*`.
Any field can be overridden on the command line as `key=value` or `align.key=value`; a bad
value is a `ConfigError` naming the key (`align.feedback_ratio: ...`). `check_train` holds the
rules that tie `align` to `train`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from dllm.embedded.tiny import TINY_SECTIONS
from dllm.options import Temperature
from dllm.ranges import TEMPERATURE
from dlrl_config import Config
from trainer.config import ServerKeys, TrainConfig

Frac = Annotated[float, Field(ge=0, le=1)]
Url = Annotated[str, Field(min_length=1)]


class AlignConfig(Config):
    # the two pools of servers
    rollout_servers: list[Url] = Field(default_factory=lambda: ["http://127.0.0.1:8100"], min_length=1)  # every push
    serving_replicas: list[Url] = Field(default_factory=lambda: ["http://127.0.0.1:8101", "http://127.0.0.1:8102"],
                                        min_length=1)  # promoted versions only
    store: str = Field("runs/feedback.db", min_length=1)  # the servers' feedback store, also the version registry
    output_dir: str = "runs/align"
    # data: prompts and feedback
    prompt_source: str = Field("store", min_length=1)  # store | task (train.data or the embedded split) | JSONL path (tailed)
    accept_reward: float = 1.0  # store source: a completion rewarded at least this is a reference answer
    feedback_ratio: Frac = 0.25  # share of each step's samples taken from feedback records
    # versions: records generated more than this many versions ago are dropped (never the serving version's)
    max_staleness: int = Field(12, ge=0)
    feedback_buffer: int = Field(4096, ge=1)  # labeled records waiting to be trained on (the newest are kept)
    prompt_wait_s: float = Field(600.0, ge=0)  # how long a step waits for prompts/feedback before giving up
    # when to promote, when to stop
    promote_every: int = Field(3, ge=1)  # steps between candidates
    max_steps: int = Field(0, ge=0)  # 0 = until stopped (SIGTERM); >0: a bounded run
    max_seconds: float = Field(0.0, ge=0)  # 0 = no time bound
    # the gate: held-out evaluation, KL to the serving version, sanity monitors
    eval_data: str = ""  # held-out JSONL as `dlrl eval` reads it; empty = the task's held-out split
    eval_size: int = Field(200, ge=1)
    tolerance: float = Field(0.02, ge=0)  # candidate accuracy >= serving accuracy - tolerance
    kl_budget: float = Field(0.5, ge=0)  # mean per-token KL(candidate || serving) on held-out rollouts (nats)
    kl_prompts: int = Field(64, ge=1)  # held-out prompts sampled once each (temperature train.temperature) for the KL
    max_length_ratio: float = Field(2.0, ge=1)  # candidate mean length within [serving / r, serving * r]
    max_stop_rate_drop: float = Field(0.1, ge=0)  # share of samples ending by stop may fall at most this much
    max_empty_frac: Frac = 0.05  # empty answers
    max_degenerate_frac: Frac = 0.1  # answers made of one repeated character or word
    on_gate_fail: Literal["revert", "continue"] = "revert"  # revert: back to the serving weights; continue: train on
    # promotion: canary, then a rolling update; automatic rollback of the canary
    canary_window_s: float = Field(30.0, ge=0)
    canary_min_requests: int = Field(10, ge=0)  # the window lasts until the canary served this many (or canary_max_s)
    canary_max_s: float = Field(300.0, ge=0)  # >= canary_window_s
    rollback_on_error_rate: float = Field(0.01, ge=0)  # canary error rate above the others' + this
    rollback_on_latency_ratio: float = Field(2.0, ge=1)  # canary mean latency above the others' x this
    rollback_on_reward_drop: float = Field(0.1, ge=0)  # canary feedback reward below the others' - this
    rollback_min_feedback: int = Field(30, ge=0)  # feedback records per side before the reward is compared
    rollback_z: float = Field(1.645, ge=0)  # ... and the drop must be significant (one-sided z-test, 95%)
    keep_versions: int = Field(3, ge=1)  # promoted versions' weights kept in host memory (older ones on disk)
    reconcile_every_s: float = Field(5.0, ge=0)  # replicas checked against the serving version this often
    admin_token: str = ""  # empty: train.admin_token, env DLRL_ADMIN_TOKEN, server.admin_token_file
    metrics_port: int = Field(0, ge=0, lt=65536)  # Prometheus metrics of the controller on this port (0: off)
    metrics_host: str = "127.0.0.1"
    # the console (trainer.align.console): one web page; actions (rollback, pause) need the admin token
    console_port: int = Field(0, ge=0, lt=65536)  # 0: off
    console_host: str = "127.0.0.1"
    console_show_text: bool = False  # show the last recorded prompts/answers users rated (user text: opt in)

    def check(self) -> None:
        both = set(self.rollout_servers) & set(self.serving_replicas)
        if both:
            raise ValueError(f"align.serving_replicas: {sorted(both)[0]} is also a rollout server; the two pools "
                             "must be disjoint (serving replicas receive only promoted versions)")
        if self.canary_max_s < self.canary_window_s:
            raise ValueError(f"align.canary_max_s: must be >= canary_window_s ({self.canary_window_s}), "
                             f"got {self.canary_max_s}")

    def uses_feedback(self) -> bool:
        return self.feedback_ratio > 0


class UsersConfig(Config):
    """The simulated users of `make align` (section `users`, examples/align/users.py): kept beside
    AlignConfig because configs/align.yaml carries the section and `dlrl align --help` lists it."""

    replicas: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: ["http://127.0.0.1:8101", "http://127.0.0.1:8102"], min_length=1)
    num_users: int = Field(8, ge=1)
    think_time_s: float = Field(0.2, ge=0)  # pause between one user's requests
    feedback_prob: float = Field(1.0, ge=0, le=1)  # share of answers that get feedback
    feedback_delay_s: float = Field(1.0, ge=0)  # feedback comes after a random delay up to this
    temperature: Temperature = TEMPERATURE.default  # the users' sampling temperature
    max_tokens: int = Field(8, ge=1)
    request_timeout_s: float = Field(120.0, gt=0)
    duration_s: float = Field(0.0, ge=0)  # 0: until stopped
    seed: int = 1
    stats_path: str = Field("runs/align/users.json", min_length=1)


def align_sections() -> dict[str, type[Config]]:
    """The sections `dlrl align` reads from its config file (once): its own, the trainer's, the
    embedded default's (model, task, sft) and the `server` keys the trainer needs (admin token)."""
    return {"align": AlignConfig, "train": TrainConfig, **TINY_SECTIONS, "server": ServerKeys}


def check_train(align: AlignConfig, train: TrainConfig) -> None:
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
