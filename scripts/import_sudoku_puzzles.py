"""Converts a published Sudoku collection into the JSONL the evaluation reads: the installed `hd-import-sudoku`
(`hackable_diffusion/tasks/sudoku/import_puzzles.py`, where the flags are documented), runnable from a checkout.

  python scripts/import_sudoku_puzzles.py --input=puzzles.csv --out=mine.jsonl [--on_bad=skip]
"""

from hackable_diffusion.tasks.sudoku.import_puzzles import run

if __name__ == "__main__":
  run()
