"""Training: data construction per objective (objectives, data), the model to train (modeling), the run's
settings (config), Accelerate's set-up (accelerator), the loop (loop), the resume checks (resume) and the
checkpoints (checkpoint). Usage: docs/training.md."""
