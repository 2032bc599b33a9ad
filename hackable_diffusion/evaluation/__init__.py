"""Evaluation: tasks (metrics + data hooks) and the generation-based evaluation loop."""

from hackable_diffusion.evaluation.tasks import DigitsTask, EvalRecord, Task, TextTask, get_task

__all__ = ["DigitsTask", "EvalRecord", "Task", "TextTask", "get_task"]
