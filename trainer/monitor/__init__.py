"""What a run reports: the metrics log (JSONL, TensorBoard, lines, curves), Prometheus
metrics of the training steps, the experiment trackers."""
