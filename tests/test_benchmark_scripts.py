"""Smoke tests of the benchmark scripts: each runs with `--smoke` (a micro config, a couple of steps) and prints both
throughputs and their ratio. Speed numbers are not checked (the machine is shared); the table's shape is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("benchmark_train.py", "benchmark_sampler.py", "benchmark_refill.py")
_NUMBER = r"[0-9][0-9,]*(?:\.[0-9]+)?"


def _table(output: str) -> tuple[list[str], list[list[str]]]:
  """The last markdown table with an 'ours tok/s' column: (header cells, data rows)."""
  lines = [line.strip() for line in output.splitlines()]
  for i in range(len(lines) - 1, -1, -1):
    if lines[i].startswith("|") and "ours tok/s" in lines[i]:
      header = [c.strip() for c in lines[i].strip("|").split("|")]
      rows = []
      for line in lines[i + 2:]:
        if not line.startswith("|"):
          break
        rows.append([c.strip() for c in line.strip("|").split("|")])
      return header, rows
  raise AssertionError(f"no table with an 'ours tok/s' column in the output:\n{output[-3000:]}")


@pytest.mark.parametrize("script, args", [pytest.param("benchmark_train.py", (), marks=pytest.mark.slow),
                                          *((s, ()) for s in SCRIPTS[1:]),
                                          ("benchmark_sampler.py", ("--refill",))])  # benchmark_refill's comparison
def test_benchmark_smoke(script, args):
  path = os.path.join(ROOT, "scripts", script)
  env = dict(os.environ)
  # Compile time dominates a micro model: the same fast-compile XLA options as the rest of the suite (conftest).
  env.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
  env.setdefault("TOKENIZERS_PARALLELISM", "false")
  proc = subprocess.run([sys.executable, path, *args, "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output[-3000:]
  header, rows = _table(proc.stdout)
  assert rows, proc.stdout[-3000:]
  lower = [h.lower() for h in header]
  ours = lower.index("ours tok/s")
  theirs = next(i for i, h in enumerate(lower) if h.endswith("tok/s") and i != ours)
  ratio = next(i for i, h in enumerate(lower) if h.startswith("ratio") or h in ("speed-up", "torch/ours"))
  for row in rows:
    assert len(row) == len(header), (header, row)
    for i in (ours, theirs):
      assert re.fullmatch(_NUMBER, row[i]) and float(row[i].replace(",", "")) > 0, (header[i], row)
    assert re.fullmatch(_NUMBER + "x", row[ratio]) and float(row[ratio][:-1].replace(",", "")) > 0, row
  if script == "benchmark_refill.py" or "--refill" in args:  # the two loops gave every example the same completion
    assert all(row[-1] == "yes" for row in rows), rows
  if script == "benchmark_train.py":
    # the two train steps were checked to compute the same loss and gradient norm before timing
    assert re.search(r"parity, step 0: loss ours \S+ torch \S+", proc.stdout), proc.stdout[-3000:]


@pytest.mark.slow  # profiles a compiled train step
def test_profile_train_step_lists_thunks_of_the_compiled_step():
  """The profiler script joins the trace's thunks with the compiled HLO: rows name real instructions with shapes."""
  env = dict(os.environ)
  env.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "profile_train_step.py"), "--size=micro",
                         "--top=5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  rows = [line for line in proc.stdout.splitlines() if re.match(r"\| [\w.\-]+ \| [\d,.]+ \| \d+ \| (\(|[a-z]+\d*\[)", line)]
  assert len(rows) == 5, proc.stdout[-3000:]
  assert re.search(r"\| matmul \| \d", proc.stdout), proc.stdout[-3000:]


def _report_rows(*args: str) -> dict[str, list[float]]:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own (8 devices, scheduler)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "memory_report.py"), "--smoke", *args],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  rows = {}
  for line in proc.stdout.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("| c: "):
      rows[cells[0]] = [float(c.strip("*")) for c in cells[1:5]]
  return rows


