"""Training: data construction per objective (objectives, data), the model to train (modeling), the run's
settings (config), the Accelerate loop (loop) and its checkpoints (checkpoint). Usage: docs/training.md."""
