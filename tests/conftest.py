"""Shared test fixtures: tiny random transformers DiffusionGemma checkpoints (the numerical reference)."""

from __future__ import annotations

import os
import sys

# Components defined in tests (tests/custom_components.py) are named by 'module:attribute' specs: importable in any
# pytest import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# scripts/hf_reference.py: the transformers reference model, shared with the parity scripts
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

# Tests run tiny models, where XLA's CPU compile time dominates: the lowest backend optimisation level compiles
# several times faster and changes runtime little at these sizes. Benchmarks and training runs keep the default.
# One OpenMP thread for the torch reference models: the suite runs one pytest-xdist worker per core, and their tiny
# tensors gain nothing from a second thread that only contends with the other worker. (XLA keeps its own thread
# pool: single-threaded Eigen compiles some bfloat16 dots differently from what users run.)
if "jax" not in sys.modules:
  os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
from typing import Any

import hf_reference  # noqa: E402 - scripts/ is on sys.path (above)
import numpy as np
import pytest

def make_hf_model(seed: int = 0, *, vocab: int = 128, canvas: int = 6, perturb: bool = True, **text: Any):
  """A tiny random `DiffusionGemmaForBlockDiffusion` (eval mode, fp32) with non-trivial norms and scalars and,
  when perturbed, the embedding x10 (logits of order 1-10, so that a wrong detail shows clearly)."""
  tc = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=4,
            num_experts=4, top_k_experts=2, moe_intermediate_size=16, initializer_range=0.1,
            layer_types=["sliding_attention", "full_attention", "full_attention"])
  tc.update(text)
  return hf_reference.make_hf_model(tc, canvas, seed, perturb=perturb, embed_scale=10.0 if perturb else 1.0)


@pytest.fixture(scope="session")
def hf_factory(tmp_path_factory):
  """Builds (and caches) tiny HF checkpoints on disk: returns (torch_model, directory)."""
  cache: dict[str, Any] = {}

  def build(name: str, **kwargs: Any):
    if name not in cache:
      model = make_hf_model(**kwargs)
      path = str(tmp_path_factory.mktemp(name))
      model.save_pretrained(path)
      cache[name] = (model, path)
    return cache[name]

  return build


@pytest.fixture(scope="module")
def shared_xla_cache(tmp_path_factory):
  """A persistent XLA compilation cache shared by the session's tests and the CLI subprocesses of tests/test_cli.py
  (same programs, compiled once per session)."""
  import jax

  path = tmp_path_factory.getbasetemp() / "xla_cache"
  path.mkdir(exist_ok=True)
  if jax.config.jax_compilation_cache_dir is None:
    jax.config.update("jax_compilation_cache_dir", str(path))
  yield path


# The slowest test files, slowest first (by the seconds of one file on one pytest-xdist worker of the README command,
# as `--durations=0` reports them; docs/results.md has the suite's current time). `--dist loadfile` hands out whole
# files in collection order (`--no-loadscope-reorder` in pyproject.toml: xdist's own reordering, most tests first,
# would hand out these one-test files last, where a single one would run alone at the end of the suite). Files not
# listed follow in their usual order.
SLOWEST_FIRST = (
    "tests/model/test_scan.py",
    "tests/test_cli.py",
    "tests/training/test_sft_api.py",
    "tests/sharding/test_multi_device.py",  # two 8-device workers
    "tests/interop/test_qlora_interop.py",
    "tests/diffusion/test_loss.py",
    "tests/test_benchmark_scripts.py",
    "tests/interop/test_export.py",
    "tests/training/test_signals.py",
    "tests/test_packaging.py",
    "tests/training/test_step.py",
    "tests/interop/test_hf_parity.py",
    "tests/test_notebook.py",
    "tests/runs/test_cli_outputs.py",
)


def pytest_collection_modifyitems(config, items):
  """The files of `SLOWEST_FIRST` first, in that order; the rest keep their order (a stable sort)."""
  del config
  rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def max_abs_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
