"""Training: optimizer, pure train/eval steps, checkpointing, logging, and the SFTTrainer."""
