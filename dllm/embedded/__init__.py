"""The embedded default and the local stand-ins: what dlrl builds itself, with no download.

    dlrl sft --config configs/tiny.yaml          # cli.py: train the tiny default (sft.py)
    path = ensure_default_model(arch, task, sft)  # tiny.py: the folder servers and trainers load

tiny.py (the `model`/`task`/`sft` sections and the trained-once default), task.py (the toy
addition task and its imperfect teacher), sft.py (block-diffusion SFT), standin.py (a Qwen
BPE tokenizer and random-weight folders of real configs' shapes, for tests and benchmarks).
Built on the model in dllm/; nothing in dllm/ imports this package.
"""
