"""`dlrl serve`: load a model and serve the generation API with uvicorn.

    dlrl serve --config configs/tiny.yaml [server.host=127.0.0.1 server.port=8000 server.model=DIR] \
        [server.max_batch=32 server.admin_token=... ...]     # --host/--port/--model: aliases

`server.model` empty (the default) serves the embedded tiny default, trained on first use
by `dllm.embedded.tiny.ensure_default_model`. Binds 127.0.0.1 unless told otherwise. The admin
token comes from `server.admin_token` or the DLRL_ADMIN_TOKEN environment variable.
By default the engine runs in its own process and HTTP in `server.api_processes` others sharing the
port (server.core.supervisor); `server.engine_core=thread` serves from one process, the engine on a
thread of it (as before the split). SIGTERM / SIGINT shut down gracefully (server.api.lifecycle): new
requests get 503, requests in flight get up to `server.shutdown_timeout` seconds, then the process
exits 0 (1 if the engine core died).
Connections are bounded (server.api.connections: header/read/keep-alive timeouts, caps per
client and in total, a reserve for probes and admin, rate-limited resource errors).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dlrl_config import ConfigError
from dlrl_config.cli import DEFAULT_CONFIG, ArgumentParser, add_check_args, config_file, print_check
from server.config import ServerConfig, load_server_config

if TYPE_CHECKING:
    from server.engine.engine import Engine

log = logging.getLogger("dlrl.server")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dlrl serve", description="Serve a block-diffusion LM over HTTP.")
    p.add_argument("--config", default=None, help=f"YAML config with a `server` section (default {DEFAULT_CONFIG} "
                                                   "when it exists)")
    p.add_argument("--host", default=None, help="alias of server.host=HOST (bind address, default 127.0.0.1)")
    p.add_argument("--port", default=None, help="alias of server.port=PORT (TCP port, default 8000)")
    p.add_argument("--model", default=None, help="alias of server.model=DIR (model folder or hub id; default: the "
                                                 "embedded tiny model)")
    add_check_args(p, check_help="parse the command line and the config, check the model and that the port is "
                   "free; exit 0 (or 2 with the error)", overrides_help="config overrides, e.g. server.max_batch=32")
    return p


def apply_aliases(config: ServerConfig, args: argparse.Namespace) -> ServerConfig:
    """--host/--port/--model onto server.host/port/model; a key given both ways is refused."""
    from dlrl_config import build, parse_overrides

    changes = {k: v for k, v in (("host", args.host), ("port", args.port), ("model", args.model)) if v is not None}
    given = {k.removeprefix("server.") for k, _ in parse_overrides(args.overrides)}
    for key in changes.keys() & given:
        raise ConfigError(f"config key server.{key}: given both as --{key} and as server.{key}=...; use one")
    return build(ServerConfig, {**config.model_dump(), **changes}, "server") if changes else config


def resolve_model(config: ServerConfig, config_path: str | None, overrides: list[str] | None = None) -> str:
    """The model folder to serve: `config.model` (a folder or a hub repo id, dllm.hub), or the
    embedded default (trained if missing)."""
    if config.model:
        from dllm.hub import ModelNotFound
        from dllm.hub import resolve_model as resolve_ref

        try:
            return str(resolve_ref(config.model, "server.model"))
        except ModelNotFound as e:
            raise SystemExit(f"dlrl serve: error: {e}") from None
    from dllm.embedded.sft import SFTStopped
    from dllm.embedded.tiny import ensure_default_model, load_tiny_sections

    log.info("no server.model given: using the embedded tiny default (trains it first if missing)")
    try:
        return str(ensure_default_model(*load_tiny_sections(config_path or DEFAULT_CONFIG, overrides)))
    except SFTStopped as e:  # SIGTERM / SIGINT during the first-start SFT: a clean exit, nothing served
        print(f"dlrl serve: {e}", file=sys.stderr, flush=True)
        raise SystemExit(0) from None


def serve_facts(config: ServerConfig, config_path: str | None, overrides: list[str]) -> list[tuple[str, str]]:
    """The --check summary of `dlrl serve`: where it listens, what it serves (and under which name)."""
    if config.model:
        model = f"{config.model}, served as {config.model_name()!r}"
    else:
        from dllm.embedded.tiny import load_tiny_sections

        folder = Path(load_tiny_sections(config_path or DEFAULT_CONFIG, overrides)[2].output_dir)
        made = "" if (folder / "config.json").is_file() else ", trained first (minutes)"
        model = f"the embedded default in {folder}{made}, served as {config.model_name(folder)!r}"
    return [("address", f"http://{config.host}:{config.port}"), ("model", model),
            ("engine", f"{config.backend} backend, max_batch {config.max_batch}, likelihood {config.likelihood}"),
            ("config", config_path or "defaults (no config file)")]


def backend_options(config: ServerConfig) -> dict[str, object]:
    """The keys only one backend reads: lmdeploy's engine-wide decoding, native's withheld traces."""
    if config.backend == "lmdeploy":  # the full-attention keys too: refused there by name unless left default
        return {"strategy": config.default_strategy, "threshold": config.default_threshold,
                "lmdeploy_steps": config.lmdeploy_steps, "kv_admission": config.kv_admission,
                "cache_mode": config.cache_mode, "further_horizon": config.further_horizon, "ranking": config.ranking,
                "rng": config.rng}
    native: dict[str, object] = {"trace_free": config.trace_free, "cache_mode": config.cache_mode,
                              "further_horizon": config.further_horizon, "ranking": config.ranking, "rng": config.rng,
                              "prefix_caching": config.prefix_caching}
    if config.kv_admission != "reserve":  # other runners never receive it by default
        native["kv_admission"] = config.kv_admission
    return native


def build_engine(config: ServerConfig, model_path: str) -> Engine:
    from server.engine.backends import create_backend
    from server.engine.engine import Engine

    backend = create_backend(config.backend, model_path, device=config.device, dtype=config.dtype,
                             max_batch=config.max_batch, max_model_len=config.max_model_len,
                             trust_remote_code=config.trust_remote_code, block_size=config.block_size,
                             mask_token_id=config.mask_token_id, kv_cache_memory=config.kv_cache_memory,
                             kv_cache_fraction=config.kv_cache_fraction, keep_versions=config.keep_versions,
                             compile=config.compile, cuda_graphs=config.cuda_graphs, **backend_options(config))
    return Engine(backend, max_queue=config.max_queue, max_queue_tokens=config.max_queue_tokens,
                  model_name=config.model_name(model_path))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # key=value overrides before and after flags
    config_path = config_file(args.config)
    try:
        config = apply_aliases(load_server_config(config_path, args.overrides), args)
    except ConfigError as e:
        parser.error(str(e))
    if not args.check_config:  # before loading anything: the port is free, the model exists
        from dllm.hub import model_problem
        from dlrl_config.cli import fail_early, port_problem

        try:
            fail_early([port_problem(config.host, config.port, "server.port / --port"),
                        model_problem(config.model, "server.model / --model")])
        except ValueError as e:
            parser.exit(2, "".join(f"dlrl serve: error: {line}\n" for line in str(e).splitlines()))
    if args.check or args.check_config:
        return print_check("serve", config, facts=serve_facts(config, config_path, args.overrides), as_json=args.json,
                           flag="--check-config" if args.check_config else "--check")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from server.engine.backends import BackendUnavailable, check_backend

    try:
        check_backend(config.backend)  # lmdeploy installed, a CUDA device: before a model is resolved or trained
    except BackendUnavailable as e:
        parser.exit(2, f"dlrl serve: error: {e}\n")
    model_path = resolve_model(config, config_path, args.overrides)
    if config.engine_core == "process":
        from server.core.supervisor import Supervisor

        code = Supervisor(config, model_path).run()
        log.info("server stopped")
        if code == 2:  # a configuration or load error (printed): exits as the one-process layout's errors do
            parser.exit(2)
        return code
    return serve_in_one_process(parser, config, model_path)


def serve_in_one_process(parser: argparse.ArgumentParser, config: ServerConfig, model_path: str) -> int:
    """server.engine_core=thread: the engine core on a thread of the one HTTP process."""
    from server.api.app import create_app
    from server.api.lifecycle import http_server
    from server.api.state import server_state
    from server.engine.backends import BackendUnavailable

    try:
        engine = build_engine(config, model_path)
    except BackendUnavailable as e:
        parser.exit(2, f"dlrl serve: error: {e}\n")
    except ConfigError as e:  # e.g. the KV cache cannot hold one sequence of max_model_len
        parser.exit(2, f"dlrl serve: error: {e}\n")
    except (ValueError, FileNotFoundError) as e:  # bad folder / option: the message names it
        parser.exit(2, f"dlrl serve: error: cannot load {model_path}: {e}\n")
    try:
        app = create_app(engine, config, model_path)
        server = http_server(app, config)
    except ConfigError as e:  # e.g. server.store cannot be opened, feedback token = admin token, no file room
        parser.exit(2, f"dlrl serve: error: {e}\n")
    log.info("serving model %s (%s) from %s with backend %s, max_batch=%d, max_model_len=%d",
             engine.model_name, getattr(engine.model, "dtype", "?"), model_path, config.backend,
             config.max_batch, engine.max_model_len)
    if engine.info.family != "sdar":
        log.info("prompt log-likelihoods (echo + logprobs, prompt_logprobs): LLaDA's Monte Carlo ELBO, %d samples "
                 "per context / continuation split (server.elbo_samples; server.likelihood applies to block-causal "
                 "models)", config.elbo_samples)
    log.info("listening on http://%s:%d (admin endpoints %s)", config.host, config.port,
             "enabled" if server_state(app).admin_token else "disabled: no admin token")
    server.run()
    log.info("server stopped")
    return 1 if server_state(app).engine.dead and not server_state(app).is_draining else 0


if __name__ == "__main__":
    raise SystemExit(main())
