"""Everything one training run holds: policy engine, reference and value models,
rollout source, reward, logger, servers, version counter. Built once by `setup`;
the optimizer state lives here for the whole run (no per-step re-initialisation).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path

import httpx
import torch

from dllm.configlib import read_yaml
from dllm.task import ArithmeticTask
from dllm.tokenizer import encode, load_tokenizer
from dllm.weights import load_pretrained
from trainer.data import PromptSampler, load_prompts
from trainer.learner import Learner
from trainer.rewards import build_reward
from trainer.rollouts import RolloutSource, fetch, sampling_kwargs
from trainer.servers import ensure_servers, new_token, read_token_file

log = logging.getLogger("dlrl.train")


def resolve_token(cfg, config_path) -> str:
    if cfg.admin_token:
        return cfg.admin_token
    if os.environ.get("DLRL_ADMIN_TOKEN"):
        return os.environ["DLRL_ADMIN_TOKEN"]
    server_cfg = (read_yaml(config_path).get("server") or {}) if config_path else {}
    if server_cfg.get("admin_token"):
        return str(server_cfg["admin_token"])
    if server_cfg.get("admin_token_file"):
        return read_token_file(server_cfg["admin_token_file"])
    return ""


def load_examples(cfg, config_path, overrides, tokenizer):
    """-> (train examples, held-out examples); each has `prompt` and `answer`."""
    if cfg.data:
        ex = load_prompts(cfg.data, prompt_field=cfg.prompt_field or None, answer_field=cfg.answer_field or None,
                          tokenizer=tokenizer if cfg.chat_template else None)
        n_eval = min(cfg.eval_size, max(1, len(ex) // 10))
        return ex[n_eval:] or ex, ex[:n_eval]
    from dllm.configlib import load_section
    task = load_section(ArithmeticTask, config_path, "task", overrides, bare_keys=False)
    return task.split("train", 20_000, seed=task.seed + 1), task.split("heldout", cfg.eval_size)


class RunContext:
    def __init__(self, cfg, config_path: str | None, overrides: list[str]):
        self.cfg, self.config_path, self.overrides = cfg, config_path, overrides
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.servers_started = []
        self.rollouts = None
        self.generator = torch.Generator().manual_seed(cfg.seed)

    # ------------------------------------------------------------------ setup
    def setup(self) -> RunContext:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        model_dir = self._model_dir()
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        policy = load_pretrained(model_dir, dtype=torch.float32)
        policy.gradient_checkpointing = cfg.gradient_checkpointing
        self.block_size = policy.config.block_size
        self.mask_id = policy.config.mask_token_id
        self.pad_id = policy.config.pad_token_id if policy.config.pad_token_id is not None else 0
        self.token = resolve_token(cfg, self.config_path)
        if not self.token and cfg.start_server:
            self.token = new_token()
        self.servers_started = ensure_servers(cfg, self.config_path, self.overrides, self.token, self.out)
        if not self.token:
            raise RuntimeError("admin_token: the trainer needs the servers' admin token to push weights "
                               "(train.admin_token, env DLRL_ADMIN_TOKEN or server.admin_token_file)")
        self.engine = self._build_engine(policy)
        ref = None
        if cfg.kl_coef > 0:
            ref = copy.deepcopy(policy).eval().requires_grad_(False)
        value = None
        if cfg.use_value_model:
            from trainer.value_model import ValueModel
            value = ValueModel(policy, lr=cfg.value_lr)
        self.learner = Learner(cfg, self.engine, self.mask_id, ref, value)
        self.reward_fn = build_reward(cfg.reward, overlong_buffer=cfg.overlong_buffer, max_tokens=cfg.max_tokens)
        train_ex, self.eval_examples = load_examples(cfg, self.config_path, self.overrides, self.tokenizer)
        self.sampler = PromptSampler(train_ex, cfg.prompts_per_step, seed=cfg.seed)
        self.version = max(self._server_versions())
        self.start_step = 0
        self._seed_counter = cfg.seed
        if cfg.resume:
            self._resume()
        if not cfg.resume:
            self.ensure_in_sync()
        self.rollouts = RolloutSource(cfg, self.sampler, self.prompt_ids)
        self.rollouts.seed = self._seed_counter
        from trainer.metrics_log import MetricsLogger
        if not cfg.resume:  # a fresh run starts fresh logs
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
            shutil.rmtree(self.out / "tb", ignore_errors=True)
        self.logger = MetricsLogger(self.out, total_steps=cfg.num_steps + (1 if cfg.eval_every else 0),
                                    tensorboard=cfg.tensorboard)
        return self

    def _model_dir(self) -> Path:
        if self.cfg.model:
            return Path(self.cfg.model)
        from dllm.tiny import ensure_default_model
        return ensure_default_model(self.config_path, self.overrides)

    def _build_engine(self, policy):
        from trainer.ds_engine import DSConfig, build_engine
        cfg = self.cfg
        ds = DSConfig(zero_stage=cfg.zero_stage, dtype=cfg.dtype, grad_accum=cfg.grad_accum, grad_clip=cfg.grad_clip,
                      lr=cfg.lr, weight_decay=cfg.weight_decay, gradient_checkpointing=cfg.gradient_checkpointing)
        return build_engine(policy, ds)

    def prompt_ids(self, example: dict) -> list[int]:
        return encode(self.tokenizer, example["prompt"])

    # ------------------------------------------------------------------ actions
    def _admin_get(self, url: str, path: str) -> dict:
        r = httpx.get(f"{url.rstrip('/')}{path}", headers={"Authorization": f"Bearer {self.token}"}, timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"servers: {url}{path} answered {r.status_code}: {r.text[:200]}")
        return r.json()

    def _server_versions(self) -> list[int]:
        return [int(self._admin_get(url, "/weights/version")["version"]) for url in self.cfg.servers]

    def push(self) -> dict:
        """Push the policy as version+1 into every server (in place, no checkpoint)."""
        from weight_sync import iter_deepspeed_params, push
        new_version = self.version + 1
        stats = push(self.cfg.servers, iter_deepspeed_params(self.engine), new_version,
                     transport=self.cfg.sync_transport, token=self.token, dtype="auto")
        self.version = new_version
        return stats

    def ensure_in_sync(self) -> bool:
        """Make every server serve exactly the trainer's weights (push if any digest differs)."""
        from dllm.weights import parse_dtype
        from trainer.ds_engine import named_full_params
        from weight_sync import weights_digest
        served = self._admin_get(self.cfg.servers[0], "/weights/version").get("dtype")
        local = weights_digest(named_full_params(self.engine, dtype=parse_dtype(served)))
        remote = [self._admin_get(url, "/weights/checksum")["digest"] for url in self.cfg.servers]
        if all(d == local for d in remote):
            return False
        log.info("servers hold other weights than the trainer's policy: pushing version %d", self.version + 1)
        self.push()
        return True

    def evaluate(self) -> float:
        """Greedy exact-match accuracy on the held-out prompts, generated by the servers."""
        ex = self.eval_examples
        outs = fetch(self.cfg.servers, [self.prompt_ids(e) for e in ex], 1, **sampling_kwargs(self.cfg, greedy=True))
        scores = [self.reward_fn(o.text, e) for o, e in zip(outs, ex)]
        return sum(s >= 1.0 for s in scores) / max(1, len(scores))

    def checkpoint(self, step: int) -> None:
        from trainer.ds_engine import save_checkpoint
        state = {"step": step, "version": self.version, "sampler": self.sampler.state_dict(),
                 "seed_counter": self.rollouts.seed}
        save_checkpoint(self.engine, self.out / "checkpoint", state, keep_last=2)
        if self.learner.value is not None:
            self.learner.value.save(self.out / "checkpoint" / "value.pt")
        log.info("checkpoint at step %d -> %s", step, self.out / "checkpoint")

    def _resume(self) -> None:
        from trainer.ds_engine import load_checkpoint
        ckpt = self.out / "checkpoint"
        from trainer.ds_engine import has_checkpoint
        if not has_checkpoint(ckpt):
            raise RuntimeError(f"resume: no checkpoint in {ckpt}")
        state = load_checkpoint(self.engine, ckpt)
        if self.learner.value is not None:
            self.learner.value.load(ckpt / "value.pt")
        self.start_step = int(state["step"])
        self._seed_counter = int(state.get("seed_counter", self.cfg.seed))
        self.sampler.load_state_dict(state["sampler"])
        self.version = max(self.version, int(state["version"]))
        self.push()  # servers now hold the resumed weights
        log.info("resumed from step %d (version %d)", self.start_step, self.version)

    def export(self) -> Path:
        from trainer.ds_engine import export_hf
        final = self.out / "final"
        export_hf(self.engine, self.engine.module.config, final)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (self.model_dir / f).is_file():
                shutil.copy(self.model_dir / f, final / f)
        (final / "dlrl_version.json").write_text(json.dumps({"version": self.version}) + "\n")
        return final

    def finish(self) -> Path:
        """Close the logs and draw the reward/accuracy curves."""
        from trainer.metrics_log import plot_curves
        self.logger.close()
        self.logger = None
        return plot_curves(self.out / "metrics.jsonl", self.out / "curves.png")

    def close(self) -> None:
        if getattr(self, "logger", None) is not None:
            self.logger.close()
            self.logger = None
        if self.rollouts is not None:
            self.rollouts.close()
        for s in self.servers_started:
            s.stop()
