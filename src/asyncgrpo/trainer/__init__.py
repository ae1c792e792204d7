"""The training process: the trainer, its loss, the rollout source and the weight sync."""
