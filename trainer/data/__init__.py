"""Prompts: records to examples and the prompt sampler (prompts), and where records come from
(sources: JSONL / JSON / Parquet / CSV, save_to_disk folders, hub datasets)."""
