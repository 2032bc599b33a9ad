"""The suite's scheduling aid (tests/conftest.py): every file named in `SLOWEST_FIRST` exists (a renamed file would
silently fall back into the tail), and the collection hook moves those files first, keeping every file's own order."""

from __future__ import annotations

import os
import types

import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_listed_slow_file_exists():
  assert len(set(conftest.SLOWEST_FIRST)) == len(conftest.SLOWEST_FIRST)
  missing = [p for p in conftest.SLOWEST_FIRST if not os.path.isfile(os.path.join(ROOT, p))]
  assert not missing, missing


def test_the_hook_puts_the_listed_files_first_in_their_order():
  first, second = conftest.SLOWEST_FIRST[:2]
  ids = ["tests/a/test_x.py::t1", f"{second}::t1", "tests/a/test_x.py::t2", f"{first}::t2", "tests/b.py::t",
         f"{second}::t2", f"{first}::t1"]
  items = [types.SimpleNamespace(nodeid=i) for i in ids]
  conftest.pytest_collection_modifyitems(None, items)
  assert [i.nodeid for i in items] == [f"{first}::t2", f"{first}::t1", f"{second}::t1", f"{second}::t2",
                                       "tests/a/test_x.py::t1", "tests/a/test_x.py::t2", "tests/b.py::t"]
