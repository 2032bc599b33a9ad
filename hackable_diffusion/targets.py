"""Which dotted module paths (`layers.3.self_attn.q_proj`) a LoRA `target_modules` entry selects.

Shared by `lora.adapters` (which modules get adapters) and `sharding.memory` (what the adapters of a mesh cost), so
that both read `LoraConfig.target_modules` the same way: an entry made of letters, digits, `_` and `.` is a module
name (PEFT's list form), any other entry a regular expression. The vision tower and its projector (paths starting
`vision_tower.` / `embed_vision.`) are selected only by an entry that names one of them, so that module names such
as `"q_proj"` and regexes written for the text model keep the tower frozen.
"""

from __future__ import annotations

import re

_MODULE_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
VISION_MODULES = ("vision_tower", "embed_vision")  # the top-level modules of the tower and its projector


def is_vision_target(path: str) -> bool:
  """Whether dotted `path` lies in the vision tower or its projector."""
  return path.split(".", 1)[0] in VISION_MODULES


def is_module_name(entry: str) -> bool:
  """Whether a `target_modules` entry is a module name (PEFT's list form) rather than a regex."""
  return _MODULE_NAME.fullmatch(entry) is not None


def entry_matches(entry: str, path: str) -> bool:
  """Whether `target_modules` entry `entry` (a module name or a regex, not 'all-linear') selects dotted `path`:
  a name selects a path that, or whose containing module's path, equals it or ends with "." + name; a regex
  is searched in the path. A vision path needs an entry that contains `vision_tower` or `embed_vision`."""
  if is_vision_target(path) and not any(m in entry for m in VISION_MODULES):
    return False
  if is_module_name(entry):
    return f".{path}.".find(f".{entry}.") >= 0
  return re.search(entry, path) is not None


__all__ = ["VISION_MODULES", "entry_matches", "is_module_name", "is_vision_target"]
