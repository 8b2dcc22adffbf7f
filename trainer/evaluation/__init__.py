"""Evaluation: pass@k per decoding setting (evaluate), `dlrl eval` (cli), what each server
holds against eval.model (check)."""
