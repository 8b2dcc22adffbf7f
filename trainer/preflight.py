"""Fail early: what `dlrl train` and `dlrl eval` check before loading any weights (and what
`--check` checks): the output folder (a previous run; what --resume would continue), data files, the
reward function's import, the model reference and, from its config.json, its family and the
family's training choices, the servers (a local one that does not answer needs a free port to be
started on; one that answers must serve the model being trained) and the admin token (servers that
answer must accept it).

    problems = train_problems(cfg, root)          # [] or messages naming the config keys
    problems, facts = train_report(cfg, root)     # and what --check found (its summary)
    fail_early(problems)                          # dlrl_config.cli: ValueError listing them all
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import httpx

from dllm.config import ConfigValueError, read_config_json
from dllm.family import detect_family
from dllm.hub import cached_config, model_problem, served_name
from dlrl_config.cli import port_problem
from trainer.data.prompts import source_problem
from trainer.infra.guards import previous_run, previous_run_refusal, resume_state
from trainer.infra.local_servers import ADDRESS_KEYS, address_problems, is_local, resolve_token, serve_command
from trainer.monitor.trackers import missing_trackers
from trainer.objective_registry import check_family
from trainer.rewards import load_reward_fn

if TYPE_CHECKING:
    from trainer.config import ServerKeys, TrainConfig
    from trainer.eval_cli import EvalConfig

Facts = list[tuple[str, str]]  # (what, finding): lines of the --check summary (dlrl_config.cli.print_check)


@dataclass(frozen=True)
class Expected:
    """The model a server must serve for this command: its served name (dllm.hub.served_name), and whether
    a server serving another one may be taken over (train.take_over_servers)."""

    name: str
    key: str  # the config key that names the model (train.model)
    model: str  # its value ("" = the embedded default)
    take_over: bool = False
    purpose: str = "the model being trained"
    remedy: str = ("point train.servers at a server of this model, or set train.take_over_servers=true to train "
                   "it anyway (it is renamed to {name!r})")


def _add(facts: Facts | None, what: str, finding: str) -> None:
    """One line per `what`: a second finding joins the first ("serves ...; accepts the admin token")."""
    if facts is None:
        return
    for i, (w, f) in enumerate(facts):
        if w == what:
            facts[i] = (w, f"{f}; {finding}")
            return
    facts.append((what, finding))


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _identity(url: str, health: dict[str, Any], prefix: str, facts: Facts | None, expect: Expected | None) -> str:
    """The served model's identity at `url` (its /health): a fact, and a problem when it serves another model
    than `expect` (the same refusal as the run's, trainer.infra.guards.check_served_model)."""
    name, version = health.get("model"), health.get("version")
    _add(facts, url, f"serves {name!r} at weight version {version}")
    if expect is None or name is None or name == expect.name:
        return ""
    if expect.take_over:
        _add(facts, url, f"will be taken over and renamed {expect.name!r} ({prefix}.take_over_servers=true)")
        return ""
    return (f"{prefix}.servers: {url} serves {name!r}, not {expect.purpose} ({expect.name!r}, "
            f"{expect.key}={expect.model or '<default>'}): {expect.remedy.format(name=expect.name)}")


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


def serve_refusal(url: str, launch: tuple[str | None, str, list[str]]) -> str:
    """What `dlrl serve --check-config` says of the server command line for `url` (`launch`: config file,
    model, overrides; no torch): "" when it accepts it, else its errors joined."""
    config_path, model, overrides = launch
    cmd = serve_command(url, config_path, model, overrides) + ["--check-config"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not check it: {e}"
    if proc.returncode == 0:
        return ""
    _, found, said = proc.stderr.partition("dlrl serve: error: ")
    return "; ".join(line.removeprefix("dlrl serve: error: ") for line in said.strip().splitlines()) if found \
        else f"exit code {proc.returncode}"


def start_problem(url: str, launch: tuple[str | None, str, list[str]], prefix: str) -> str:
    """What the server this command would start at `url` refuses at start: its own config check."""
    why = serve_refusal(url, launch)
    return f"{prefix}.servers ({url}): the server it would start refuses its config: {why}" if why else ""


def server_problems(urls: list[str], token: str, start_server: bool, prefix: str, needs_token: bool,
                    why: str = "", launch: tuple[str | None, str, list[str]] | None = None,
                    facts: Facts | None = None, expect: Expected | None = None) -> list[str]:
    """For each server: answering -> it must accept `token` (when `needs_token` or a token is given) and,
    with `expect`, serve that model (or be taken over); not answering -> local and `start_server`, with its
    port free and (with `launch`: the config file, model and overrides it would be started with) a config
    the server accepts. `facts` gets one line per server (what it serves, at which weight version)."""
    problems = address_problems(urls, launch[2], prefix) if launch is not None else []
    starts = False  # a server of `urls` is started by this command (its config check runs the overrides)
    for url in urls:
        url = url.rstrip("/")
        try:
            r = httpx.get(url + "/health", timeout=5.0)
            up, health = r.status_code == 200, _json(r)
        except httpx.HTTPError:
            up, health = False, {}
        if up:
            problems.append(_identity(url, health, prefix, facts, expect))
        else:
            _add(facts, url, "nothing answers: this command starts `dlrl serve` there and stops it at the end"
                 if start_server and is_local(url) else "nothing answers")
        if not up:
            u = urlparse(url)
            if not (start_server and is_local(url)):
                problems.append(f"{prefix}.servers: {url} does not answer (start it with `dlrl serve`"
                                + (", or use a local address with start_server=true)" if not start_server else ")"))
            else:
                problems.append(port_problem(u.hostname or "127.0.0.1", u.port or 80,
                                             f"{prefix}.servers ({url}: nothing answers there, and the server "
                                             "it would start needs the port; server.port)"))
                if launch is not None:
                    starts = True
                    problems.append(start_problem(url, launch, prefix))
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
        else:
            _add(facts, url, "accepts the admin token")
    if launch is not None and not starts:
        problems.append(unapplied_server_keys(urls, launch, prefix))
    return [p for p in problems if p]


TRAINER_SERVER_KEYS = ("server.admin_token", "server.admin_token_file", "server.served_model_name")  # read here


def unapplied_server_keys(urls: list[str], launch: tuple[str | None, str, list[str]], prefix: str) -> str:
    """`server.*` overrides configure the servers this command starts; when it starts none they would be
    silently dropped: a typo is named as `dlrl serve` names it (its own --check-config), any other key is
    refused with what to do (the keys this command reads itself, the admin token and served name, pass)."""
    keys = [o for o in launch[2] if o.startswith("server.") and o.split("=", 1)[0] not in ADDRESS_KEYS]
    if not keys:
        return ""
    refused = serve_refusal(urls[0].rstrip("/"), (launch[0], launch[1], keys))
    if refused:
        return refused
    unused = [k for k in keys if k.split("=", 1)[0] not in TRAINER_SERVER_KEYS]
    if not unused:
        return ""
    return (f"{' '.join(unused)}: server.* overrides configure the servers dlrl {prefix} starts, and it starts none "
            f"(every server at {prefix}.servers answers): restart those servers with them (dlrl serve ...), "
            "or drop them")



def output_problems(cfg: TrainConfig, facts: Facts | None = None) -> list[str]:
    """train.output_dir: a previous run there needs --resume or overwrite=true; --resume needs a checkpoint it
    can continue (trainer.infra.guards)."""
    if not cfg.resume:
        found = previous_run(Path(cfg.output_dir))
        if facts is not None:
            facts.append(("output_dir", f"{cfg.output_dir}: " + ("a fresh run" if not found else
                          "the previous run there is replaced (overwrite=true)" if cfg.overwrite else
                          f"holds a previous run ({', '.join(found)})")))
        return [previous_run_refusal(cfg)]
    state = resume_state(cfg)
    if facts is not None:
        facts.append(("output_dir", f"{cfg.output_dir}: --resume continues from its {state.summary()} "
                                    f"to step {cfg.num_steps}" if not state.problem else
                      f"{cfg.output_dir}: {state.summary()}"))
    return [state.problem]


def model_family(cfg: TrainConfig, root: dict[str, Any], key: str = "train.model") -> tuple[str, str | None, str]:
    """(problem, family or None when it cannot be known yet, a line for people) of the model the run trains,
    from its config.json alone (no weights loaded; a hub id only when it is in the local cache)."""
    if not cfg.model:
        arch, folder = root["model"], Path(root["sft"].output_dir)
        made = "trained" if (folder / "config.json").is_file() else "not trained yet: its SFT runs first (minutes)"
        return "", arch.family, f"the embedded default ({arch.family}) in {folder}, {made}"
    path = cached_config(cfg.model)
    if path is None:
        if Path(cfg.model).is_dir():
            return f"{key}: {cfg.model} has no config.json (a Hugging Face model folder)", None, cfg.model
        return "", None, f"{cfg.model}: hub id not in the local cache yet (downloaded at start; its family checked then)"
    try:
        family = detect_family(read_config_json(path))
    except (ConfigValueError, OSError) as e:
        return f"{key}: {cfg.model}: {e}", None, cfg.model
    return "", family, f"{cfg.model} ({family}; config.json read, weights not loaded)"


def train_report(cfg: TrainConfig, root: dict[str, Any], config_path: str | None = None,
                 overrides: list[str] | None = None) -> tuple[list[str], Facts]:
    """Every question `dlrl train` asks before it trains, asked without loading anything: (problems, facts).
    The output folder (previous run, resume state), the model (reference, family and the family's training
    choices), data, reward, trackers, and each server (answers, serves this model, accepts the token; or a
    free port and an accepted config for the one it would start)."""
    facts: Facts = []
    problems = output_problems(cfg, facts)
    problem, family, line = model_family(cfg, root)
    problems += [model_problem(cfg.model, "train.model"), problem]
    facts.append(("model", line))
    if family is not None:
        try:
            check_family(cfg, family)  # the run's own refusal (value model, objectives) for this family
        except ValueError as e:
            problems.append(str(e))
    problems += [data_problem(cfg.data, "train.data"), data_problem(cfg.eval_data, "train.eval_data")]
    if cfg.reward not in ("code", "code_strict"):  # a code reward's sandbox is checked when built
        problems.append(reward_problem(cfg.reward, "train.reward"))
    problems.append(missing_trackers([t for t in cfg.report_to if t != "tensorboard" or cfg.tensorboard]))
    expect = Expected(served_name(cfg.model or root["sft"].output_dir, root["server"].served_model_name),
                      "train.model", cfg.model, cfg.take_over_servers)
    problems += server_problems(cfg.servers, resolve_token(cfg, root["server"]), cfg.start_server, "train",
                                needs_token=True, launch=(config_path, cfg.model, list(overrides or [])),
                                facts=facts, expect=expect)
    facts.append(("run", f"{cfg.objective}{' + value model' if cfg.use_value_model else ''}, {cfg.mode}, "
                         f"{cfg.num_steps} steps of {cfg.prompts_per_step} prompts x {cfg.group_size} samples, "
                         f"reward {cfg.reward}, data {cfg.data or 'the embedded task'}"))
    return [p for p in problems if p], facts


def train_problems(cfg: TrainConfig, root: dict[str, Any], config_path: str | None = None,
                   overrides: list[str] | None = None) -> list[str]:
    return train_report(cfg, root, config_path, overrides)[0]


def eval_problems(cfg: EvalConfig, server_keys: ServerKeys, config_path: str | None = None, overrides: list[str] | None = None,
                  facts: Facts | None = None) -> list[str]:
    """What `dlrl eval` checks before loading: files, reward, model reference, and each server (answers, accepts
    the token; with eval.verify=name and eval.model, serves that model: a checksum needs the weights, so it is
    compared at start). `facts` gets a line per server."""
    problems = [model_problem(cfg.model, "eval.model"), data_problem(cfg.data, "eval.data")]
    if cfg.reward:
        problems.append(reward_problem(cfg.reward, "eval.reward"))
    if not cfg.own_server:
        token = resolve_token(cfg, server_keys)
        expect = (Expected(served_name(cfg.model, server_keys.served_model_name), "eval.model", cfg.model,
                           purpose="eval.model", remedy="point eval.servers at a server of it, or set "
                           "eval.own_server=true to evaluate it on a private server")
                  if cfg.model and cfg.verify == "name" else None)
        problems += server_problems(cfg.servers, token, cfg.start_server, "eval",
                                    needs_token=bool(cfg.model) and cfg.verify == "checksum",
                                    why="to compare the weights it serves with eval.model (or set "
                                        "eval.verify=name to compare model names only) ",
                                    launch=(config_path, cfg.model, list(overrides or [])), facts=facts, expect=expect)
    return [p for p in problems if p]
