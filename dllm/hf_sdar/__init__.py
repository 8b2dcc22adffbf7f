"""The project's transformers-compatible SDAR modeling files, shipped into exports.

`configuration_sdar.py` and `modeling_sdar.py` are copied verbatim next to an exported
`config.json` whose `auto_map` points at them, so that
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` loads an export of
a model that came without modeling files (the embedded default). They import only torch
and transformers; dllm never imports them (see dllm/export.py).
"""
