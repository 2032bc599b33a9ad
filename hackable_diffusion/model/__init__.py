"""Flax NNX DiffusionGemma: config, layers, attention + KV cache, transformer."""
