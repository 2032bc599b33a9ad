"""Training: optimizer, pure train/eval steps, logging, and the SFTTrainer (the run itself: `runs`)."""
