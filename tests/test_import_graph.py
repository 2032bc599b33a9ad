"""The package's import graph: no cycle, and no module imports from a layer above its own (docs/design.md).

Every `import` / `from ... import` statement counts, also inside functions (a function-level import that hides a
cycle is still a cycle). Imports are read from the source with `ast`; nothing is imported.
"""

from __future__ import annotations

import ast
import os

import hackable_diffusion

PACKAGE_DIR = os.path.dirname(hackable_diffusion.__file__)

# Bottom to top. A module may import from its own layer or below. Keys are the first component below the package
# (a subpackage or a top-level module); `hackable_diffusion/__init__.py` (lazy names only) is not in a layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "files", "specs", "targets", "hub", "configs", "hugepages"),
    ("sharding",),
    ("model",),
    ("data",),
    ("diffusion",),
    ("sampling",),
    ("lora",),
    ("interop",),
    ("tasks",),
    ("evaluation",),
    ("runs",),
    ("training",),
    ("cli",),
    ("train", "evaluate", "sample", "export", "console"),
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-len(".py")].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str, module: str, modules: set[str]) -> set[str]:
  """Project modules imported anywhere in the file (absolute names; relative imports resolved)."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  is_package = path.endswith("__init__.py")
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = module.split(".")
        parts = parts[:len(parts) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([base] if base else []))
      for a in node.names:  # `from pkg import module` imports the module; `from module import name` the module
        out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
  return {m for m in out if m == "hackable_diffusion" or m.startswith("hackable_diffusion.")}


def _graph() -> dict[str, set[str]]:
  files = {}
  for root, _, names in os.walk(PACKAGE_DIR):
    for name in names:
      if name.endswith(".py"):
        path = os.path.join(root, name)
        files[_module_name(path)] = path
  return {m: {i for i in _imports(p, m, set(files)) if i in files and i != m} for m, p in files.items()}


GRAPH = _graph()


def _layer(module: str) -> int | None:
  parts = module.split(".")
  return LAYER_OF.get(parts[1]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
  missing = sorted(m for m in GRAPH if m != "hackable_diffusion" and _layer(m) is None)
  assert not missing, f"modules outside the layer table (add them to LAYERS and docs/design.md): {missing}"


def test_no_upward_import():
  upward = sorted(f"{m} (layer {_layer(m)}) imports {i} (layer {_layer(i)})" for m, deps in GRAPH.items()
                  for i in deps if _layer(m) is not None and _layer(i) is not None and _layer(i) > _layer(m))
  assert not upward, "\n".join(upward)


# Evaluation, sampling and export read a run through `runs`; they never reach into training (not even through
# another module): a change to the trainer cannot break them, and they run where training's dependencies are absent.
NOT_THROUGH_TRAINING = ("hackable_diffusion.evaluation", "hackable_diffusion.sampling", "hackable_diffusion.runs",
                        "hackable_diffusion.sample", "hackable_diffusion.evaluate", "hackable_diffusion.export")


def _reachable(module: str) -> set[str]:
  seen, todo = set(), [module]
  while todo:
    for dep in GRAPH.get(todo.pop(), ()):
      if dep not in seen:
        seen.add(dep)
        todo.append(dep)
  return seen


def test_evaluation_sampling_and_export_never_import_training():
  roots = sorted(m for m in GRAPH if any(m == r or m.startswith(r + ".") for r in NOT_THROUGH_TRAINING))
  assert "hackable_diffusion.runs.run" in roots and "hackable_diffusion.sample" in roots
  bad = sorted(f"{m} -> {i}" for m in roots for i in _reachable(m) if i.startswith("hackable_diffusion.training"))
  assert not bad, "\n".join(bad)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan), each sorted."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  cycles: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return cycles


def test_no_cycle():
  assert find_cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_planted_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
  assert find_cycles(graph) == [["a", "b", "c"]]
  assert find_cycles({"a": {"b"}, "b": set()}) == []
