"""Evaluation: the generation-based evaluation loop (`loop.py`). Tasks (metrics + data hooks) live in
`hackable_diffusion.tasks`."""
