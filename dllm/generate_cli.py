"""`dlrl generate`: print completions of a model folder (or hub id) with block diffusion.

    dlrl generate model=runs/tiny-sft prompt=12+34= max_tokens=6 temperature=0 trace=true
    dlrl generate --model runs/tiny-sft --prompt "12+34=" --max-tokens 6 --trace   # the same (aliases)
    dlrl generate --config gen.yaml prompt="2+2="                                  # a `generate:` section

Options are the keys of `GenerateConfig` (the `generate` section of a YAML file, `key=value` or
`generate.key=value` on the command line; `dlrl generate --help` lists them). The old
`--max-tokens`-style flags are aliases of the same keys; giving a key both ways is an error.
`prompt` and `stop` take their text as it is (no YAML parsing, commas kept) and are repeatable
(`prompt=a prompt=b` generates both). Bad values exit 2 naming the key before the model loads.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Literal

from pydantic import Field

from dllm.options import SamplingOptions, Temperature, Threshold
from dllm.ranges import THRESHOLD
from dllm.strategy import Strategy, StrategyField
from dlrl_config import Config, ConfigError, build, load_sections
from dlrl_config.cli import ArgumentParser, add_json_arg, print_check

TEXT_KEYS = ("prompt", "stop")  # raw text, repeatable
ALIASES = {  # --flag -> key; store_true flags set the key to true
    "--model": "model", "--prompt": "prompt", "--chat": "chat", "--max-tokens": "max_tokens",
    "--temperature": "temperature", "--top-k": "top_k", "--top-p": "top_p", "--strategy": "strategy",
    "--steps": "steps", "--threshold": "threshold", "--seed": "seed", "--stop": "stop", "--dtype": "dtype",
    "--device": "device", "--trace": "trace"}
FLAGS = {"--chat", "--trace"}


class GenerateConfig(Config, SamplingOptions):
    """`dlrl generate`: the model, the prompts and the sampling parameters."""

    model: str = ""  # model folder (config.json, safetensors, tokenizer) or hub repo id org/name[@revision]
    prompt: list[str] = Field(default_factory=list)  # prompt text (repeatable: prompt=a prompt=b)
    chat: bool = False  # wrap each prompt in the tokenizer's chat template
    max_tokens: int = Field(64, ge=1)  # tokens to generate per prompt
    temperature: Temperature = 0.0  # 0: greedy
    strategy: StrategyField = Strategy.dynamic  # which masked positions each denoising step commits
    steps: int | None = Field(None, ge=1)  # denoising steps per block (none: the strategy's default)
    threshold: Threshold = THRESHOLD.default  # confidence a `dynamic` step commits above
    seed: int | None = Field(None, ge=0)  # sampling seed (none: random)
    stop: list[str] = Field(default_factory=list)  # stop strings (repeatable)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights' dtype
    device: str = "auto"  # auto (cuda when available, else cpu), cpu, cuda, cuda:N
    trace: bool = False  # also print each completion's decoding trace as one JSON line

    def check(self) -> None:
        if any(not s for s in self.stop):
            raise ValueError("generate.stop: stop strings must be non-empty")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", self.device):
            raise ValueError(f"generate.device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="dlrl generate", description="generate with block diffusion; options are "
                                 "key=value (see the config keys below); the --flags are aliases of those keys")
    ap.add_argument("--config", default=None, help="YAML file with a `generate` section (default: none)")
    ap.add_argument("--check", action="store_true", help="only parse the command line and the config; exit 0 "
                                                        "(or 2 with the error)")
    add_json_arg(ap)
    for flag, key in ALIASES.items():
        if flag in FLAGS:
            ap.add_argument(flag, dest=key, action="store_const", const=True, default=None,
                            help=f"alias of {key}=true")
        elif key in TEXT_KEYS:
            ap.add_argument(flag, dest=key, action="append", default=None, help=f"alias of {key}=TEXT (repeatable)")
        else:
            ap.add_argument(flag, dest=key, default=None, metavar=key.upper(), help=f"alias of {key}=VALUE")
    ap.add_argument("overrides", nargs="*", help="key=value or generate.key=value (e.g. max_tokens=32)")
    return ap


def _name_aliases(message: str) -> str:
    """'generate.top_p: ...' -> 'generate.top_p (--top-p): ...' so users of either style see theirs."""
    flags = {key: flag for flag, key in ALIASES.items()}
    return re.sub(r"generate\.(\w+)\b", lambda m: f"{m.group(0)} ({flags[m.group(1)]})"
                  if m.group(1) in flags else m.group(0), message)


def load_config(args: argparse.Namespace) -> GenerateConfig:
    """The file's `generate` section, then the key=value overrides, then the --flag aliases (a key set
    both ways is refused). ConfigError names the key."""
    text: dict[str, list[str]] = {k: [] for k in TEXT_KEYS}
    rest = []
    for item in args.overrides:
        key, eq, raw = item.partition("=")
        key = key.strip().lstrip("-").removeprefix("generate.")
        if eq and key in TEXT_KEYS:
            text[key].append(raw)
        else:
            rest.append(item)
    cfg = load_sections(args.config, rest, {"generate": GenerateConfig}, primary="generate")["generate"]
    given = {k.removeprefix("generate.") for k in (o.partition("=")[0].strip().lstrip("-") for o in args.overrides)}
    changes = {k: v for k, v in text.items() if v}
    for key in dict.fromkeys(ALIASES.values()):
        value = getattr(args, key)
        if value is None:
            continue
        if key in given:
            flag = next(f for f, k in ALIASES.items() if k == key)
            raise ConfigError(f"config key generate.{key}: given both as {flag} and as {key}=...; use one")
        changes[key] = value
    cfg = build(GenerateConfig, {**cfg.model_dump(), **changes}, "generate")
    if not cfg.prompt:
        raise ConfigError("config key generate.prompt: required (prompt=TEXT or --prompt TEXT)")
    if not cfg.model:
        raise ConfigError("config key generate.model: required (a model folder or hub id: model=DIR or --model DIR)")
    return cfg


def generate_main(argv: list[str]) -> int:
    ap = build_parser()
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = load_config(args)
    except (ConfigError, ValueError) as e:
        ap.error(_name_aliases(str(e)))
    if args.check:
        return print_check("generate", cfg, as_json=args.json)
    return run(cfg, ap)


def run(cfg: GenerateConfig, ap: argparse.ArgumentParser) -> int:
    import torch

    from dllm.decoding import generate
    from dllm.hub import resolve_model
    from dllm.sampling import SamplingParams
    from dllm.tokenizer import encode, load_tokenizer
    from dllm.weights import load_pretrained

    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                            top_p=cfg.top_p, strategy=cfg.strategy, steps=cfg.steps, threshold=cfg.threshold,
                            seed=cfg.seed, stop=list(cfg.stop))
    try:
        folder = resolve_model(cfg.model, "generate.model")
        model = load_pretrained(folder, device=device, dtype=cfg.dtype)
        tok = load_tokenizer(folder)
        params.validate(model.config.block_size)  # steps <= the model's block size
    except (FileNotFoundError, ValueError) as e:
        ap.error(_name_aliases(re.sub(r"^(max_tokens|temperature|top_k|top_p|strategy|steps|threshold|seed|stop):",
                                      r"generate.\1:", str(e))))
    prompts = cfg.prompt
    if cfg.chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    outs = generate(model, [encode(tok, p) for p in prompts], params, tok)
    for p, o in zip(cfg.prompt, outs):
        print(f"{p}{o.text}" if not cfg.chat else o.text)
        if cfg.trace:
            print(json.dumps({"completion_ids": o.completion_ids, "finish_reason": o.finish_reason,
                              "num_forwards": o.num_forwards, "trace": o.trace.model_dump()}))
    sys.stdout.flush()
    return 0
