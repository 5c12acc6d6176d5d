"""Training: data construction per objective (objectives, data), the model to train (modeling), the
Accelerate loop (loop) and its checkpoints (checkpoint). Usage: docs/training.md."""
