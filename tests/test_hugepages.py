"""The CLIs' re-execution with glibc's huge-page tunable (hackable_diffusion.hugepages)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from hackable_diffusion import hugepages

LINUX = dict(system="Linux", libc=("glibc", "2.36"), thp="madvise")


def test_reexecs_only_where_the_tunable_changes_something():
  assert hugepages.should_reexec({}, **LINUX)
  assert hugepages.should_reexec({hugepages.OPT_OUT_ENV: "1"}, **LINUX)
  assert hugepages.should_reexec({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **LINUX)
  assert hugepages.should_reexec({}, **{**LINUX, "libc": ("glibc", "2.35")})
  refused = [
      ({hugepages.OPT_OUT_ENV: "0"}, {}),  # the user's opt-out
      ({hugepages.OPT_OUT_ENV: " Off"}, {}),
      ({hugepages.OPT_OUT_ENV: "false"}, {}),
      ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {}),  # the user's own choice, whatever it is
      ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}, {}),  # already set: no loop
      ({}, {"libc": ("glibc", "2.34")}),  # no such tunable before 2.35
      ({}, {"libc": ("", "")}),  # musl and others
      ({}, {"system": "Darwin"}),
      ({}, {"thp": "always"}),  # every anonymous mapping gets huge pages already
      ({}, {"thp": "never"}),
      ({}, {"thp": None}),
  ]
  for env, facts in refused:
    assert not hugepages.should_reexec(env, **{**LINUX, **facts}), (env, facts)


def test_an_unknown_opt_out_value_is_a_one_line_error(tmp_path):
  for value in ("2", "maybe", "of"):
    with pytest.raises(ValueError, match=f"HD_MALLOC_HUGEPAGES='{value}': expected 0 / false"):
      hugepages.should_reexec({hugepages.OPT_OUT_ENV: value}, **LINUX)
  for value in ("", " YES", "on", "1"):  # the default, spelled out
    assert hugepages.should_reexec({hugepages.OPT_OUT_ENV: value}, **LINUX)
  script = tmp_path / "child.py"
  script.write_text(_CHILD)
  env = {**os.environ, hugepages.OPT_OUT_ENV: "maybe"}
  out = subprocess.run([sys.executable, "-u", str(script), "pretend"], env=env, capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 1 and out.stdout == "start\n"  # it stops before running anything
  assert out.stderr.strip().splitlines() == [
      "error: HD_MALLOC_HUGEPAGES='maybe': expected 0 / false / no / off (no huge pages for malloc) or 1 / true / yes "
      "/ on (the default)"]


def test_tunable_is_appended_to_the_users_tunables():
  assert hugepages.with_hugetlb(None) == "glibc.malloc.hugetlb=1"
  assert hugepages.with_hugetlb("") == "glibc.malloc.hugetlb=1"
  assert hugepages.with_hugetlb("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_thp_mode_reads_the_bracketed_word(tmp_path):
  path = tmp_path / "enabled"
  path.write_text("always [madvise] never\n")
  assert hugepages.thp_mode(str(path)) == "madvise"
  path.write_text("[always] madvise never\n")
  assert hugepages.thp_mode(str(path)) == "always"
  assert hugepages.thp_mode(str(tmp_path / "missing")) is None
  assert hugepages.glibc_version(("glibc", "2.36")) == (2, 36)
  assert hugepages.glibc_version(("glibc", "2.x")) is None
  assert hugepages.glibc_version(("musl", "1.2")) is None


# A script that starts, re-executes itself with the tunable when the machine's facts are pretended to allow it (the
# exec itself is real), and reports what it ends up with.
_CHILD = textwrap.dedent("""
    import os, sys
    from hackable_diffusion import hugepages
    print("start", flush=True)
    if sys.argv[1] == "pretend":
        hugepages.thp_mode = lambda path=None: "madvise"
        hugepages.platform.libc_ver = lambda: ("glibc", "2.36")
        hugepages.platform.system = lambda: "Linux"
    hugepages.reexec_with_malloc_hugepages()
    print("args", sys.argv[1:])
    print("tunables", os.environ.get("GLIBC_TUNABLES"))
