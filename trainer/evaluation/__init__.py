"""Evaluation: pass@k per decoding setting (evaluate), what each server
holds against eval.model (check)."""
