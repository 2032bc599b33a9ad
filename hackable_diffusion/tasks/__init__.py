"""Tasks: what to train on and how to score it. A task owns its data, metrics, sampler hooks and attention structure.

`base.py` defines the `Task` interface (`BaseTask` gives the default hooks), `get_task` and shared helpers;
`text.py` the generic text and toy digit tasks; each larger task is a sibling package (`sudoku/`). A task living
elsewhere is named in a config as 'package.module:factory'.
"""

from hackable_diffusion.tasks.base import (BUILTIN_TASKS, BaseTask, EvalRecord, Task, char_accuracy, exact_match,
                                           get_task, write_jsonl_splits)
from hackable_diffusion.tasks.text import DigitsTask, TextTask

__all__ = ["BUILTIN_TASKS", "BaseTask", "DigitsTask", "EvalRecord", "Task", "TextTask", "char_accuracy",
           "exact_match", "get_task", "write_jsonl_splits"]
