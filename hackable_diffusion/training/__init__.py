"""Training: optimizer, pure train/eval steps, logging, and the Trainer (the run itself: `runs`)."""
