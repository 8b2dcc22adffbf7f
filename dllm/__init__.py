"""dllm: the block-diffusion language model (SDAR / TraDo compatible).

Config, model, attention masks, block decoding with exact traces, weights I/O,
tokenizer and the embedded tiny default. Imports no sibling package.
"""
