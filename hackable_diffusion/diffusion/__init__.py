"""Model-agnostic diffusion math: the uniform-state forward process, schedules, canvas choice."""

from hackable_diffusion.diffusion.corruption import SCHEDULES
from hackable_diffusion.diffusion.corruption import CosineSchedule
from hackable_diffusion.diffusion.corruption import LinearSchedule
from hackable_diffusion.diffusion.corruption import choose_canvas
from hackable_diffusion.diffusion.corruption import corrupt_uniform
from hackable_diffusion.diffusion.corruption import gather_canvas
from hackable_diffusion.diffusion.corruption import get_schedule
from hackable_diffusion.diffusion.corruption import sample_time

__all__ = [
    'SCHEDULES', 'CosineSchedule', 'LinearSchedule', 'choose_canvas', 'corrupt_uniform',
    'gather_canvas', 'get_schedule', 'sample_time',
]
