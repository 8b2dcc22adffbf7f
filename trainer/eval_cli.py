"""`dlrl eval`: accuracy and decoding speed of a served model on a JSONL of problems.

    dlrl eval --config configs/tiny.yaml                       # embedded default, held-out split
    dlrl eval data=data/math500.jsonl model=/models/SDAR-1.7B-Chat chat_template=true \
        max_tokens=1024 num_samples=4 temperature=1.0 static_steps=[4] dynamic_thresholds=[0.9,0.7]
    dlrl eval data=gsm8k.jsonl servers=[http://h1:8000,http://h2:8000] start_server=false

Talks to the servers at `eval.servers`; when none answers (and `eval.start_server`), starts
`dlrl serve` with `eval.model` (and any `server.*` overrides) and stops it at the end;
`eval.own_server=true` always starts a private one on a free local port. Before evaluating it
reads what every server holds (model name, weight version, checksum: trainer.evaluation.check) and,
when `eval.model` is set, refuses a server holding other weights (`eval.verify`); what was
evaluated is recorded in results.json (`served`).
`eval.block_sizes` decodes with each block size in turn (a started server is restarted with
`server.block_size=B`; running servers must already decode with it). Prints one table row per
decoding setting and writes every metric and generation to `eval.output` (JSON).
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from dllm.embedded.task import ArithmeticTask
from dllm.hub import resolve_model
from dllm.options import SamplingOptions, Temperature, Threshold
from dllm.tokenizer import load_tokenizer
from dlrl_config import Config, ConfigError, load_sections
from dlrl_config.cli import ArgumentParser, add_check_args, config_file, print_check
from rollout_client.client import RolloutError
from trainer.config import ServerKeys
from trainer.data.prompts import report
from trainer.evaluation.evaluate import (
    evaluate,
    format_table,
    load_eval_examples,
    make_settings,
    write_results,
)
from trainer.infra.local_servers import LocalServer, new_token, resolve_token
from trainer.preflight import eval_problems
from trainer.rewards import build_reward

if TYPE_CHECKING:
    from trainer.evaluation.evaluate import SettingResult

log = logging.getLogger("dlrl.eval")


class EvalConfig(Config, SamplingOptions):
    servers: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"], min_length=1)  # servers to evaluate (URLs)
    start_server: bool = True  # start a local `dlrl serve` when no server answers
    server_start_timeout: float = Field(600.0, gt=0)  # seconds a started server may take to become ready
    model: str = ""  # folder or hub repo id: the model to evaluate (servers are checked), tokenizer, started server
    own_server: bool = False  # start a private server with eval.model on a free local port (ignores eval.servers)
    verify: Literal["checksum", "name", "none"] = "checksum"  # how servers are checked against eval.model
    admin_token: str = ""  # to read served weights' checksum; empty: env DLRL_ADMIN_TOKEN, server.admin_token(_file)
    split: str = "test"  # split of a datasets folder / hub dataset (files are one split)
    data: str = ""  # .jsonl/.json/.parquet/.csv, save_to_disk folder or hub dataset id; empty = the task's held-out split
    prompt_field: str = ""  # record field holding the prompt (empty: question / prompt / problem)
    answer_field: str = ""  # record field holding the answer (empty: ground_truth_answer / answer / boxed solution)
    prompt_template: str = "{prompt}"  # format of the prompt ({prompt} is the record's)
    system_prompt: str = ""  # system turn (chat_template only)
    chat_template: bool = False  # wrap prompts in eval.model's chat template
    reward: str = ""  # empty: math for a data file, exact_match for the embedded task
    limit: int = Field(0, ge=0)  # first N problems; 0 = all
    num_samples: int = Field(1, ge=1)  # samples per problem (pass@k for k up to this)
    max_tokens: int = Field(512, ge=1)  # completion length limit
    temperature: Temperature = 0.0  # sampling temperature (0 = greedy)
    seed: int = 0  # sampling seed
    stop: list[str] = Field(default_factory=list)  # stop strings
    static_steps: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)  # static strategy settings to evaluate: denoising steps per block
    dynamic_thresholds: list[Threshold] = Field(default_factory=list)  # dynamic strategy settings to evaluate: confidence thresholds
    block_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)  # decode with each block size (started servers are restarted with each)
    batch_size: int = Field(64, ge=1)  # prompts per request batch
    request_timeout: float = Field(600.0, gt=0)  # seconds per generation request
    output: str = "runs/eval/results.json"  # results JSON (metrics, what was served, every generation)

    def check(self) -> None:
        if self.own_server and not self.model:
            raise ValueError("eval.own_server: needs eval.model (the model the private server loads)")
        if self.chat_template and not self.model:
            raise ValueError("eval.chat_template: needs eval.model (the folder whose tokenizer holds the template)")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("eval.prompt_template: must contain {prompt}")


def free_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def load_examples(cfg: EvalConfig, task: ArithmeticTask) -> list[dict]:
    if not cfg.data:
        return task.split("heldout", cfg.limit or 200)
    tokenizer = None
    if cfg.chat_template:
        tokenizer = load_tokenizer(resolve_model(cfg.model, "eval.model"))
    examples = load_eval_examples(cfg.data, cfg.prompt_field, cfg.answer_field, tokenizer, cfg.prompt_template,
                                  cfg.system_prompt, cfg.limit, split=cfg.split, require_answer=True)
    report("eval.data", cfg.data, examples, f"split {cfg.split}" + (f", limit {cfg.limit}" if cfg.limit else ""))
    return examples


def run(cfg: EvalConfig, task: ArithmeticTask, config_path: str | None, overrides: list[str],
        server_keys: ServerKeys | None = None) -> tuple[list[SettingResult], dict[str, dict[str, Any]]]:
    """Evaluate against `cfg.servers`, starting local ones where none answers (once per block
    size: a started server is restarted with each). -> (results, what each server held)."""
    from trainer.evaluation.check import (
        check_served,  # torch: only once the command runs (not --help, --check)
    )
    from trainer.infra.fleet import ServerFleet

    model_dir = resolve_model(cfg.model, "eval.model") if cfg.model else None
    if cfg.own_server:
        cfg = cfg.replace(servers=[free_url()], start_server=True)
    examples = load_examples(cfg, task)
    reward = build_reward(cfg.reward or ("math" if cfg.data else "exact_match"))
    server_overrides = [o for o in overrides if o.startswith("server.")]
    out_dir = Path(cfg.output).parent
    results: list[SettingResult] = []
    served: dict[str, dict[str, Any]] = {}
    token = resolve_token(cfg, server_keys) if server_keys is not None else cfg.admin_token
    sizes: list[int | None] = list(cfg.block_sizes) or [None]  # None: the server's own block size
    for block_size in sizes:
        extra = [f"server.block_size={block_size}"] if block_size is not None else []
        token = token or new_token()

        def launch(url: str, i: int, extra: list[str] = extra, token: str = token) -> LocalServer:
            return LocalServer(url, config_path, cfg.model, server_overrides + extra, token, out_dir / f"server{i}.log")

        fleet = ServerFleet(cfg.servers, token, timeout=cfg.request_timeout)
        try:
            fleet.start_missing(cfg.start_server, launch)
            fleet.wait_ready(cfg.server_start_timeout)
            served = check_served(fleet, cfg.model, model_dir, cfg.verify, [s.url.rstrip("/") for s in fleet.local],
                                  getattr(server_keys, "served_model_name", ""))
            settings = make_settings(cfg.static_steps, cfg.dynamic_thresholds, [block_size] if block_size else [])
            results += evaluate(cfg.servers, examples, reward, settings, num_samples=cfg.num_samples,
                                max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                                top_p=cfg.top_p, seed=cfg.seed, stop=cfg.stop, batch_size=cfg.batch_size,
                                generate_fn=fleet.generate)
        finally:
            fleet.close()  # stops the servers it started
    return results, served


def eval_facts(cfg: EvalConfig, config_path: str | None) -> list[tuple[str, str]]:
    """The --check summary of `dlrl eval`."""
    where = "a private server of eval.model" if cfg.own_server else ", ".join(cfg.servers)
    return [("servers", where), ("model", cfg.model or "whatever the servers serve (eval.model empty)"),
            ("data", f"{cfg.data or 'the embedded task'} (split {cfg.split}{f', limit {cfg.limit}' if cfg.limit else ''})"),
            ("settings", f"static steps {cfg.static_steps}, dynamic thresholds {cfg.dynamic_thresholds}, pass@1.."
                         f"{cfg.num_samples}"),
            ("output", cfg.output), ("config", config_path or "defaults (no config file)")]


def main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="dlrl eval", description="evaluate a served block-diffusion LM")
    ap.add_argument("--config", default=None, help="YAML config with an `eval` section (default "
                                                   "configs/tiny.yaml when it exists)")
    add_check_args(ap, check_help="parse the command line and the config and check the data file, the reward "
                   "import, the model, the servers' ports and admin token; exit 0 (or 2)",
                   overrides_help="key=value overrides (e.g. data=math500.jsonl num_samples=4)")
    args = ap.parse_intermixed_args(argv)  # key=value overrides before and after flags
    config_path = config_file(args.config)
    try:
        root = load_sections(config_path, args.overrides, {"eval": EvalConfig, "task": ArithmeticTask,
                                                           "server": ServerKeys}, primary="eval")
        cfg, task, server = root["eval"], root["task"], root["server"]
        # load_sections built them from these classes
        assert isinstance(cfg, EvalConfig) and isinstance(task, ArithmeticTask) and isinstance(server, ServerKeys)
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    found: list[tuple[str, str]] = []  # what --check found at each server
    if not args.check_config:  # before loading anything
        problems = eval_problems(cfg, server, config_path, args.overrides, facts=found)
        if problems:
            print("\n".join(f"dlrl eval: error: {p}" for p in problems), file=sys.stderr)  # one per line
            return 2
    if args.check or args.check_config:
        return print_check("eval", cfg, facts=eval_facts(cfg, config_path) + found, as_json=args.json,
                           flag="--check-config" if args.check_config else "--check")
    try:
        results, served = run(cfg, task, config_path, args.overrides, server)
    except (RuntimeError, ValueError, FileNotFoundError, RolloutError) as e:
        print(f"dlrl eval: error: {e}", file=sys.stderr)
        return 1
    print(format_table(results))
    path = write_results(cfg.output, results, config=cfg.model_dump(exclude={"admin_token"}), servers=cfg.servers,
                         served=served)
    log.info("wrote %s", path)
    print(f"results: {path}")
    return 0
