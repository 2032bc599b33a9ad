"""Peak of the simultaneously live temporaries of a compiled XLA program, against the size XLA allocated for them.

`memory_analysis().temp_size_in_bytes` is the size of the buffer XLA packs every temporary into; when buffers of
different lifetimes pack badly it exceeds what is ever live at once. This reads an XLA dump of the program
(`XLA_FLAGS=--xla_dump_to=DIR`): the temporary allocation's values with their offsets and sizes
(`*-buffer-assignment.txt`) and the live range of each (`*-live-range.txt`, the flattened schedule), and prints
the largest sum of sizes live at one point of the schedule next to the allocation's size (values at one offset with
overlapping live ranges counted once, as one buffer).

    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false \\
      --xla_dump_to=/tmp/dump" python scripts/memory_report.py --cases=b --scan --full
    python scripts/live_peak.py /tmp/dump jit_sharded_step
"""

from __future__ import annotations

import glob
import os
import re
import sys

VALUE = re.compile(r" value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")
RANGE = re.compile(r"\s+(\S+?)(\{[^}]*\})?:(\d+)-(\d+)$")


def temp_values(lines: list[str]) -> list[tuple[str, int, int]]:
  """(value name with shape index, size, offset) of every value in the preallocated temporary allocation."""
  start = next(i for i, line in enumerate(lines) if line.startswith("allocation") and "preallocated-temp" in line)
  out = []
  for line in lines[start + 1:]:
    if not line.startswith(" value:"):
      break
    m = VALUE.match(line)
    if m:
      name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
      out.append((name, int(m.group(2)), int(m.group(3))))
  return out


def live_ranges(lines: list[str]) -> dict[str, tuple[int, int]]:
  """{value name with shape index: (first, last) position in the flattened schedule}."""
  first = next(i for i, line in enumerate(lines) if "BufferLiveRange" in line)
  out = {}
  for line in lines[first + 1:]:
    if "Live ranges at" in line:
      break
    m = RANGE.match(line)
    if m:
      out[m.group(1) + (m.group(2) or "{}")] = (int(m.group(3)), int(m.group(4)))
  return out


def live_peak(values: list[tuple[str, int, int]], ranges: dict[str, tuple[int, int]]) -> tuple[int, int, int]:
  """(largest live sum, its position, bytes of values without a live range). Values at the same offset and size
  whose live ranges overlap are one buffer (a loop's carry and its body's parameter, aliases): counted once, over
  the union of their ranges."""
  spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
  missing = 0
  for name, size, offset in values:
    if name not in ranges:
      missing += size
      continue
    spans.setdefault((offset, size), []).append(ranges[name])
  events: dict[int, int] = {}
  for (_, size), intervals in spans.items():
    merged: list[list[int]] = []
    for a, b in sorted(intervals):
      if merged and a <= merged[-1][1]:
        merged[-1][1] = max(merged[-1][1], b)
      else:
        merged.append([a, b])
    for a, b in merged:
      events[a] = events.get(a, 0) + size
      events[b + 1] = events.get(b + 1, 0) - size
  live = peak = where = 0
  for t in sorted(events):
    live += events[t]
    if live > peak:
      peak, where = live, t
  return peak, where, missing


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    sys.exit("usage: python scripts/live_peak.py DUMP_DIR MODULE_NAME_PART (e.g. jit_sharded_step)")
  dump, part = argv
  found = sorted(glob.glob(f"{dump}/*{part}*after_optimizations-buffer-assignment.txt"))
  if not found:
    sys.exit(f"live_peak: no '*{part}*after_optimizations-buffer-assignment.txt' in {dump}")
  for assignment in found:
    with open(assignment, encoding="utf-8") as f:
      values = temp_values(f.read().splitlines())
    live_range_file = assignment.replace("-buffer-assignment.txt", "-live-range.txt")
    if not os.path.exists(live_range_file):
      sys.exit(f"live_peak: {live_range_file} is missing (dump with a jax/XLA that writes live ranges)")
    with open(live_range_file, encoding="utf-8") as f:
      ranges = live_ranges(f.read().splitlines())
    allocated = max(offset + size for _, size, offset in values)
    peak, where, missing = live_peak(values, ranges)
    print(f"{assignment.split('/')[-1]}: temporaries allocated {allocated} bytes ({allocated / 2**30:.2f} GiB), "
          f"live at once at most {peak} bytes ({peak / 2**30:.2f} GiB) at schedule position {where}; "
          f"{missing} bytes without a live range")


if __name__ == "__main__":
  main(sys.argv[1:])
