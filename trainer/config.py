"""TrainConfig: every knob of the online RL loop (section `train` of configs/*.yaml).

    cfg = load_section(TrainConfig, "configs/tiny.yaml", "train", ["num_steps=5"])

Any field can be overridden on the command line as `key=value` or `train.key=value`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.objectives import OBJECTIVES

MODES = ("sync", "overlap")
TRANSPORTS = ("shm", "dist", "http")


@dataclass
class TrainConfig:
    # where rollouts come from
    servers: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    start_server: bool = True  # start a local server (subprocess) when none is reachable
    server_start_timeout: float = 600.0
    server_wait_s: float = 120.0  # a server down before a step is waited for this long, then an error
    admin_token: str = ""  # empty: env DLRL_ADMIN_TOKEN, then server.admin_token_file of the config
    model: str = ""  # policy to train; empty = the embedded default (trained by SFT if missing)
    trust_remote_code: bool = False  # run the model folder's own Python code (tokenizer); never asked on stdin
    block_size: int = 0  # for folders whose config.json lacks it (0 = from the folder)
    mask_token_id: int = -1  # for folders that lack it (-1 = from the folder / the tokenizer's <|MASK|>)
    output_dir: str = "runs/tiny-rl"
    # data
    data: str = ""  # JSONL of prompts; empty = the embedded arithmetic task
    prompt_field: str = ""
    answer_field: str = ""
    chat_template: bool = False
    reward: str = "exact_match"  # exact_match | math | code | module:function
    overlong_buffer: int = 0
    reward_sandbox: str = "bwrap"  # code rewards: bwrap (sandboxed) | unsafe_local (plain subprocess, trusted code only)
    # rollouts
    num_steps: int = 60
    prompts_per_step: int = 32
    group_size: int = 8
    max_tokens: int = 8
    stop: list[str] = field(default_factory=list)  # rollout stop strings (besides the model's eos ids)
    stop_token_ids: list[int] = field(default_factory=list)  # rollout stop token ids (besides eos)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    strategy: str = "static"
    denoise_steps: int = 0  # 0 = block_size
    threshold: float = 0.9
    mode: str = "sync"  # sync | overlap (one-step off-policy)
    max_staleness: int = 1
    filter_zero_variance: bool = True
    # objective
    objective: str = "tracerl"
    eps_clip: float = 0.2
    eps_low: float = 0.2
    eps_high: float = 0.28
    kl_coef: float = 0.0
    log_ratio_clip: float = 10.0
    norm: str = "token"  # token | sequence
    shrink: int = 1
    use_value_model: bool = False
    # train-serve mismatch (trainer.correction): none | tis | mis, token | sequence, cap on rho
    is_correction: str = "none"
    is_level: str = "token"
    is_cap: float = 2.0
    logprob_chunk: int = 1024  # scored tokens per full-vocabulary logits chunk (0: all at once)
    gamma: float = 1.0
    lam: float = 1.0
    value_lr: float = 1e-4
    value_clip: float = 0.2
    # optimisation (DeepSpeed)
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    zero_stage: int = 0
    dtype: str = "fp32"
    grad_accum: int = 1  # micro-batches per optimizer step
    updates_per_step: int = 1
    gradient_checkpointing: bool = False
    # sync, eval, logging
    sync_transport: str = "shm"
    sync_timeout: float = 300.0  # seconds a push may take before the servers drop it
    sync_addr: str = "127.0.0.1"  # dist transport: the address servers reach rank 0 at
    record_digests: bool = False  # append {version, digest} of every push to output_dir/versions.jsonl
    # ranks
    nproc: int = 1  # local ranks started by `dlrl train` itself (ignored under torchrun / deepspeed)
    eval_every: int = 5
    eval_size: int = 200
    eval_data: str = ""  # held-out JSONL for the periodic evaluation (as `dlrl eval` reads it); empty = split
    checkpoint_every: int = 0
    resume: bool = False
    seed: int = 0
    num_threads: int = 0
    tensorboard: bool = True

    def validate(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"train.objective: unknown {self.objective!r} (known: {', '.join(OBJECTIVES)})")
        if self.mode not in MODES:
            raise ValueError(f"train.mode: unknown {self.mode!r} (known: {', '.join(MODES)})")
        if self.sync_transport not in TRANSPORTS:
            raise ValueError(f"train.sync_transport: unknown {self.sync_transport!r} "
                             f"(known: {', '.join(TRANSPORTS)})")
        if self.norm not in ("token", "sequence"):
            raise ValueError(f"train.norm: must be 'token' or 'sequence', got {self.norm!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"train.zero_stage: must be 0-3, got {self.zero_stage}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"train.dtype: must be fp32 or bf16 (fp16 is not supported), got {self.dtype!r}")
        if not self.servers:
            raise ValueError("train.servers: need at least one server URL")
        for name in ("num_steps", "prompts_per_step", "group_size", "max_tokens", "grad_accum",
                     "updates_per_step", "shrink", "max_staleness", "nproc"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}: must be >= 1, got {getattr(self, name)}")
        from trainer import correction

        if self.is_correction not in correction.MODES:
            raise ValueError(f"train.is_correction: unknown {self.is_correction!r} "
                             f"(known: {', '.join(correction.MODES)})")
        if self.is_level not in correction.LEVELS:
            raise ValueError(f"train.is_level: unknown {self.is_level!r} (known: {', '.join(correction.LEVELS)})")
        if self.is_cap < 1:
            raise ValueError(f"train.is_cap: must be >= 1, got {self.is_cap}")
        if self.logprob_chunk < 0:
            raise ValueError(f"train.logprob_chunk: must be >= 0, got {self.logprob_chunk}")
        if self.lr <= 0:
            raise ValueError(f"train.lr: must be > 0, got {self.lr}")
