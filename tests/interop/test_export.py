"""Export for serving: merged HF checkpoints (transformers loads them with equal logits), PEFT dirs, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
from conftest import make_hf_model, max_abs_diff
from flax import nnx
from safetensors import safe_open

import hackable_diffusion as hd
from hackable_diffusion import lora
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.interop import export as export_lib
from hackable_diffusion.interop import peft as peft_io
from hackable_diffusion.model.transformer import forward

SLIDE, FULL = "sliding_attention", "full_attention"
HF_KW = dict(canvas=6, layer_types=[SLIDE, FULL, FULL])
EVERYTHING = lora.DEFAULT_TARGETS + ("experts", "self_conditioning")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(seed: int = 0, p: int = 9, c: int = 6):
  rng = np.random.default_rng(seed)
  return rng.integers(3, 125, (2, p)), rng.integers(3, 125, (2, c)), (3 * rng.standard_normal((2, c, 128))).astype(
      np.float32)


def torch_logits(model, ids, canvas, sc) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas),
                 self_conditioning_logits=torch.tensor(sc)).logits.float().numpy()


def our_logits(model, ids, canvas, sc) -> np.ndarray:
  return np.asarray(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32),
                            self_conditioning_logits=jnp.asarray(sc)))


@pytest.fixture(scope="module")
def adapted(hf_factory):
  _, path = hf_factory("lora_base", **HF_KW)
  model = lora.apply_lora(hd.load_pretrained(path), lora.LoraConfig(rank=2, alpha=6, target_modules=EVERYTHING),
                          rngs=nnx.Rngs(1))
  rng = np.random.default_rng(0)
  for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    v.value = jnp.asarray(0.1 * rng.standard_normal(v.shape), v.dtype)
  return path, model


def test_merged_export_loads_in_transformers_with_equal_logits(adapted, tmp_path):
  from transformers import DiffusionGemmaForBlockDiffusion

  base, model = adapted
  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "tokenizer.model").write_bytes(b"not a real sentencepiece model")
  out = str(tmp_path / "merged")
  written = export_lib.export_merged(model, out, dtype="float32", vision_source=base,
                                     generation_defaults=dict(max_denoising_steps=32, entropy_bound=0.25, t_min=0.3,
                                                              max_new_tokens=12),
                                     tokenizer_path=str(tmp_path / "tok"))
  assert os.path.isfile(os.path.join(out, "tokenizer.model")) and written["tokenizer"]
  ref, info = DiffusionGemmaForBlockDiffusion.from_pretrained(out, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
  ids, canvas, sc = _inputs()
  expected = our_logits(model, ids, canvas, sc)
  got = torch_logits(ref.eval(), ids, canvas, sc)
  print(f"merged export vs our adapter logits: max |diff| = {max_abs_diff(got, expected):.2e}")
  assert max_abs_diff(got, expected) <= 1e-4
  gen = ref.generation_config
  assert type(gen).__name__ == "DiffusionGemmaGenerationConfig"
  assert gen.max_denoising_steps == 32 and gen.sampler_config.entropy_bound == 0.25 and gen.t_min == 0.3
  assert gen.t_max == 0.8 and gen.max_new_tokens == 12 and gen.confidence_threshold == 0.005
  # the real vision tower of the base was carried over
  with safe_open(os.path.join(base, "model.safetensors"), "pt") as a, safe_open(os.path.join(out, "model.safetensors"),
                                                                                 "pt") as b:
    name = "model.encoder.embed_vision.embedding_projection.weight"
    np.testing.assert_array_equal(a.get_tensor(name).numpy(), b.get_tensor(name).numpy())


def test_merged_bf16_export(adapted, tmp_path):
  _, model = adapted
  export_lib.export_merged(model, str(tmp_path))  # default dtype: bfloat16
  with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
    assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
  assert json.load(open(tmp_path / "config.json"))["dtype"] == "bfloat16"
  again = hd.load_pretrained(str(tmp_path))
  merged = lora.merge(model)
  k = np.asarray(merged.layers[0].self_attn.q_proj.kernel[...])
  np.testing.assert_array_equal(np.asarray(again.layers[0].self_attn.q_proj.kernel[...]),
                                np.asarray(jnp.asarray(k, jnp.bfloat16).astype(jnp.float32)))


def test_export_peft_and_bad_inputs(adapted, tmp_path):
  base, model = adapted
  tok = tmp_path / "tokenizer.model"
  tok.write_bytes(b"x")
  written = export_lib.export_peft(model, str(tmp_path / "peft"), base, tokenizer_path=str(tok))
  assert sorted(os.listdir(tmp_path / "peft")) == ["adapter_config.json", "adapter_model.safetensors",
                                                   "tokenizer.model"]
  assert json.load(open(written["config"]))["base_model_name_or_path"] == base
  plain = lora.merge(model)
  with pytest.raises(peft_io.AdapterError, match="no LoRA adapters"):
    export_lib.export_peft(plain, str(tmp_path / "x"), base)
  with pytest.raises(ConfigError, match=r"unknown key\(s\) \['entropy'\]"):
    export_lib.generation_config(plain.config, {"entropy": 0.1})
  with pytest.raises(ValueError, match="t_min"):
    export_lib.generation_config(plain.config, {"t_min": 0.9, "t_max": 0.8})
  with pytest.raises(ConfigError, match="acceptance='top_k'.*no transformers equivalent"):
    export_lib.generation_config(plain.config, {"acceptance": "top_k", "acceptance_args": {"k": 2}})
  bound = export_lib.generation_config(plain.config, {"acceptance_args": {"bound": 0.25}})
  assert bound["sampler_config"]["entropy_bound"] == 0.25
  with pytest.raises(ConfigError, match="dtype='int8'"):
    export_lib.export_merged(plain, str(tmp_path / "y"), dtype="int8")
  assert not os.path.exists(tmp_path / "y")


# ---- the CLI -------------------------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "hackable_diffusion.export", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def test_cli_checkpoint_plus_adapter_to_merged(adapted, tmp_path):
  base, model = adapted
  peft_io.save_adapter(model, str(tmp_path / "adapter"), base)
  out = tmp_path / "merged"
  res = _cli(f"--checkpoint={base}", f"--adapter={tmp_path / 'adapter'}", f"--out={out}", "--format=merged",
             "--dtype=float32")
  assert res.returncode == 0, res.stderr[-2000:]
  assert "adapters merged" in res.stdout
  again = hd.load_pretrained(str(out))
  merged = lora.merge(model)
  for a, b in zip(jax_leaves(again), jax_leaves(merged)):
    np.testing.assert_array_equal(a, b)
  assert json.load(open(out / "generation_config.json"))["max_denoising_steps"] == 48
  # one-line errors
  res = _cli(f"--checkpoint={base}", f"--out={tmp_path / 'p'}", "--format=peft")
  last = res.stderr.strip().splitlines()[-1]  # (absl may log warnings before it)
  assert res.returncode == 1 and last.startswith("error: ") and "no LoRA adapters" in last, res.stderr


def jax_leaves(model) -> list[np.ndarray]:
  return [np.asarray(v[...]) for _, v in sorted(nnx.to_flat_state(nnx.state(model)), key=lambda pv: str(pv[0]))]


@pytest.fixture(scope="module")
def workdir(hf_factory, tmp_path_factory):
  """A 2-step LoRA run of hackable_diffusion.training on the tiny HF base (configs/tiny.py, digits task)."""
  trainer = pytest.importorskip("hackable_diffusion.training.trainer")
  _, base = hf_factory("lora_base", **HF_KW)
  cfg = _tiny_config()
  cfg.model.preset, cfg.model.checkpoint, cfg.model.overrides = "", base, ml_collections.ConfigDict()
  cfg.data.generator_args.num_train, cfg.data.generator_args.num_validation = 64, 8
  cfg.data.max_canvases = 2  # 7 digits + eos in canvases of 6
  cfg.train.steps, cfg.train.batch_size, cfg.train.log_every, cfg.train.checkpoint_every = 2, 4, 1, 2
  cfg.train.eval_at_end, cfg.train.async_checkpointing = False, False
  cfg.optimizer.peak_lr, cfg.optimizer.warmup_steps = 0.05, 0  # an adapter that visibly changes the logits
  cfg.lora = ml_collections.ConfigDict(dict(enabled=True, rank=2, alpha=4, target_modules=("all-linear", "experts")))
  wd = str(tmp_path_factory.mktemp("lora_run"))
  trainer.train(cfg, wd, progress=False)
  from hackable_diffusion.runs import run as run_lib

  return base, wd, run_lib.load_run(wd)


def _tiny_config() -> ml_collections.ConfigDict:
  import importlib.util

  spec = importlib.util.spec_from_file_location("tiny_config", os.path.join(REPO, "configs", "tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_workdir_export_peft_cli_and_merged(workdir, tmp_path):
  import peft

  base, wd, run = workdir
  assert lora.has_lora(run.model)
  res = _cli(f"--workdir={wd}", f"--out={tmp_path / 'peft'}", "--format=peft", "--step=2")
  assert res.returncode == 0, res.stderr[-2000:]
  assert os.path.isfile(tmp_path / "peft" / "tokenizer.model")
  ids, canvas, sc = _inputs(3)  # the run keeps the base canvas_length (6)
  ours = our_logits(run.model, ids, canvas, sc)
  assert max_abs_diff(ours, our_logits(hd.load_pretrained(base), ids, canvas, sc)) > 1e-2  # it trained something
  ref = peft.PeftModel.from_pretrained(make_hf_model(0, **HF_KW), str(tmp_path / "peft")).eval()
  assert max_abs_diff(torch_logits(ref, ids, canvas, sc), ours) <= 1e-4
  # merged, through the library call the CLI makes (the CLI's merged path is covered with --checkpoint above)
  written = export_lib.export_merged(run.model, str(tmp_path / "merged"), dtype="float32",
                                     generation_defaults=dict(max_denoising_steps=run.config.eval.early_stopping_steps))
  assert json.load(open(written["generation_config"]))["max_denoising_steps"] == run.config.eval.early_stopping_steps
  assert max_abs_diff(our_logits(hd.load_pretrained(str(tmp_path / "merged")), ids, canvas, sc), ours) <= 1e-4


def test_peft_export_of_a_workdir_reads_the_adapters_alone(workdir, tmp_path, monkeypatch):
  from hackable_diffusion.errors import UnsafePathError
  from hackable_diffusion.runs import run as run_lib

  base, wd, run = workdir

  def refuse(*args, **kwargs):
    raise AssertionError("the base model was loaded")

  monkeypatch.setattr(run_lib, "build_model", refuse)  # every way load_run reads the base
  monkeypatch.setattr(run_lib, "load_pretrained", refuse)
  alone = run_lib.load_run_adapters(wd, step=2)
  base_vars = nnx.to_flat_state(nnx.state(alone.model, nnx.Not(nnx.LoRAParam)))
  assert base_vars and all(isinstance(v.get_value(), jax.ShapeDtypeStruct) for _, v in base_vars)
  ours = export_lib.export_peft(alone.model, str(tmp_path / "alone"), base)
  full = export_lib.export_peft(run.model, str(tmp_path / "full"), base)
  for key in ("weights", "config"):
    assert open(ours[key], "rb").read() == open(full[key], "rb").read(), key
  victim = tmp_path / "victim"
  victim.write_text("keep")
  (tmp_path / "linked").mkdir()
  os.symlink(victim, tmp_path / "linked" / peft_io.ADAPTER_WEIGHTS_NAME)
  with pytest.raises(UnsafePathError, match="symbolic link"):
    peft_io.save_adapter(alone.model, str(tmp_path / "linked"), base)
  assert victim.read_text() == "keep"


# ---- nothing is overwritten without asking ------------------------------------------------------------------------
def _snapshot(root) -> dict[str, tuple]:
  """Every path under `root` -> (bytes, mtime_ns) of a file, or None for a directory: equal means untouched."""
  out: dict[str, tuple | None] = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames:
      out[os.path.relpath(os.path.join(dirpath, name), root)] = None
    for name in filenames:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = (f.read(), os.stat(path).st_mtime_ns)
  return out


def _existing_dir(path) -> str:
  path.mkdir()
  (path / "config.json").write_text('{"mine": true}')
  (path / "model.safetensors").write_bytes(b"an earlier export")
  (path / "notes.txt").write_text("keep me")
  return str(path)


def test_export_refuses_a_non_empty_dir_unless_overwrite(adapted, tmp_path):
  import shutil

  base, model = adapted
  existing = _existing_dir(tmp_path / "existing")
  before = _snapshot(existing)
  for export in (lambda **kw: export_lib.export_merged(model, existing, dtype="float32", **kw),
                 lambda **kw: export_lib.export_peft(model, existing, base, **kw)):
    with pytest.raises(ConfigError, match=r"existing: not empty \(3 entries: config\.json, model\.safetensors, "
                       r"notes\.txt\); pass a new or empty directory, or --overwrite") as err:
      export()
    assert "\n" not in str(err.value)
    assert _snapshot(existing) == before  # nothing written
  # a run's workdir is refused even with overwrite, and so is the checkpoint whose vision tower is copied
  run = tmp_path / "run"
  (run / "checkpoints" / "2").mkdir(parents=True)
  (run / "config.json").write_text('{"train": {"steps": 2}}')
  (run / "metrics.jsonl").write_text('{"step": 1}\n')
  source = str(tmp_path / "base_copy")
  shutil.copytree(base, source)
  for out, kw, match in ((str(run), {}, "is a training run's workdir"),
                         (source, dict(vision_source=source), "which the export reads"),
                         (str(run / "config.json"), {}, "exists and is not a directory")):
    kept = {p: _snapshot(p) for p in (str(run), source)}
    with pytest.raises(ConfigError, match=match):
      export_lib.export_merged(model, out, overwrite=True, **kw)
    assert {p: _snapshot(p) for p in kept} == kept
  # overwrite=True: the exported files are replaced, the others kept
  export_lib.export_merged(model, existing, dtype="float32", overwrite=True)
  assert json.load(open(os.path.join(existing, "config.json")))["model_type"] != "mine"
  assert open(os.path.join(existing, "notes.txt")).read() == "keep me"
  again = hd.load_pretrained(existing)
  np.testing.assert_array_equal(np.asarray(again.layers[0].self_attn.q_proj.kernel[...]),
                                np.asarray(lora.merge(model).layers[0].self_attn.q_proj.kernel[...]))
  export_lib.export_merged(model, str(tmp_path / "empty_is_fine"), dtype="float32")
  (tmp_path / "empty").mkdir()
  export_lib.export_peft(model, str(tmp_path / "empty"), base)


def test_export_cli_refuses_the_runs_workdir_and_non_empty_dirs(workdir, tmp_path):
  import re

  base, wd, _ = workdir
  before = _snapshot(wd)
  link = tmp_path / "link_to_run"
  link.symlink_to(wd)
  cases = [  # (args, pattern of the one line)
      ([f"--workdir={wd}", f"--out={wd}", "--format=merged"], r"is inside the run being exported"),
      ([f"--workdir={wd}", f"--out={link / 'export'}", "--format=peft", "--overwrite"],
       r"is inside the run being exported"),
      ([f"--checkpoint={base}", f"--out={wd}", "--format=merged", "--overwrite"], r"is a training run's workdir"),
  ]
  for args, pattern in cases:
    res = _cli(*args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    assert re.search(pattern, lines[0]) and "config.json" in lines[0], lines[0]
    assert _snapshot(wd) == before  # the run is byte-for-byte unchanged
  existing = _existing_dir(tmp_path / "existing")
  kept = _snapshot(existing)
  res = _cli(f"--checkpoint={base}", f"--out={existing}", "--format=merged")
  assert res.returncode == 1 and res.stderr.strip().splitlines()[-1].startswith("error: "), res.stderr[-3000:]
  assert "not empty (3 entries" in res.stderr and "--overwrite" in res.stderr
  assert _snapshot(existing) == kept
  res = _cli(f"--checkpoint={base}", f"--out={existing}", "--format=merged", "--dtype=float32", "--overwrite")
  assert res.returncode == 0, res.stderr[-3000:]
  assert open(os.path.join(existing, "notes.txt")).read() == "keep me"
  assert json.load(open(os.path.join(existing, "generation_config.json")))["max_denoising_steps"] == 48
