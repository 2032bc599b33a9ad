"""Transparent huge pages for malloc: the CLIs re-execute themselves once with `glibc.malloc.hugetlb=1`.

XLA:CPU allocates a step's temporaries fresh every step, and glibc hands large blocks back to the kernel on free, so
every step touches its working set again one 4 KiB page at a time: hundreds of thousands of minor page faults per
train step, and a large share of the CPU time spent in the kernel. glibc >= 2.35 asks for 2 MiB pages on its own
allocations when `GLIBC_TUNABLES` holds `glibc.malloc.hugetlb=1`, where the kernel's transparent huge pages are in
`madvise` mode (the common default), which cuts the faults per step by orders of magnitude (docs/results.md has
the current count with and without). The tunable is read only when a process starts, so a CLI that wants it
re-executes itself (same interpreter, same arguments, same PID) before importing JAX.

Nothing happens when the tunable would change nothing or the user already chose: not Linux, not glibc >= 2.35,
transparent huge pages `always` or `never` (or unreadable), `GLIBC_TUNABLES` already naming
`glibc.malloc.hugetlb`, or `HD_MALLOC_HUGEPAGES=0` (or false / no / off) in the environment (the opt-out; 1 / true /
yes / on or unset: the default; any other value is a one-line error, so a typo is not silently ignored).
The Python API never re-executes anything; set the variable before starting Python to get the same effect there:

  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python my_script.py
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT_ENV = "HD_MALLOC_HUGEPAGES"  # "0" (or false / no / off): never re-execute
OPT_OUT_VALUES = ("0", "false", "no", "off")
OPT_IN_VALUES = ("", "1", "true", "yes", "on")  # "": unset or empty, the default
THP_ENABLED_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)  # the first glibc with the glibc.malloc.hugetlb tunable


def thp_mode(path: str = THP_ENABLED_PATH) -> str | None:
  """The kernel's transparent-huge-page mode (`always`, `madvise` or `never`: the bracketed word), None if unknown."""
  try:
    with open(path, encoding="ascii") as f:
      text = f.read()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1:end] if 0 <= start < end else None


def glibc_version(libc: tuple[str, str]) -> tuple[int, ...] | None:
  """(2, 36) for `platform.libc_ver()` == ('glibc', '2.36'); None for another libc or an unparsable version."""
  name, version = libc
  if name != "glibc":
    return None
  try:
    return tuple(int(part) for part in version.split("."))
  except ValueError:
    return None


def with_hugetlb(tunables: str | None) -> str:
  """`GLIBC_TUNABLES` with `glibc.malloc.hugetlb=1` appended to what it already holds (colon-separated)."""
  entry = f"{TUNABLE}=1"
  return f"{tunables}:{entry}" if tunables else entry


def should_reexec(env: Mapping[str, str], *, system: str, libc: tuple[str, str], thp: str | None) -> bool:
  """Whether re-executing with the tunable would turn on huge pages for malloc that the process does not have."""
  choice = env.get(OPT_OUT_ENV, "").strip().lower()
  if choice not in OPT_OUT_VALUES + OPT_IN_VALUES:
    raise ValueError(f"{OPT_OUT_ENV}={env[OPT_OUT_ENV]!r}: expected 0 / false / no / off (no huge pages for malloc) "
                     "or 1 / true / yes / on (the default)")
  if choice in OPT_OUT_VALUES or TUNABLE in env.get("GLIBC_TUNABLES", ""):
    return False
  version = glibc_version(libc)
  return system == "Linux" and version is not None and version >= MIN_GLIBC and thp == "madvise"


def reexec_with_malloc_hugepages() -> None:
  """Re-executes this process (`sys.executable` with `sys.orig_argv`) with the tunable set, if `should_reexec`.

  Call it first thing in a CLI's `__main__`, before JAX is imported: it does not return when it re-executes. An
  unknown `HD_MALLOC_HUGEPAGES` value exits with a one-line error.
  """
  env = dict(os.environ)
  try:
    reexec = should_reexec(env, system=platform.system(), libc=platform.libc_ver(), thp=thp_mode())
  except ValueError as e:
    sys.exit(f"error: {e}")  # one line on stderr, exit status 1
  if not reexec:
    return
  env["GLIBC_TUNABLES"] = with_hugetlb(env.get("GLIBC_TUNABLES"))  # also stops the new process re-executing
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


__all__ = ["MIN_GLIBC", "OPT_OUT_ENV", "OPT_OUT_VALUES", "THP_ENABLED_PATH", "TUNABLE", "glibc_version",
           "reexec_with_malloc_hugepages", "should_reexec", "thp_mode", "with_hugetlb"]
