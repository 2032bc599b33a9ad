"""Interoperability with Hugging Face transformers (safetensors + config.json) and PEFT adapters."""
