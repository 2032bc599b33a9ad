"""The repository speaks of itself only: no tracked text file refers to how it was developed or to files outside it.

Every tracked text file (code, tests, configs, notebooks, docs, README, pyproject, CI) is scanned line by line for
references that mean nothing to a reader of the repository: development sessions, issue numbers of a tracker that
is not part of it, a task description, files next to the checkout, development waves and review rounds. Published
facts are cited to their public source or to `docs/reference.md`. The README is also kept short enough to read at
a glance.

Files come from `git ls-files` run at the repository root (the directory above this file): the tracked files plus
new ones git does not ignore. Where git is missing or the tree is not a git checkout (an unpacked sdist), the tree
is walked instead, minus version-control and build directories, so that the check never passes by finding nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS_FILE = os.path.relpath(os.path.abspath(__file__), ROOT).replace(os.sep, "/")

# Each pattern is assembled from pieces so that this file's own source does not spell any of them out.
FORBIDDEN: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a development session", re.compile(r"\b" + "session" + r"s?[ -]\d", re.IGNORECASE)),
    ("an issue number", re.compile(r"\b" + "issue" + r"s?[ -]#?\d", re.IGNORECASE)),
    ("a task description", re.compile(r"\bthe " + "brief" + r"\b", re.IGNORECASE)),
    ("a file outside the repository", re.compile(r"\.\./" + "shared")),
    ("an outside reference file", re.compile("REFER" + r"ENCE(\.md|\s*§)|DES" + r"IGN(\.md|\s*§)")),
    ("a development wave", re.compile(r"\b" + "wave" + r" \d", re.IGNORECASE)),
    ("a review round", re.compile(r"\breview " + "mend", re.IGNORECASE)),
)

SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".venv", "venv"}
ROOT_SKIP_DIRS = {"runs"}  # training outputs (`--workdir=runs/NAME`); the package's own runs/ is source
README_MAX_LINE = 200
README_MAX_LINES = 120
DOCS_MAX_BYTES = 150_000  # docs/ is a reference manual, not a diary: new pages make room by tightening old ones


def _tracked_files() -> list[str]:
  """Repository-relative paths (with `/`) of the tracked files and the untracked ones git does not ignore, or of
  every file when git cannot list them."""
  if shutil.which("git") is not None:
    # tracked files and new ones not yet added (but not the ignored: runs, build outputs)
    proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                          capture_output=True, check=False)
    if proc.returncode == 0:
      files = [p for p in proc.stdout.decode("utf-8", "surrogateescape").split("\0") if p]
      # a virtualenv made inside the clone (`python3 -m venv v`, as the README allows) is not the project's
      venvs = {p.split("/")[0] for p in files if p.count("/") == 1 and p.endswith("/pyvenv.cfg")}
      files = [p for p in files if p.split("/")[0] not in venvs]
      if files:
        return files
  found = []  # no git or no checkout: every file of the tree, minus VCS / build / cache directories
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")
                   and not (dirpath == ROOT and d in ROOT_SKIP_DIRS)]
    for name in filenames:
      found.append(os.path.relpath(os.path.join(dirpath, name), ROOT).replace(os.sep, "/"))
  return found


def _text(path: str) -> str | None:
  """The file's text, or None for a binary (NUL byte or not UTF-8) or a listed file that is not there."""
  try:
    with open(os.path.join(ROOT, path), "rb") as f:
      data = f.read()
  except (FileNotFoundError, IsADirectoryError):
    return None  # deleted in the working tree but still in the index, or a submodule
  if b"\0" in data[:8192]:
    return None
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


def test_the_file_list_is_not_empty():
  """The scan below sees the package, the tests and the README (a listing that finds nothing would pass it)."""
  files = set(_tracked_files())
  assert {"README.md", "pyproject.toml", "hackable_diffusion/__init__.py"} <= files, sorted(files)[:20]
  assert any(f.startswith("tests/") for f in files), sorted(files)[:20]


def test_no_file_mentions_sessions_issues_or_outside_files():
  """Each hit is listed as `path:line: (what) text`."""
  hits = []
  for path in sorted(_tracked_files()):
    if path == THIS_FILE:
      continue
    text = _text(path)
    if text is None:
      continue
    for number, line in enumerate(text.splitlines(), 1):
      for what, pattern in FORBIDDEN:
        if pattern.search(line):
          hits.append(f"{path}:{number}: ({what}) {line.strip()[:160]}")
          break
  assert not hits, "the repository must speak of itself only:\n" + "\n".join(hits)


def test_readme_is_short():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  long_lines = [f"README.md:{i}: {len(line)} characters" for i, line in enumerate(lines, 1)
                if len(line) > README_MAX_LINE]
  assert not long_lines, f"README.md lines over {README_MAX_LINE} characters:\n" + "\n".join(long_lines)
  assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_docs_stay_a_manual_not_a_diary():
  """All of docs/ together stays within DOCS_MAX_BYTES."""
  docs = [f for f in _tracked_files() if f.startswith("docs/") and f.endswith(".md")]
  sizes = {f: os.path.getsize(os.path.join(ROOT, f)) for f in docs if os.path.exists(os.path.join(ROOT, f))}
  assert docs and sum(sizes.values()) <= DOCS_MAX_BYTES, (
      f"docs/ holds {sum(sizes.values())} bytes (at most {DOCS_MAX_BYTES}); largest: "
      f"{sorted(sizes.items(), key=lambda kv: -kv[1])[:3]}")
