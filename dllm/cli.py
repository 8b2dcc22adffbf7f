"""CLI of the dllm package: `dlrl sft` and `dlrl generate`.

    dlrl sft --config configs/tiny.yaml sft.steps=200
    dlrl generate --model runs/tiny-sft --prompt "12+34=" --temperature 0 --trace
"""

from __future__ import annotations

import argparse
import json
import sys

from dllm.configlib import ConfigError, print_check


def sft_main(argv: list[str]) -> int:
    from dllm.sft import run_sft
    from dllm.tiny import load_tiny_sections

    ap = argparse.ArgumentParser(prog="dlrl sft", description="block-diffusion SFT of the embedded default")
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--check", action="store_true", help="only parse the command line and the config; exit 0 "
                                                        "(or 2 with the error)")
    ap.add_argument("overrides", nargs="*", help="key=value (e.g. sft.steps=200)")
    args = ap.parse_args(argv)
    try:
        arch, task, sft = load_tiny_sections(args.config, args.overrides, primary="sft")
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    if args.check:
        return print_check("sft", arch, task, sft)
    metrics = run_sft(arch, task, sft)
    print(json.dumps(metrics, indent=2))
    return 0


def generate_main(argv: list[str]) -> int:
    import torch

    from dllm.decoding import generate
    from dllm.sampling import STRATEGIES, SamplingParams
    from dllm.tokenizer import encode, load_tokenizer
    from dllm.weights import load_pretrained

    ap = argparse.ArgumentParser(prog="dlrl generate", description="generate with block diffusion")
    ap.add_argument("--model", required=True, help="model folder (config.json, safetensors, tokenizer) or hub repo "
                                                   "id org/name[@revision]")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--strategy", choices=STRATEGIES, default="dynamic")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--trace", action="store_true", help="print the decoding trace as JSON")
    args = ap.parse_args(argv)
    try:
        from dllm.hub import resolve_model

        folder = resolve_model(args.model, "--model")
        model = load_pretrained(folder, device=args.device, dtype=args.dtype)
        tok = load_tokenizer(folder)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, strategy=args.strategy, steps=args.steps,
                                threshold=args.threshold, seed=args.seed, stop=args.stop)
        params.validate(model.config.block_size)
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e).replace("max_tokens", "--max-tokens").replace("top_k", "--top-k")
                 .replace("top_p", "--top-p"))
    prompts = args.prompt
    if args.chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    outs = generate(model, [encode(tok, p) for p in prompts], params, tok)
    for p, o in zip(args.prompt, outs):
        print(f"{p}{o.text}" if not args.chat else o.text)
        if args.trace:
            print(json.dumps({"completion_ids": o.completion_ids, "finish_reason": o.finish_reason,
                              "num_forwards": o.num_forwards, "trace": o.trace.to_dict()}))
    sys.stdout.flush()
    return 0
