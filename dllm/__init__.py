"""dllm: the block-diffusion language model (SDAR / TraDo compatible).

Config, model, attention masks, block decoding with exact traces, weights I/O, export,
tokenizer and hub references; `dllm.full` the full-attention families (LLaDA, Dream: model, decoding
with exact / prefix-cache modes, replay); `dllm.embedded` is the tiny default trained here and the local
stand-ins. Imports no sibling package but the leaf config library `dlrl_config`.
"""