""")


def _run_child(tmp_path, args, **env):
  script = tmp_path / "child.py"
  script.write_text(_CHILD)
  full_env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hugepages.OPT_OUT_ENV)}
  full_env.update(env)
  out = subprocess.run([sys.executable, "-u", str(script), *args], env=full_env, capture_output=True, text=True,
                       timeout=60, check=True)
  return out.stdout.splitlines()


def test_reexec_keeps_arguments_and_existing_tunables(tmp_path):
  lines = _run_child(tmp_path, ["pretend", "--flag=a b"], GLIBC_TUNABLES="glibc.malloc.arena_max=2")
  assert lines == ["start", "start", "args ['pretend', '--flag=a b']",
                   "tunables glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"]


def test_opt_out_and_an_existing_setting_do_not_reexec(tmp_path):
  lines = _run_child(tmp_path, ["pretend"], **{hugepages.OPT_OUT_ENV: "0"})
  assert lines == ["start", "args ['pretend']", "tunables None"]
  lines = _run_child(tmp_path, ["pretend"], GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
  assert lines == ["start", "args ['pretend']", "tunables glibc.malloc.hugetlb=0"]


# Touching a 64 MiB malloc block page by page: with 4 KiB pages that is ~16,384 minor faults, with 2 MiB pages ~32.
_FAULTS = textwrap.dedent("""
    import ctypes, resource
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    n = 64 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def test_the_tunable_cuts_malloc_page_faults_exactly_where_the_clis_reexecute(tmp_path):
  script = tmp_path / "faults.py"
  script.write_text(_FAULTS)
  base_env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hugepages.OPT_OUT_ENV)}

  def faults(**env) -> int:
    out = subprocess.run([sys.executable, str(script)], env={**base_env, **env}, capture_output=True, text=True,
                         timeout=60, check=True)
    return int(out.stdout.strip())

  plain, tuned = faults(), faults(GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
  applies = hugepages.should_reexec(base_env, system=platform.system(), libc=platform.libc_ver(),
                                    thp=hugepages.thp_mode())
  if applies:  # a machine the CLIs re-execute on: 4 KiB faults without the tunable, far fewer with it
    assert plain >= (64 << 20) // 4096 // 2 and tuned < plain // 4, (plain, tuned)
  else:  # THP always / never or an old glibc: the tunable would not change much, so the CLIs leave it alone
    assert tuned > plain // 4, (plain, tuned)


# Every interpreter start appends its GLIBC_TUNABLES to a log (sitecustomize); the machine's facts are pretended so
# that the re-exec is due, whatever this machine's kernel says.
_SITECUSTOMIZE = textwrap.dedent("""
    import os, platform
    with open(os.environ["HD_TEST_START_LOG"], "a") as f:
        f.write(str(os.environ.get("GLIBC_TUNABLES")) + "\\n")
    platform.system = lambda: "Linux"
    platform.libc_ver = lambda *a, **k: ("glibc", "2.36")
    from hackable_diffusion import hugepages
    hugepages.thp_mode = lambda path=None: "madvise"
""")


def test_every_cli_reexecutes_before_it_runs(tmp_path):
  (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
  base_env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hugepages.OPT_OUT_ENV)}
  for cli in ("train", "evaluate", "sample"):
    log = tmp_path / f"{cli}.log"
    env = {**base_env, "HD_TEST_START_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), base_env.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", f"hackable_diffusion.{cli}", "--helpshort"], env=env, capture_output=True,
                   timeout=120, check=True)
    assert log.read_text().splitlines() == ["None", "glibc.malloc.hugetlb=1"], cli  # started twice, tunable second
