"""Evaluation: the generation-based evaluation loop (`loop.py`; several tries per example: `tries.py`). Tasks
(metrics + data hooks) live in `hackable_diffusion.tasks`."""
