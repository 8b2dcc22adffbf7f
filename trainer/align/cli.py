"""`dlrl align` (continuous alignment) and `dlrl versions` (its version registry).

    dlrl align --config configs/align.yaml                       # until SIGTERM (checkpoint, exit 0)
    dlrl align --config configs/align.yaml max_steps=12 promote_every=3 train.lr=2e-4
    dlrl align --config configs/align.yaml --resume               # continue after a stop
    dlrl align --config configs/align.yaml --check                # parse and validate only
    dlrl versions store=runs/feedback.db [--events] [--json]    # --store PATH: an alias
    dlrl versions --config configs/align.yaml --rollback 12       # every serving replica back to 12

Bare `key=value` overrides go to the `align` section (`trainer.align.config.AlignConfig`),
`train.key=value` to the trainer's (`trainer.config.TrainConfig`; its `servers` are
`align.rollout_servers`), `model.` / `task.` / `sft.` / `server.key=value` to theirs; the config
file is read once (`trainer.align.config.align_sections`). The rollout servers and serving replicas must be running
(`make align` starts them; see examples/align/local.py). SIGTERM / SIGINT: the push in flight is
aborted, a canary in flight is rolled back, a checkpoint is saved, exit 0; a second signal
stops at once. `dlrl align` runs one trainer rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dlrl_config import ConfigError, build, load_sections, parse_overrides
from dlrl_config.cli import ArgumentParser, add_json_arg, print_check
from rollout_client.client import AdminError, RolloutError
from store import open_store
from trainer.align.config import AlignConfig, align_sections, check_train
from trainer.align.registry import NO_PRUNE, rollback_replicas
from trainer.align.replicas import ServingPool
from trainer.align.report import format_events, format_versions
from trainer.cli import Stopper
from trainer.config import ServerKeys, TrainConfig
from trainer.infra.fleet import FleetError
from trainer.infra.local_servers import resolve_token
from weight_sync.errors import WeightSyncError

if TYPE_CHECKING:  # torch, deepspeed: imported once the command runs (--help and --check never import them)
    from transformers import PreTrainedTokenizerBase

    from store import FeedbackStore
    from trainer.align.console import Console
    from trainer.align.controller import Aligner
    from trainer.align.data import PromptPool
    from trainer.run import Run

log = logging.getLogger("dlrl.align")


def parse(argv: list[str]) -> tuple[argparse.Namespace, dict[str, Any], list[str]]:
    """-> (args, root sections, overrides): the config file read once, every section typed; the
    `train` section as `dlrl align` runs it (servers = align.rollout_servers, ...)."""
    ap = ArgumentParser(prog="dlrl align", description="continuous alignment from live traffic")
    ap.add_argument("--config", default="configs/align.yaml")
    ap.add_argument("--resume", action="store_true", help="continue from align.output_dir/checkpoint")
    ap.add_argument("--check", action="store_true", help="only parse the command line and the config; exit 0 "
                                                        "(or 2 with the error)")
    add_json_arg(ap)
    ap.add_argument("overrides", nargs="*", help="key=value (align section) or train.key=value overrides")
    args = ap.parse_intermixed_args(argv)  # key=value overrides before and after flags
    overrides = list(args.overrides)
    try:
        root = load_sections(args.config, overrides, align_sections(), primary="align")
        cfg, train = root["align"], root["train"]
        assert isinstance(cfg, AlignConfig) and isinstance(train, TrainConfig)  # built from these classes
        train = train.replace(servers=list(cfg.rollout_servers), output_dir=cfg.output_dir,
                              eval_data=cfg.eval_data, eval_size=cfg.eval_size, eval_every=0,
                              num_steps=cfg.max_steps or 1_000_000_000, resume=args.resume,
                              admin_token=cfg.admin_token or train.admin_token)
        root["train"] = train
        check_train(cfg, train)
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    return args, root, overrides


def make_sampler_factory(cfg: AlignConfig, train: TrainConfig, store: FeedbackStore,
                         should_stop: Callable[[], bool]) -> Callable[[list[dict], PreTrainedTokenizerBase], PromptPool]:
    from trainer.align.data import PromptPool, StaticPrompts, StorePrompts, TailedJSONL

    def factory(train_examples: list[dict], tokenizer: PreTrainedTokenizerBase) -> PromptPool:
        source: StorePrompts | StaticPrompts | TailedJSONL
        if cfg.prompt_source == "store":
            source = StorePrompts(store, cfg.accept_reward)
        elif cfg.prompt_source == "task":
            source = StaticPrompts(train_examples)
        else:
            source = TailedJSONL(cfg.prompt_source, prompt_field=train.prompt_field or None,
                                 answer_field=train.answer_field or None,
                                 tokenizer=tokenizer if train.chat_template else None)
        return PromptPool(source, train.prompts_per_step, seed=train.seed, wait_s=cfg.prompt_wait_s,
                          should_stop=should_stop)
    return factory


def main(argv: list[str], aligner: type[Aligner] | None = None) -> int:
    """`dlrl align`; `aligner`: the controller class (default Aligner; tests' fakes subclass it)."""
    args, root, overrides = parse(argv)
    cfg, train = root["align"], root["train"]
    if args.check:
        return print_check("align", cfg, train, as_json=args.json, facts=[
            ("rollout servers", ", ".join(cfg.rollout_servers)), ("serving replicas", ", ".join(cfg.serving_replicas)),
            ("store", cfg.store), ("prompts", cfg.prompt_source), ("output_dir", cfg.output_dir),
            ("console", f"http://{cfg.console_host}:{cfg.console_port}" if cfg.console_port else "off")])
    from trainer.align.console import Console
    from trainer.align.controller import Aligner, align_loop
    from trainer.align.data import NoData
    from trainer.infra.dist import RankError
    from trainer.loop import StopRequested
    from trainer.run import build_run

    stopper = Stopper().install()
    store = open_store(cfg.store, **NO_PRUNE)
    run: Run | None = None
    pool: ServingPool | None = None
    al: Aligner | None = None
    console: Console | None = None
    try:
        t0 = time.perf_counter()
        factory = make_sampler_factory(cfg, train, store, lambda: stopper.requested)
        run = build_run(root, args.config, overrides, sampler_factory=factory)
        log.info("trainer built in %.1fs (policy, DeepSpeed engine, rollout servers at version %d)",
                 time.perf_counter() - t0, run.version)
        if run.ranks.world_size > 1:
            raise RuntimeError("train.nproc: dlrl align runs one trainer rank")
        if run.logger is not None:
            run.logger.set_total(cfg.max_steps or None)
        stopper.publisher = run.publisher
        pool = ServingPool(cfg.serving_replicas, resolve_token(train, root["server"]), run.fleet.sync_options)
        al = (aligner or Aligner)(run, cfg, store, pool, should_stop=lambda: stopper.requested)
        t0 = time.perf_counter()
        al.prepare()
        log.info("controller ready in %.1fs", time.perf_counter() - t0)
        if cfg.console_port:
            console = Console(al, resolve_token(train, root["server"]))
            print(f"dlrl align console: {console.start()}", flush=True)
        last = align_loop(al)
        print(json.dumps({"version": run.version, "serving_version": last.get("serving_version"),
                          "serving_accuracy": last.get("serving_accuracy"), **al.counts,
                          "feedback": al.feedback.counts, "output_dir": str(run.out)}, indent=2))
        return 0
    except StopRequested as e:
        log.warning("%s: checkpoint saved; continue with --resume", e)
        return 0
    except (RuntimeError, ValueError, FileNotFoundError, WeightSyncError, RolloutError, AdminError, FleetError,
            RankError, NoData) as e:
        log.error("align stopped: %s", e)
        print(f"dlrl align: error: {e}", file=sys.stderr)
        return 1
    finally:
        for part in (console, al, pool, run, store):
            if part is not None:
                part.close()


# ------------------------------------------------------------------------------ dlrl versions
def versions_main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="dlrl versions", description="the version registry of dlrl align")
    ap.add_argument("--config", default=None, help="align config (store, serving replicas, admin token)")
    ap.add_argument("--store", default=None, help="alias of align.store=PATH (the feedback store path or URL)")
    ap.add_argument("--events", action="store_true", help="list the events (promotions, rollbacks, ...)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--check", action="store_true", help="only parse the command line and the config; exit 0 "
                                                        "(or 2 with the error)")
    ap.add_argument("--rollback", type=int, default=None, metavar="VERSION",
                    help="roll every serving replica back to VERSION (a version that served before)")
    ap.add_argument("overrides", nargs="*", help="align key=value overrides (e.g. store=runs/feedback.db)")
    args = ap.parse_intermixed_args(argv)
    try:
        root = load_sections(args.config, args.overrides, align_sections(), primary="align")
        if args.store is not None:  # the alias of align.store
            if any(k in ("store", "align.store") for k, _ in parse_overrides(args.overrides)):
                raise ConfigError("config key align.store: given both as --store and as store=...; use one")
            root["align"] = build(AlignConfig, {**root["align"].model_dump(), "store": args.store}, "align")
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    cfg = root["align"]
    assert isinstance(cfg, AlignConfig)  # load_sections (or build) made it from AlignConfig
    if args.check:
        return print_check("versions", cfg, facts=[("store", cfg.store)], as_json=args.json)
    path = cfg.store

    if "://" not in path and not os.path.isfile(path):  # a postgresql:// URL is checked by open_store
        ap.error(f"align.store (--store): no feedback store at {path!r}")
    with open_store(path, **NO_PRUNE) as st:
        if args.rollback is not None:
            server = root["server"]
            assert isinstance(server, ServerKeys)  # load_sections built it from ServerKeys
            return manual_rollback(cfg, server, st, args.rollback)
        data = st.events() if args.events else st.versions()
        if args.json:
            print(json.dumps(data, indent=1, default=str))
        else:
            print(format_events(data) if args.events else format_versions(data))
            print(f"\nserving version: {st.serving_version()}")
    return 0


def manual_rollback(cfg: AlignConfig, server: ServerKeys, st: FeedbackStore, version: int) -> int:
    """The registry names `version` the serving version (a running `dlrl align` adopts it and brings
    any replica that fails here to it from its saved weights); then every serving replica goes
    back to it, one at a time, from the versions it keeps in host memory. `server`: the config's
    ServerKeys (admin token fallbacks after align.admin_token and env DLRL_ADMIN_TOKEN)."""
    try:
        result = rollback_replicas(cfg, resolve_token(cfg, server), st, version)  # reads cfg.admin_token first
    except ValueError as e:
        print(f"dlrl versions: error: --rollback: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0 if not any(r.startswith("error") for r in result["replicas"].values()) else 1
