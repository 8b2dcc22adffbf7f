"""TrainConfig: every knob of the online RL loop (section `train` of configs/*.yaml).

    root = load_sections("configs/tiny.yaml", ["num_steps=5"], {"train": TrainConfig, ...}, primary="train")

Any field can be overridden on the command line as `key=value` or `train.key=value`. Choices
are `Literal` types taken from where the choice is implemented (objectives, transports,
strategies, corrections, sandbox modes), so one table serves the code and the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from dllm.options import SamplingOptions, Threshold
from dllm.ranges import THRESHOLD
from dllm.strategy import Strategy, StrategyField
from dlrl_config import Config
from trainer.monitor.trackers import Tracker
from trainer.objective_registry import objective_names
from trainer.rewards.sandbox import SandboxMode
from trainer.rl.correction import Level, Mode
from weight_sync.protocol import Transport

DEFAULT_TRACKERS: list[Tracker] = ["tensorboard"]  # train.report_to
if TYPE_CHECKING:  # a Literal built at import time is not a static type
    Objective = str
else:
    Objective = Literal[objective_names()]  # the registered objectives (trainer.rl.objectives.OBJECTIVES)


class ServerKeys(Config, extra="ignore"):
    """The keys of the `server` section the trainer reads (the admin token it pushes with); the
    server validates the rest itself. Parsed with the rest of the file, once."""

    admin_token: str = ""
    admin_token_file: str = ""
    served_model_name: str = ""  # the name servers started for this run report (else the model folder's)


class TrainConfig(Config, SamplingOptions):
    # where rollouts come from
    servers: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"], min_length=1)  # generation servers (URLs) rollouts come from; servers=[http://h1:8000,http://h2:8000]
    start_server: bool = True  # start a local server (subprocess) when none is reachable
    server_start_timeout: float = Field(600.0, gt=0)  # seconds a started server may take to become ready
    server_wait_s: float = Field(120.0, ge=0)  # a server down before a step is waited for this long, then an error
    admin_token: str = ""  # empty: env DLRL_ADMIN_TOKEN, then the config's server.admin_token(_file)
    model: str = ""  # policy to train: a folder or a hub repo id (org/name[@rev]); empty = the embedded default
    take_over_servers: bool = False  # train servers that serve another model (renamed to this one); else an error
    trust_remote_code: bool = False  # run the model folder's own Python code (tokenizer); never asked on stdin
    block_size: int = Field(0, ge=0)  # for folders whose config.json lacks it (0 = from the folder)
    mask_token_id: int = Field(-1, ge=-1)  # for folders that lack it (-1 = from the folder / the tokenizer)
    output_dir: str = "runs/tiny-rl"  # metrics.jsonl, tb/, curves.png, checkpoint/, final/ (HF export) go here
    overwrite: bool = False  # replace a previous run in output_dir (else: an error, or --resume to continue it)
    # data
    data: str = ""  # prompts: .jsonl/.json/.parquet/.csv, a save_to_disk folder or a hub dataset id; empty = embedded task
    data_split: str = "train"  # split of a datasets folder / hub dataset (files are one split)
    data_limit: int = Field(0, ge=0)  # first N records of train.data (0 = all)
    prompt_field: str = ""  # record field holding the prompt (empty: question / prompt / problem)
    answer_field: str = ""  # record field holding the reference answer (empty: ground_truth_answer / answer)
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template (chat models)
    prompt_template: str = "{prompt}"  # format of the prompt ({prompt} is the record's), before the chat template
    system_prompt: str = ""  # system turn (chat_template only)
    reward: str = "exact_match"  # exact_match | math | code | code_strict | pkg.module:function | path/to/file.py:function
    overlong_buffer: int = Field(0, ge=0)  # DAPO overlong penalty over the last N tokens before max_tokens (0 = off)
    reward_sandbox: SandboxMode = "bwrap"  # code rewards: bwrap | unsafe_local (plain subprocess, trusted code only)
    # rollouts
    num_steps: int = Field(60, ge=1)  # RL steps (one rollout batch + update + weight push each)
    prompts_per_step: int = Field(32, ge=1)  # prompts per step
    group_size: int = Field(8, ge=1)  # samples per prompt (the group advantages are computed over)
    max_tokens: int = Field(8, ge=1)  # rollout completion length limit
    stop: list[str] = Field(default_factory=list)  # rollout stop strings (besides the model's eos ids)
    stop_token_ids: list[int] = Field(default_factory=list)  # rollout stop token ids (besides eos)
    strategy: StrategyField = Strategy.static  # decoding strategy: static (denoise_steps per block) | dynamic (confidence threshold) | sequential
    denoise_steps: int = Field(0, ge=0)  # 0 = block_size
    threshold: Threshold = THRESHOLD.default  # dynamic strategy: commit tokens whose confidence exceeds this
    mode: Literal["sync", "overlap"] = "sync"  # overlap: one-step off-policy
    max_staleness: int = Field(1, ge=1)  # overlap mode: most versions a rollout may lag the policy
    filter_zero_variance: bool = True  # drop groups whose rewards are all equal (DAPO dynamic sampling)
    # objective
    objective: Objective = "tracerl"  # tracerl (PPO clip per trace step) | dipo (GRPO + k3 KL) | random_masking | coupled
    eps_clip: float = Field(0.2, ge=0)  # tracerl: PPO clip range
    eps_low: float = Field(0.2, ge=0)  # dipo: lower clip range
    eps_high: float = Field(0.28, ge=0)  # dipo: upper clip range (asymmetric, DAPO clip-higher)
    kl_coef: float = Field(0.0, ge=0)  # KL penalty to a frozen reference (0 = no reference model)
    log_ratio_clip: float = Field(10.0, gt=0)  # clamp of log importance ratios (numerical safety)
    norm: Literal["token", "sequence"] = "token"  # loss normalisation: per token or per sequence
    shrink: int = Field(1, ge=1)  # merge s neighbouring trace steps into one (TraceRL shrinkage)
    use_value_model: bool = False  # TraceRL's diffusion value model with step-wise GAE
    gamma: float = Field(1.0, ge=0, le=1)  # value model: discount
    lam: float = Field(1.0, ge=0, le=1)  # value model: GAE lambda
    value_lr: float = Field(1e-4, gt=0)  # value model learning rate
    value_clip: float = Field(0.2, gt=0)  # value model: value clip range
    # train-serve mismatch (trainer.rl.correction)
    is_correction: Mode = "none"  # train-serve mismatch correction: none | tis (truncated IS) | mis (masked IS)
    is_level: Level = "token"  # importance ratio per token or per sequence
    is_cap: float = Field(2.0, ge=1)  # truncation / mask bound of the importance ratio
    logprob_chunk: int = Field(1024, ge=0)  # scored tokens per full-vocabulary logits chunk (0: all at once)
    # optimisation (DeepSpeed)
    lr: float = Field(1e-4, gt=0)  # policy learning rate (AdamW)
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    grad_clip: float = Field(1.0, ge=0)  # gradient norm clip (0 = off)
    zero_stage: Literal[0, 1, 2, 3] = 0  # DeepSpeed ZeRO stage
    dtype: Literal["fp32", "bf16"] = "fp32"  # fp16 is not supported
    grad_accum: int = Field(1, ge=1)  # micro-batches per optimizer step
    updates_per_step: int = Field(1, ge=1)  # optimizer passes over each step's rollouts
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (memory for time)
    compile_layers: bool = False  # torch.compile the policy's decoder layers for the replay forward/backward
    length_buckets: bool = False  # pad trace-replay rows to length buckets (64 * 2^k): few shapes per run
    device: Literal["auto", "cpu", "cuda"] = "auto"  # trainer ranks: auto = CUDA (NCCL) when a GPU is visible, else CPU (gloo)
    # weight sync
    sync_transport: Transport = "shm"  # weight push: shm (same host) | dist (torch.distributed) | http | cuda_ipc
    sync_ipc_allow_cpu: bool = False  # cuda_ipc on a CPU trainer/server: torch-shared host memory (tests, benchmarks)
    sync_timeout: float = Field(300.0, gt=0)  # seconds a push may take before the servers drop it
    sync_addr: str = "127.0.0.1"  # dist transport: the address servers reach rank 0 at
    record_digests: bool = False  # append {version, digest} of every push to output_dir/versions.jsonl
    # ranks
    nproc: int = Field(1, ge=1)  # local ranks started by `dlrl train` itself (ignored under torchrun / deepspeed)
    # eval, checkpoints, logging
    eval_every: int = Field(5, ge=0)  # held-out greedy evaluation every N steps (0 = off)
    eval_size: int = Field(200, ge=1)  # held-out prompts per evaluation
    eval_split: str = "test"  # split of train.eval_data when it is a datasets folder / hub dataset
    eval_data: str = ""  # held-out prompts for the periodic evaluation (any train.data source); empty = split
    checkpoint_every: int = Field(0, ge=0)  # checkpoint every N steps for --resume (0 = only on SIGTERM)
    resume: bool = False  # continue from output_dir/checkpoint (same as --resume)
    seed: int = 0  # seed of prompt sampling, rollouts and initialisation
    num_threads: int = Field(0, ge=0)  # torch CPU threads (0 = torch's default)
    tensorboard: bool = True  # write TensorBoard logs to output_dir/tb (false: drops tensorboard from report_to)
    report_to: list[Tracker] = Field(default_factory=DEFAULT_TRACKERS.copy)  # tensorboard, wandb, mlflow, trackio
    metrics_port: int = Field(0, ge=0, lt=65536)  # Prometheus /metrics of the run on this port (rank 0; 0: off)
    metrics_host: str = "127.0.0.1"  # bind address of train.metrics_port

    def check(self) -> None:
        if "{prompt}" not in self.prompt_template:
            raise ValueError("train.prompt_template: must contain {prompt}")