@pytest.mark.slow  # compiles the 30-layer smoke model whole and at 6 + 12 layers; run with -m slow
def test_memory_report_extrapolation_matches_a_whole_compile():
  """scripts/memory_report.py on its tiny 30-layer model: the sampler case compiled at 6 + 12 layers and extrapolated
  to 30 gives the arguments (exactly linear in the layers) of the whole 30-layer compile; temporaries are positive."""
  extrapolated, full = _report_rows("--cases=c", "--unrolled"), _report_rows("--cases=c", "--unrolled", "--full")
  assert set(extrapolated) == set(full) == {"c: sampler step, batch 8", "c: sampler step, batch 64"}
  for name, (args, temps, _, total) in full.items():
    assert args > 0 and temps > 0 and total >= args + temps - 0.2, (name, full[name])
    assert extrapolated[name][0] == args, (name, extrapolated[name], full[name])


@pytest.mark.slow  # two compiles of the 30-layer smoke model's LoRA step
def test_memory_report_image_case_adds_the_tower_and_the_image_tokens():
  """Case i is case a's recipe with one image per example: its arguments hold the vision tower on top of case a's,
  and its temporaries the image activations."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "memory_report.py"), "--smoke", "--cases=a,i"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  rows = {}
  for line in proc.stdout.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("| a: ") or line.startswith("| i: "):
      rows[cells[0]] = [float(c.strip("*")) for c in cells[1:5]]
  (a_args, a_temps, _, _), = [v for k, v in rows.items() if k.startswith("a:") and "micro-batches" in k]
  (i_args, i_temps, _, _), = [v for k, v in rows.items() if k.startswith("i:")]
  assert i_args > a_args and i_temps > a_temps, rows


def _case_table(lines: list[str], header: str) -> dict[str, list[float]]:
  """The rows after `header` (a markdown table) as {case name: [arguments, temporaries, added, total]}."""
  start = lines.index(header) + 2  # the header and its |---| line
  rows = {}
  for line in lines[start:]:
    if not line.startswith("| "):
      break
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    rows[cells[0]] = [float(c.strip("*")) for c in cells[1:5]]
  return rows


def test_memory_report_prints_the_table_the_docs_show():
  """docs/results.md shows the 26B figures as `scripts/memory_report.py` prints them: the same header (in GiB) and
  row names (the smoke run's rows are a subset), and each row's total is the sum of its parts."""
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "memory_report.py"), "--smoke", "--cases=c"],
                        cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  printed = proc.stdout.splitlines()
  (header,) = [line for line in printed if line.startswith("| case | arguments")]
  smoke = _case_table(printed, header)
  with open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8") as f:
    docs = _case_table(f.read().splitlines(), header.replace("MiB", "GiB"))
  assert set(smoke) == {"c: sampler step, batch 8", "c: sampler step, batch 64"} and set(smoke) <= set(docs), (
      sorted(smoke), sorted(docs))
  for name, (args, temps, added, total) in docs.items():
    assert re.match(r"(a|b|b2|b16|c|d|q8|q4|q8p|q4p|qn|i): ", name), name
    assert abs(args + temps + added - total) <= 0.15, (name, docs[name])


def test_memory_report_refuses_an_unknown_case():
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "memory_report.py"), "--cases=a,z"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and "unknown case(s) ['z']" in lines[-1], proc.stderr[-2000:]


# ---- scripts/gpu_check.py ------------------------------------------------------------------------------------------
def _gpu_check():
  import importlib.util

  spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_gpu_check_refuses_on_cpu():
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py")], cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "'cpu'" in lines[0]
  assert not proc.stdout.strip()  # nothing measured


def test_gpu_check_roofline_bytes():
  """The roofline's weight bytes: every non-expert weight plus the expected share of experts the tokens route to,
  checked against a simulation of uniform top-k routing and the model's own parameter count."""
  import jax
  import numpy as np
  from flax import nnx

  import hackable_diffusion as hd

  gc = _gpu_check()
  rng = np.random.default_rng(0)
  for experts, k, tokens in ((128, 8, 1), (128, 8, 16), (128, 8, 2048), (4, 2, 3)):
    distinct = np.mean([len(set(np.concatenate([rng.choice(experts, k, replace=False) for _ in range(tokens)])))
                        for _ in range(300)])
    assert abs(gc.expected_distinct(experts, k, tokens) - distinct) <= 0.03 * experts, (experts, k, tokens)
  config = hd.get_preset("tiny")
  state = nnx.state(nnx.eval_shape(lambda: hd.DiffusionGemma(config, rngs=nnx.Rngs(0))))
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  expert = sum(2 * config.num_experts * config.moe_intermediate_size * config.hidden_size * 4 +
               config.num_experts * config.hidden_size * config.moe_intermediate_size * 4
               for _ in range(config.num_hidden_layers))
  assert gc.weight_bytes(state) == (expert, total - expert)
  one = gc.forward_bytes(config, state, 1)
  assert one == total - expert + expert * config.top_k_experts / config.num_experts
  assert abs(gc.forward_bytes(config, state, 10_000) - total) < 1  # every expert is read


@pytest.mark.slow  # every check end to end on a tiny model on the CPU: minutes (the LoRA step's compile)
def test_gpu_check_runs_on_a_tiny_model_with_allow_cpu(tmp_path):
  out = tmp_path / "gpu_check.json"
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--allow_cpu",
                         "--preset=tiny", "--repeats=1", "--budget_s=900", f"--out={out}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  import json

  rows = json.loads(out.read_text())["rows"]
  assert [r["check"].split(",")[0] for r in rows] == ["device ceilings", "MoE layer forward", "decoder forward",
                                                       "decoder forward", "hd.generate", "LoRA train step"]
  assert all(isinstance(v, float) and v > 0 for v in rows[1]["seconds"].values()), rows[1]
  assert all(r.get("forwards_per_s", r.get("tokens_per_s", r.get("seconds_per_step", 1))) > 0 for r in rows)
  assert rows[2]["compiled_gib"]["argument"] > 0 and rows[2]["flops"] > 0


def _gpu_check_rows(tmp_path, budget_s: str) -> dict:
  import json

  out = tmp_path / f"gpu_check_{budget_s}.json"
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--allow_cpu",
                         "--preset=tiny", "--repeats=1", f"--budget_s={budget_s}", f"--out={out}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


_CHECK_NAMES = ["device ceilings", "MoE layer forward", "building the model", "decoder forward", "hd.generate",
                "LoRA train step"]


def test_gpu_check_past_its_budget_records_every_check_as_skipped(tmp_path):
  """A budget spent before the first check: the session still exits 0 (the alarm never kills it between checks) and
  the JSON names every check as skipped (nothing here depends on how fast the machine is)."""
  data = _gpu_check_rows(tmp_path, "0.001")
  rows = data["rows"]
  assert [r["check"] for r in rows] == _CHECK_NAMES
  assert all(r["skipped"].startswith("budget") for r in rows), rows


def test_gpu_check_keeps_every_row_measured_before_the_budget(tmp_path):
  """Measured rows form a prefix and skipped rows a suffix, whatever the machine's speed; the ceilings (a few
  seconds on any CPU) always fit in 8 s and are kept."""
  data = _gpu_check_rows(tmp_path, "8")
  assert data["budget_s"] == 8 and data["device"] and data["bandwidth_bytes_per_s"] > 0
  rows = data["rows"]
  assert rows[0]["check"] == "device ceilings" and rows[0]["bf16_matmul_flops_per_s"] > 0
  skipped = ["skipped" in r for r in rows]
  assert skipped == sorted(skipped), rows  # no measured row after a skipped one
  names = [r["check"].split(",")[0] for r in rows if "skipped" in r]
  assert names == [n for n in _CHECK_NAMES if n in names], names


_LIVE_PEAK_PROGRAM = """
import jax, jax.numpy as jnp
def f(w, x):  # a scanned MLP's gradient: loop-carried and stacked buffers, as in a train step
  def body(h, wi):
    return jnp.tanh(h @ wi), None
  return jax.grad(lambda w: jnp.sum(jax.lax.scan(body, x, w)[0] ** 2))(w)
c = jax.jit(f).lower(jnp.ones((4, 64, 64)), jnp.ones((32, 64))).compile()
print("TEMP", c.memory_analysis().temp_size_in_bytes)
"""


def test_live_peak_reads_the_dumped_allocation(tmp_path):
  """scripts/live_peak.py on the XLA dump of a small scanned gradient: the allocation it reads is the size XLA's
  memory analysis reports, and the live peak it computes is positive and no larger."""
  dump = tmp_path / "dump"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={dump}")
  proc = subprocess.run([sys.executable, "-c", _LIVE_PEAK_PROGRAM], env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  temp = int(re.search(r"TEMP (\d+)", proc.stdout).group(1))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "live_peak.py"), str(dump), "jit_f"],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  m = re.search(r"allocated (\d+) bytes .*live at once at most (\d+) bytes", out.stdout)
  assert m, out.stdout
  allocated, live = int(m.group(1)), int(m.group(2))
  assert allocated == temp
  assert 0 < live <= allocated


