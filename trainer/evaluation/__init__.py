"""Evaluation: pass@k per decoding setting (evaluate), what each server holds against eval.model
(check). `dlrl eval` itself is trainer/eval_cli.py."""
