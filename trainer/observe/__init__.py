"""What a run reports: the metrics log and its plots, and the trackers (TensorBoard, W&B, MLflow)."""
