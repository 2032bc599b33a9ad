"""The package's layout rules that the import graph (tests/test_import_graph.py) cannot see.

A task lives in its own package: no code outside `tasks/sudoku/` (and the shipped config files) names the Sudoku
task - a CLI or library module that needs task-specific behaviour calls a task hook (`tasks.base`: `parse_prompt`,
`prompt_complete`, `render`, `seed_canvas`, ...). Code means names and string literals; comments and docstrings
(prose that may use the task as an example) are not code. The few names left are tables that map a public name to
the task package, listed in `ALLOWED` with the reason.
"""

from __future__ import annotations

import ast
import io
import os
import tokenize

import hackable_diffusion

PACKAGE_DIR = os.path.dirname(hackable_diffusion.__file__)
TASK = "sudoku"
OWNERS = ("tasks/sudoku/", "configs/")  # the task's own package and the shipped config files
ALLOWED = {
    "tasks/base.py": "BUILTIN_TASKS: the built-in task name -> 'hackable_diffusion.tasks.sudoku.task:SudokuTask'",
    "model/config.py": "the 'sudoku' model preset: a model shape (canvas 81) that config files name",
    "console.py": "the hd-import-sudoku console command, launching tasks/sudoku/import_puzzles.py",
}


def _docstring_lines(tree: ast.AST) -> set[int]:
  lines = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines.update(range(first.lineno, first.end_lineno + 1))
  return lines


def code_mentions(path: str, word: str) -> list[tuple[int, str]]:
  """`(line, token)` of every name or string literal of `path` containing `word` (any case), docstrings excluded."""
  source = open(path, encoding="utf-8").read()
  docs = _docstring_lines(ast.parse(source, path))
  return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
          if tok.type in (tokenize.NAME, tokenize.STRING) and word in tok.string.lower() and tok.start[0] not in docs]


def test_only_the_task_package_names_the_task():
  found = []
  for root, _, names in os.walk(PACKAGE_DIR):
    for name in sorted(names):
      if not name.endswith(".py"):
        continue
      path = os.path.join(root, name)
      rel = os.path.relpath(path, PACKAGE_DIR).replace(os.sep, "/")
      if rel.startswith(OWNERS) or rel in ALLOWED:
        continue
      found += [f"{rel}:{line}: {text[:80]}" for line, text in code_mentions(path, TASK)]
  assert not found, "task-specific code outside tasks/sudoku/ (use a task hook instead):\n" + "\n".join(found)


def test_the_rule_sees_code_but_not_prose(tmp_path):
  path = tmp_path / "m.py"
  path.write_text('"""A Sudoku example in prose."""\n# a sudoku comment\nx = 1  # sudoku\nif name == "sudoku":\n'
                  '  pass\n', encoding="utf-8")
  assert code_mentions(str(path), TASK) == [(4, '"sudoku"')]