def test_live_peak_counts_one_buffer_once_and_sums_overlapping_ones():
  """`live_peak.live_peak` on hand-made values: aliases (one offset and size, overlapping ranges) count once over the
  union of their ranges; the same offset reused later is a new buffer; buffers live together add up."""
  import live_peak  # noqa: PLC0415 - scripts/ is on sys.path (conftest)

  values = [("a{}", 100, 0), ("a_alias{}", 100, 0), ("a_later{}", 100, 0), ("b{}", 40, 100), ("c{}", 7, 140)]
  ranges = {"a{}": (0, 5), "a_alias{}": (4, 9), "a_later{}": (20, 30), "b{}": (8, 12), "c{}": (25, 26)}
  assert live_peak.live_peak(values, ranges) == (140, 8, 0)  # a (through its alias, to 9) + b, from position 8
  ranges["b{}"] = (10, 12)  # no longer overlapping a: the peak is a_later + c
  assert live_peak.live_peak(values, ranges) == (107, 25, 0)
  assert live_peak.live_peak(values + [("d{}", 5, 200)], ranges)[2] == 5  # a value without a live range


def _refill_module():
  """scripts/benchmark_refill.py imported as a module (scripts/ is not a package)."""
  import importlib.util

  path = os.path.join(ROOT, "scripts", "benchmark_refill.py")
  spec = importlib.util.spec_from_file_location("benchmark_refill", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_refill_sampler_overrides_replace_only_what_is_given():
  import hackable_diffusion as hd

  module = _refill_module()
  base = hd.SamplingConfig(max_denoising_steps=24, t_min=0.4, t_max=0.8, confidence_threshold=0.05)
  assert module.override_sampler(base) == base  # every override 0: the run's own sampler
  warm = module.override_sampler(base, t_max=2.0, t_min=0.8, confidence_threshold=0.1)
  assert (warm.t_min, warm.t_max, warm.confidence_threshold, warm.max_denoising_steps) == (0.8, 2.0, 0.1, 24)
  capped = module.override_sampler(base, cap=32)
  assert (capped.max_denoising_steps, capped.t_min, capped.t_max, capped.confidence_threshold) == (32, 0.4, 0.8, 0.05)
  from hackable_diffusion.errors import ConfigError

  with pytest.raises(ConfigError, match=r"t_min=-1.0 is invalid"):  # validated, not silently used (main: one line)
    module.override_sampler(base, t_min=-1.0)


def test_refill_ideal_ratio_is_the_fixed_batches_steps_over_the_rows_mean():
  module = _refill_module()
  # batches of 2: (2, 10) -> 10, (4, 4) -> 4, (6, padded with row 0: 2) -> 6; mean 20 / 3 over the rows' mean 26 / 5
  assert module.ideal_ratio([2, 10, 4, 4, 6], 2) == pytest.approx((20 / 3) / (26 / 5))
  assert module.ideal_ratio([3, 3, 3], 2) == pytest.approx(1.0)  # equal rows: nothing to gain


@pytest.mark.parametrize("args, message", [
    (["--workdir=/no/such/run"], "error: /no/such/run: no such workdir"),
])
def test_refill_bad_input_is_one_line(args, message):
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark_refill.py"), *args], cwd=ROOT,
                        env={**os.environ, "HD_MALLOC_HUGEPAGES": "0"}, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [message], proc.stderr[-2000:]
