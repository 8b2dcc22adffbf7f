"""Fail early: what `dlrl train` and `dlrl eval` check before loading any weights (and what
`--check` checks): data files, the reward function's import, the model reference, the servers
(a local one that does not answer needs a free port to be started on) and the admin token
(servers that answer must accept it).

    problems = train_problems(cfg, server_keys)   # [] or messages naming the config keys
    fail_early(problems)                          # dlrl_config.cli: ValueError listing them all
"""

from __future__ import annotations

from urllib.parse import urlparse

import httpx

from dllm.hub import model_problem
from dlrl_config.cli import port_problem
from trainer.data.prompts import source_problem
from trainer.infra.local_servers import is_local
from trainer.monitor.trackers import missing_trackers
from trainer.rewards import load_reward_fn
from trainer.run import resolve_token


def data_problem(spec: str, key: str) -> str:
    """"" when `spec` is a readable data source (see trainer.data.prompts), else a message naming `key`."""
    if not spec:
        return ""

    problem = source_problem(spec)
    return f"{key}: {problem}" if problem else ""


def reward_problem(spec: str, key: str) -> str:
    try:
        load_reward_fn(spec)
    except ValueError as e:
        return f"{key}: {str(e).removeprefix('reward: ')}"
    return ""


def server_problems(urls: list[str], token: str, start_server: bool, prefix: str, needs_token: bool,
                    why: str = "") -> list[str]:
    """For each server: answering -> it must accept `token` (when `needs_token` or a token is given);
    not answering -> local and `start_server`, with its port free."""
    problems = []
    for url in urls:
        url = url.rstrip("/")
        try:
            up = httpx.get(url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            up = False
        if not up:
            u = urlparse(url)
            if not (start_server and is_local(url)):
                problems.append(f"{prefix}.servers: {url} does not answer (start it with `dlrl serve`"
                                + (", or use a local address with start_server=true)" if not start_server else ")"))
            else:
                problems.append(port_problem(u.hostname or "127.0.0.1", u.port or 80,
                                             f"{prefix}.servers ({url}: nothing answers there, and the server "
                                             "it would start needs the port; server.port)"))
            continue
        if not token:
            if needs_token:
                problems.append(f"{prefix}.admin_token: {url} is running and dlrl {prefix} needs its admin token "
                                f"{why}({prefix}.admin_token, env DLRL_ADMIN_TOKEN or server.admin_token_file)")
            continue
        try:
            code = httpx.get(url + "/weights/version", headers={"Authorization": f"Bearer {token}"},
                             timeout=10.0).status_code
        except httpx.HTTPError as e:
            problems.append(f"{prefix}.servers: {url} did not answer GET /weights/version: {e}")
            continue
        if code in (401, 403):
            problems.append(f"{prefix}.admin_token: {url} rejects the admin token (HTTP {code}); give the one "
                            f"the server uses ({prefix}.admin_token, env DLRL_ADMIN_TOKEN or server.admin_token_file)")
    return [p for p in problems if p]


def train_problems(cfg, server_keys) -> list[str]:
    problems = [model_problem(cfg.model, "train.model"), data_problem(cfg.data, "train.data"),
                data_problem(cfg.eval_data, "train.eval_data")]
    if cfg.reward not in ("code", "code_strict"):  # a code reward's sandbox is checked when built
        problems.append(reward_problem(cfg.reward, "train.reward"))
    problems.append(missing_trackers([t for t in cfg.report_to if t != "tensorboard" or cfg.tensorboard]))
    problems += server_problems(cfg.servers, resolve_token(cfg, server_keys), cfg.start_server, "train",
                                needs_token=True)
    return [p for p in problems if p]


def eval_problems(cfg, server_keys) -> list[str]:
    problems = [model_problem(cfg.model, "eval.model"), data_problem(cfg.data, "eval.data")]
    if cfg.reward:
        problems.append(reward_problem(cfg.reward, "eval.reward"))
    if not cfg.own_server:
        token = resolve_token(cfg, server_keys)
        problems += server_problems(cfg.servers, token, cfg.start_server, "eval",
                                    needs_token=bool(cfg.model) and cfg.verify == "checksum",
                                    why="to compare the weights it serves with eval.model (or set "
                                        "eval.verify=name to compare model names only) ")
    return [p for p in problems if p]
