"""What a run tells the people watching it: the terminal's step table (`progress`), the
metrics files, Prometheus, TensorBoard and W&B (`metrics_log`), and in a cluster the RLJob's
status and Events (`status`). Best effort: a report that fails never stops training."""
