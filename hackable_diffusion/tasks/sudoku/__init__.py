"""Sudoku task: puzzle generator, text formatting, metrics and the JSONL dataset writer.

Grids are flat ``[81]`` int arrays in row-major order, 0 = blank.
"""

from hackable_diffusion.tasks.sudoku.dataset import dataset_paths, ensure_dataset, write_dataset
from hackable_diffusion.tasks.sudoku.formatting import (
    parse_grid,
    puzzle_to_prompt,
    render_grid,
    solution_to_completion,
)
from hackable_diffusion.tasks.sudoku.generator import (
    BUCKETS,
    GeneratorConfig,
    SudokuDataset,
    assign_buckets,
    difficulty_bucket,
    generate_bucketed,
    generate_dataset,
    generate_puzzles,
)
from hackable_diffusion.tasks.sudoku.metrics import (
    cell_accuracy_on_blanks,
    is_valid_solution,
    parse_prediction,
    sudoku_metrics,
)
from hackable_diffusion.tasks.sudoku.solver import count_solutions, fill_by_singles, solve, validate_grid

__all__ = [
    'BUCKETS',
    'GeneratorConfig',
    'SudokuDataset',
    'assign_buckets',
    'cell_accuracy_on_blanks',
    'count_solutions',
    'dataset_paths',
    'difficulty_bucket',
    'ensure_dataset',
    'fill_by_singles',
    'generate_bucketed',
    'generate_dataset',
    'generate_puzzles',
    'is_valid_solution',
    'parse_grid',
    'parse_prediction',
    'puzzle_to_prompt',
    'render_grid',
    'solution_to_completion',
    'solve',
    'sudoku_metrics',
    'validate_grid',
    'write_dataset',
]
