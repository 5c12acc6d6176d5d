"""Training: data construction per objective (objectives, data), the model to train (modeling), the run's
settings (config) and named recipes of them (recipes), Accelerate's set-up (accelerator), the loop (loop), its learning-rate schedule (schedule),
the validation loss (evaluation), the resume checks (resume) and the checkpoints (checkpoint). Usage:
docs/training.md."""
