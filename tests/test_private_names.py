"""No module of the package uses another module's private (underscore) names.

A name another module needs is public: named without an underscore and listed in its module's `__all__`. Checked
from the source with `ast` (nothing is imported): `from <project module> import _name` (also relative and inside
functions), and `module._name` / `package.module._name` on a project module bound by an import. Dunder names
(`__version__`) and a module's own names are not private to it. Attributes of objects (`self._x`, an instance of
another module's class) are not module names and are not checked here.
"""

from __future__ import annotations

import ast
import os
import pathlib

import hackable_diffusion

PACKAGE_DIR = os.path.dirname(hackable_diffusion.__file__)
ROOT = os.path.dirname(PACKAGE_DIR)


def _project_modules() -> dict[str, str]:
  """Dotted module name -> source path, for every module of the package."""
  out = {}
  for path in sorted(pathlib.Path(PACKAGE_DIR).rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = str(path)
  return out


def _is_private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _import_source(module: str, is_package: bool, node: ast.ImportFrom) -> str:
  """The absolute module a `from ... import` statement in `module` reads from."""
  if not node.level:
    return node.module or ""
  base = module.split(".") if is_package else module.split(".")[:-1]
  base = base[:len(base) - (node.level - 1)]
  return ".".join(base + ([node.module] if node.module else []))


def private_uses(module: str, source: str, modules: set[str], is_package: bool = False) -> list[str]:
  """'line: what' for every use in `source` (the text of `module`) of another project module's private name."""
  tree = ast.parse(source)
  bound: dict[str, str] = {}  # local name -> the project module (or package) it is bound to
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom):
      origin = _import_source(module, is_package, node)
      if origin not in modules:
        continue
      for alias in node.names:
        if f"{origin}.{alias.name}" in modules:  # a submodule
          bound[alias.asname or alias.name] = f"{origin}.{alias.name}"
        elif _is_private(alias.name) and origin != module:
          found.append(f"{node.lineno}: from {origin} import {alias.name}")
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name in modules:
          if alias.asname:
            bound[alias.asname] = alias.name
          else:
            bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
      continue
    chain, value = [], node.value
    while isinstance(value, ast.Attribute):
      chain.append(value.attr)
      value = value.value
    if isinstance(value, ast.Name) and value.id in bound:
      target = ".".join([bound[value.id], *reversed(chain)])
      if target in modules and target != module:
        found.append(f"{node.lineno}: {target}.{node.attr}")
  return found


def test_no_module_uses_another_modules_private_names():
  modules = _project_modules()
  names = set(modules)
  problems = []
  for module, path in sorted(modules.items()):
    with open(path, encoding="utf-8") as f:
      source = f.read()
    for use in private_uses(module, source, names, is_package=path.endswith("__init__.py")):
      problems.append(f"{os.path.relpath(path, ROOT)}:{use}")
  assert not problems, ("private names used across modules (make them public, in __all__):\n" + "\n".join(problems))


def test_checker_finds_each_kind_of_use():
  modules = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"}
  source = "\n".join([
      "from pkg.a import _hidden, public",  # 1: private import
      "from pkg import b",
      "from pkg.sub import c as cc",
      "import pkg.sub.c",
      "from . import a",
      "from .a import _relative",  # 6: relative private import
      "def f():",
      "  from pkg.b import _inside",  # 8: inside a function
      "  return b._x, cc._y, pkg.sub.c._z, a.__all__, a.public, b.thing._attr",  # 9: three module attributes
      "from os import _exit",  # not a project module
  ])
  uses = private_uses("pkg.d", source, modules)
  assert uses == ["1: from pkg.a import _hidden", "6: from pkg.a import _relative", "8: from pkg.b import _inside",
                  "9: pkg.b._x", "9: pkg.sub.c._y", "9: pkg.sub.c._z"], uses
  assert private_uses("pkg.a", "from pkg.a import _own\nimport pkg.a\npkg.a._own2", modules) == []
