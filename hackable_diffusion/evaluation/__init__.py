"""Evaluation: the generation-based evaluation loop (`loop.py`), its report on disk (`report.py`) and several tries
per example (`tries.py`). Tasks (metrics + data hooks) live in `hackable_diffusion.tasks`."""
