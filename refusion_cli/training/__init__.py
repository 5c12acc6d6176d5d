"""Training: data construction per objective (objectives, data), the model to train (modeling), the run's
settings (config), Accelerate's set-up (accelerator), the loop (loop) and its checkpoints (checkpoint).
Usage: docs/training.md."""
