"""Logit parity with transformers at a mid-size config, in float32 and in float64 (numerics at scale).

Question: is our fp32 disagreement with transformers at ~100M scale (1e-3 of a logit scale of ~4, against 1e-5 at
tiny sizes) a formula difference or float32 rounding? Both sides run the same random weights (transformers builds
the model, `save_pretrained` writes fp32 safetensors, our `load_pretrained` reads them) on the same prompt and
canvas, once in float32 and once in float64. If the float64 logits agree to ~1e-12 relative to the logit scale the
two stacks compute the same function, and the float32 difference is rounding (its size then grows with depth,
width and sequence length).

float64 is not a supported compute dtype of either library, so this script forces it (script-only patches, no
library change):
- ours: JAX `jax_enable_x64`; `ModelConfig` accepts 'float64' (its dtype whitelist is widened here); the model code
  pins some steps to fp32 by name (norms, RoPE tables, softmaxes, logits: `jnp.float32`), so the `jnp` seen by
  `model/layers.py`, `model/moe.py`, `model/moe_tiled.py`, `model/attention.py` and `model/transformer.py` is a
  proxy whose `float32` is float64.
- transformers: `model.double()`, plus what it pins to fp32: RMSNorm (`.float()`), RoPE (inverse frequencies and
  angles in fp32), eager attention and router softmax (`dtype=torch.float32`), the final logits cast
  (`.to(torch.float32)`) and the embedding scale buffer `sqrt(hidden)` (made in fp32), each replaced here by the
  same code in float64 (the embedding scale alone, left in fp32, gives a 1e-8 relative difference in float64). The
  MoE experts run their eager per-expert loop (the default `grouped_mm` kernel refuses float64).

The result (docs/results.md): in float64 the two agree layer by layer to within float64 rounding of the logit
scale, while each side's fp32 logits are far further off the float64 ones and the error grows with depth: no
formula difference, fp32 rounding. `--step0` does the same for scripts/benchmark_train.py's first train step
(loss and gradient norm).

Per-layer: forward hooks on transformers' encoder/decoder layers and wrappers around our `DecoderLayer.encode` /
`decode` (run eagerly) record every layer's output; `--per_layer` prints each layer's max difference relative to
that layer's max |h|, which locates a formula difference (the first layer whose float64 difference jumps).

  python scripts/float64_parity.py                      # hidden 512, vocab 32k, 4 layers, prompt 128, canvas 256
  python scripts/float64_parity.py --layers=8 --per_layer --moe_impl=dense
  python scripts/float64_parity.py --step0=100m --batch=1   # benchmark_train.py's step-0 loss / grad norm
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import types
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: hf_reference (also when loaded by a test)
from hf_reference import make_hf_model as _make_hf_model  # noqa: E402

S, F = "sliding_attention", "full_attention"


def text_config(layers: int, vocab: int = 32000, hidden: int = 512, **overrides: Any) -> dict[str, Any]:
  """The ~100M benchmark shape (scripts/benchmark_train.py `100m`), with `layers` layers (S S S F repeating, the last
  one full)."""
  types_ = [F if (i + 1) % 4 == 0 or i == layers - 1 else S for i in range(layers)]
  tc = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, global_head_dim=128,
            num_global_key_value_heads=1, sliding_window=512, num_experts=8, top_k_experts=2,
            moe_intermediate_size=hidden, layer_types=types_)
  tc.update(overrides)
  return tc


def make_hf_model(tc: dict[str, Any], canvas: int, seed: int = 0, perturb: bool = True):
  """A random `DiffusionGemmaForBlockDiffusion` (eval, fp32; `scripts/hf_reference.py`)."""
  return _make_hf_model(tc, canvas, seed, perturb=perturb)


# ---------------------------------------------------------------------------------------------------- torch fp64
class _Float64Torch(types.ModuleType):
  """`torch` with `float32` / `float` meaning float64 (for the modeling module's fp32-pinned steps)."""

  def __init__(self, torch):
    super().__init__("torch_float64")
    self._torch = torch

  def __getattr__(self, name):
    if name in ("float32", "float"):
      return self._torch.float64
    return getattr(self._torch, name)


@contextlib.contextmanager
def torch_float64(model):
  """`model` in float64 with every fp32-pinned step of transformers' DiffusionGemma computed in float64 instead.
  Restores the patched functions (not the model's dtype) on exit."""
  import torch
  import torch.nn as nn
  from transformers.models.diffusion_gemma import modeling_diffusion_gemma as m

  saved = {name: getattr(m, name) for name in ("eager_attention_forward",)}
  saved_methods = [(m.DiffusionGemmaRMSNorm, "forward"), (m.DiffusionGemmaTextRotaryEmbedding, "forward"),
                   (m.DiffusionGemmaTextRouter, "forward")]
  saved_methods = [(cls, name, cls.__dict__[name]) for cls, name in saved_methods]

  def norm_forward(self, x):
    y = self._norm(x.double())
    if self.with_scale:
      y = y * self.weight.double()
    return y.type_as(x)

  def rope_forward(self, x, position_ids, layer_type):
    inv_freq = getattr(self, f"{layer_type}_inv_freq64")
    freqs = position_ids[..., None].double() * inv_freq.to(device=x.device, dtype=torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = getattr(self, f"{layer_type}_attention_scaling")
    return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)

  def router_forward(self, h):
    h = self.norm(h)
    h = h * self.scale * self.scalar_root_size
    probs = nn.functional.softmax(self.proj(h), dim=-1, dtype=torch.float64)
    w, idx = torch.topk(probs, k=self.config.top_k_experts, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return probs, w * self.per_expert_scale[idx], idx

  orig_attention = saved["eager_attention_forward"]

  def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kw):
    if query.dtype != torch.float64:
      return orig_attention(module, query, key, value, attention_mask, dropout, scaling, softcap, **kw)
    key, value = m.repeat_kv(key, module.num_key_value_groups), m.repeat_kv(value, module.num_key_value_groups)
    w = torch.matmul(query, key.transpose(2, 3)) * (module.head_dim ** -0.5 if scaling is None else scaling)
    assert softcap is None
    if attention_mask is not None:
      w = w + attention_mask.to(w.dtype)
    w = nn.functional.softmax(w, dim=-1, dtype=torch.float64)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w

  # float64 inverse frequencies: the init functions (default / proportional) write `dtype=torch.float`
  old_float = torch.float
  for mod in model.modules():
    if isinstance(mod, m.DiffusionGemmaTextRotaryEmbedding):
      torch.float = torch.float64
      try:
        for lt, fn in mod.rope_init_fns.items():
          inv, _ = fn(mod.config.per_layer_config[lt], None, layer_type=lt)
          setattr(mod, f"{lt}_inv_freq64", inv.double())
      finally:
        torch.float = old_float
  m.DiffusionGemmaRMSNorm.forward = norm_forward
  m.DiffusionGemmaTextRotaryEmbedding.forward = rope_forward
  m.DiffusionGemmaTextRouter.forward = router_forward
  m.eager_attention_forward = attention
  # transformers' default experts kernel (`grouped_mm`) refuses float64: run its eager per-expert loop instead
  experts = [mod for mod in model.modules() if isinstance(mod, m.DiffusionGemmaTextExperts)]
  saved_impl = [mod.config._experts_implementation for mod in experts]
  for mod in experts:
    mod.config._experts_implementation = "eager"
  # the embedding scale sqrt(hidden) is a buffer made in fp32 (`torch.tensor(float)`): recreate it in float64
  embeds = [mod for mod in model.modules() if isinstance(mod, m.DiffusionGemmaTextScaledWordEmbedding)]
  for mod in embeds:
    mod.embed_scale = torch.tensor(mod.scalar_embed_scale, dtype=torch.float64)
  # ... and the rest of the module's `torch.float32` (the final logits cast): a `torch` whose float32 is float64
  m.torch = _Float64Torch(torch)
  try:
    yield model.double()
  finally:
    for mod in embeds:
      mod.embed_scale = torch.tensor(mod.scalar_embed_scale)
    for mod, impl in zip(experts, saved_impl):
      mod.config._experts_implementation = impl
    for cls, name, fn in saved_methods:
      setattr(cls, name, fn)
    m.eager_attention_forward = orig_attention
    m.torch = torch


def torch_logits(model, ids: np.ndarray, canvas: np.ndarray, capture: bool = False, sc=None, sc_mask=None):
  """(logits [B, C, V] float64 numpy, per-layer outputs {('enc'|'dec', i): array}) of the reference.
  sc [B, C, V] / sc_mask [B]: self-conditioning logits and row mask (optional)."""
  import torch

  layers_out: dict[tuple[str, int], np.ndarray] = {}
  handles = []
  if capture:
    for kind, mods in (("enc", model.model.encoder.language_model.layers), ("dec", model.model.decoder.layers)):
      for i, mod in enumerate(mods):
        def hook(_, __, out, key=(kind, i)):
          out = out[0] if isinstance(out, tuple) else out
          layers_out[key] = out.detach().double().numpy()
        handles.append(mod.register_forward_hook(hook))
  try:
    with torch.no_grad():
      kw = {}
      if sc is not None:
        dtype = next(model.parameters()).dtype
        kw["self_conditioning_logits"] = torch.tensor(np.asarray(sc, np.float64)).to(dtype)
      if sc_mask is not None:
        kw["self_conditioning_mask"] = torch.tensor(sc_mask)
      out = model(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas), **kw)
    logits = out.logits
    if logits.dtype != torch.float64:
      logits = logits.double()
  finally:
    for h in handles:
      h.remove()
  return logits.numpy(), layers_out


# ---------------------------------------------------------------------------------------------------- ours fp64
class _Float64Jnp(types.ModuleType):
  """`jax.numpy` with `float32` meaning float64 (for the model modules' fp32-pinned steps)."""

  def __init__(self, jnp):
    super().__init__("jnp_float64")
    self._jnp = jnp

  def __getattr__(self, name):
    if name == "float32":
      return self._jnp.float64
    return getattr(self._jnp, name)


@contextlib.contextmanager
def ours_float64():
  import jax
  import jax.numpy as jnp

  from hackable_diffusion.model import attention, config, layers, moe, moe_tiled, transformer

  mods = [layers, moe, moe_tiled, attention, transformer]
  try:  # the tiled output head, where present
    from hackable_diffusion.model import head
    mods.append(head)
  except ImportError:
    pass
  saved = [m.jnp for m in mods]
  saved_dtypes, saved_x64 = config._DTYPES, jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  config._DTYPES = (*saved_dtypes, "float64")
  proxy = _Float64Jnp(jnp)
  for m in mods:
    m.jnp = proxy
  try:
    yield
  finally:
    for m, j in zip(mods, saved):
      m.jnp = j
    config._DTYPES = saved_dtypes
    jax.config.update("jax_enable_x64", saved_x64)


def our_logits(model, ids: np.ndarray, canvas: np.ndarray, capture: bool = False, sc=None, sc_mask=None):
  """(logits float64 numpy, per-layer outputs) of our model. `capture` runs eagerly (layer outputs are recorded
  by wrapping `DecoderLayer.encode` / `decode`); otherwise one `forward` compilation."""
  import jax.numpy as jnp

  from hackable_diffusion.model import transformer

  ids_j, canvas_j = jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32)
  sc_j = None if sc is None else jnp.asarray(sc, model.embed_tokens[...].dtype)
  mask_j = None if sc_mask is None else jnp.asarray(sc_mask, bool)
  if not capture:
    return np.asarray(transformer.forward(model, ids_j, canvas_j, None, sc_j, mask_j), np.float64), {}
  layers_out: dict[tuple[str, int], np.ndarray] = {}
  enc, dec = transformer.DecoderLayer.encode, transformer.DecoderLayer.decode
  counters = {"enc": 0, "dec": 0}

  def wrap(kind, fn):
    def inner(self, *a, **kw):
      out = fn(self, *a, **kw)
      layers_out[(kind, counters[kind])] = np.asarray(out[0] if isinstance(out, tuple) else out, np.float64)
      counters[kind] += 1
      return out
    return inner

  transformer.DecoderLayer.encode, transformer.DecoderLayer.decode = wrap("enc", enc), wrap("dec", dec)
  try:
    logits = np.asarray(model(ids_j, canvas_j, None, sc_j, mask_j), np.float64)
  finally:
    transformer.DecoderLayer.encode, transformer.DecoderLayer.decode = enc, dec
  return logits, layers_out


# ---------------------------------------------------------------------------------------------------- report
def diff_stats(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
  """Max and median (over positions of the per-position max) |a - b|, and both relative to max |b|."""
  d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
  scale = float(np.max(np.abs(b)))
  per_pos = d.reshape(-1, d.shape[-1]).max(-1)
  return dict(max=float(d.max()), median=float(np.median(per_pos)), scale=scale, rel_max=float(d.max()) / scale,
              rel_median=float(np.median(per_pos)) / scale)


def fmt(s: dict[str, float]) -> str:
  return (f"max {s['max']:.3e} (rel {s['rel_max']:.2e}), median/position {s['median']:.3e} "
          f"(rel {s['rel_median']:.2e}), scale {s['scale']:.3f}")


def compare(layers: int, vocab: int, hidden: int, prompt: int, canvas: int, batch: int, moe_impls: list[str],
            per_layer: bool, seed: int = 0, perturb: bool = True, log=print) -> dict[str, Any]:
  """Runs the comparison; returns {'fp32': {impl: stats}, 'fp64': {impl: stats}, 'fp32_torch_vs_fp64_torch': stats,
  'fp32_ours_vs_fp64_ours': {impl: stats}}."""
  import hackable_diffusion as hd

  tc = text_config(layers, vocab, hidden)
  ref = make_hf_model(tc, canvas, seed=seed, perturb=perturb)
  rng = np.random.default_rng(seed + 7)
  ids = rng.integers(3, vocab - 3, size=(batch, prompt)).astype(np.int64)
  cvs = rng.integers(3, vocab - 3, size=(batch, canvas)).astype(np.int64)
  result: dict[str, Any] = {"fp32": {}, "fp64": {}, "ours_fp32_vs_fp64": {}, "layers": {}}
  with tempfile.TemporaryDirectory() as path:
    ref.save_pretrained(path)
    t0 = time.perf_counter()
    t32, tl32 = torch_logits(ref, ids, cvs, capture=per_layer)
    log(f"torch fp32: {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    with torch_float64(ref):
      t64, tl64 = torch_logits(ref, ids, cvs, capture=per_layer)
    ref.float()
    log(f"torch fp64: {time.perf_counter() - t0:.1f}s")
    result["torch_fp32_vs_fp64"] = diff_stats(t32, t64)
    for impl in moe_impls:
      t0 = time.perf_counter()
      ours = hd.load_pretrained(path, dtype="float32", moe_impl=impl)
      o32, ol32 = our_logits(ours, ids, cvs, capture=per_layer)
      del ours
      log(f"ours fp32 ({impl}): {time.perf_counter() - t0:.1f}s")
      t0 = time.perf_counter()
      with ours_float64():
        ours = hd.load_pretrained(path, dtype="float64", moe_impl=impl)
        assert ours.embed_tokens[...].dtype == np.float64
        o64, ol64 = our_logits(ours, ids, cvs, capture=per_layer)
        del ours
      log(f"ours fp64 ({impl}): {time.perf_counter() - t0:.1f}s")
      result["fp32"][impl] = diff_stats(o32, t32)
      result["fp64"][impl] = diff_stats(o64, t64)
      result["ours_fp32_vs_fp64"][impl] = diff_stats(o32, o64)
      if per_layer:
        rows = []
        for key in sorted(tl64, key=lambda k: (k[0] != "enc", k[1])):
          rows.append((key, diff_stats(ol32[key], tl32[key])["rel_max"], diff_stats(ol64[key], tl64[key])["rel_max"],
                       diff_stats(tl32[key], tl64[key])["rel_max"]))
        result["layers"][impl] = rows
  return result



# ---------------------------------------------------------------------------------------------------- train step 0
def _bench_setup(size_name: str, batch: int | None):
  """(benchmark module, Size, batch, loss config, key, noise) of `scripts/benchmark_train.py`'s step 0."""
  import dataclasses

  import jax

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import benchmark_train as bt

  from hackable_diffusion.diffusion.loss import draw_noise

  size = bt.SIZES[size_name]
  if batch:
    size = dataclasses.replace(size, batch=batch)
  data, lc, key = bt.make_batch(size), bt.loss_config(), jax.random.key(1000)  # the benchmark's step-0 draw
  return bt, size, data, lc, key, draw_noise(key, data, size.model.canvas_length, size.model.vocab_size, lc)


def step0_torch(size_name: str, batch: int | None) -> dict[str, dict[str, float]]:
  """transformers' step-0 SFT loss and gradient norm (`benchmark_train.torch_loss`) in fp32, then float64."""
  import torch
  from transformers import DiffusionGemmaForBlockDiffusion

  from hackable_diffusion.interop.hf import save_pretrained
  from hackable_diffusion.model.transformer import init_model

  bt, size, data, _, _, noise = _bench_setup(size_name, batch)
  with tempfile.TemporaryDirectory() as path:
    save_pretrained(init_model(size.model, 0), path)  # the benchmark's weights (our init, seed 0)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32)
  ref.train()
  params = [p for n, p in ref.named_parameters() if "vision" not in n]
  for n, p in ref.named_parameters():
    p.requires_grad_("vision" not in n)
  x = bt.torch_inputs(data, noise)

  def run():
    for p in params:
      p.grad = None
    loss, _, _ = bt.torch_loss(ref, x, size.model.canvas_length)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))
    return dict(loss=loss.item(), grad_norm=float(grad_norm))

  out = {"fp32": run()}
  softcap = bt._softcap
  bt._softcap = lambda logits, cap: logits if cap is None else torch.tanh(logits / cap) * cap  # no fp32 cast
  try:
    with torch_float64(ref):
      out["fp64"] = run()
  finally:
    bt._softcap = softcap
  return out


def step0_ours(size_name: str, batch: int | None) -> dict[str, dict[str, float]]:
  """Our step-0 SFT loss and gradient norm (`diffusion_loss` on the benchmark's noise draw) in fp32, then in
  float64 (the same fp32 initial weights, cast)."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from hackable_diffusion.diffusion import loss as loss_mod
  from hackable_diffusion.model.transformer import DiffusionGemma, init_model

  _, size, data, lc, key, noise = _bench_setup(size_name, batch)

  @nnx.jit
  def value_and_norm(model, noise):
    fn = lambda m: loss_mod.diffusion_loss(m, data, key, lc, noise=noise)[0]  # noqa: E731
    loss, grads = nnx.value_and_grad(fn)(model)
    return loss, optax.global_norm(grads)

  model = init_model(size.model, 0)
  loss, grad_norm = value_and_norm(model, noise)
  out = {"fp32": dict(loss=float(loss), grad_norm=float(grad_norm))}
  host = jax.tree.map(np.asarray, nnx.state(model))
  del model
  with ours_float64():
    saved = loss_mod.jnp
    loss_mod.jnp = _Float64Jnp(jnp)  # the loss's fp32-pinned steps (log-softmax, CE) in float64 too
    try:
      cfg = dataclasses.replace(size.model, dtype="float64", param_dtype="float64")
      graphdef, abstract = nnx.split(nnx.eval_shape(lambda: DiffusionGemma(cfg, rngs=nnx.Rngs(0))))
      model = nnx.merge(graphdef, jax.tree.map(lambda a, h: jnp.asarray(h, a.dtype), abstract, host))
      loss, grad_norm = value_and_norm(model, noise)
      out["fp64"] = dict(loss=float(loss), grad_norm=float(grad_norm))
    finally:
      loss_mod.jnp = saved
  return out


def step0(size_name: str, batch: int | None) -> int:
  """Both sides' step 0, each in a child process (peak memory: one library's fp64 backward pass), and the table."""
  import json
  import subprocess

  res = {}
  for side in ("torch", "ours"):
    cmd = [sys.executable, os.path.abspath(__file__), f"--step0={size_name}", f"--_side={side}"]
    if batch:
      cmd.append(f"--batch={batch}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
      print(proc.stdout + proc.stderr[-3000:])
      return proc.returncode
    res[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{side}: {time.perf_counter() - start:.0f}s", flush=True)
  rel = lambda a, b: abs(a - b) / abs(b)  # noqa: E731
  print(f"step 0 of benchmark size {size_name} (batch {batch or 'as benchmarked'}): relative differences")
  print("| quantity | ours fp32 vs torch fp32 | torch fp32 vs torch fp64 | ours fp32 vs ours fp64 "
        "| ours fp64 vs torch fp64 |")
  print("|---|---|---|---|---|")
  for q in ("loss", "grad_norm"):
    t32, t64 = res["torch"]["fp32"][q], res["torch"]["fp64"][q]
    o32, o64 = res["ours"]["fp32"][q], res["ours"]["fp64"][q]
    print(f"| {q} | {rel(o32, t32):.1e} | {rel(t32, t64):.1e} | {rel(o32, o64):.1e} | {rel(o64, t64):.1e} |")
  print(json.dumps(res))
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--canvas", type=int, default=256)
  parser.add_argument("--batch", type=int, default=None, help="default 1 (--step0: the benchmark's batch)")
  parser.add_argument("--moe_impl", default="tiled,dense", help="comma-separated, of tiled/dense/ragged")
  parser.add_argument("--per_layer", action="store_true", help="also compare every layer's output (eager, slower)")
  parser.add_argument("--no_perturb", action="store_true", help="transformers' own init (norms 1, layer scalars 1)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--step0", default=None,
                      help="instead: step-0 loss and gradient norm of scripts/benchmark_train.py's size (e.g. 100m), "
                           "fp32 and float64, both sides (--batch: override the benchmark's batch)")
  parser.add_argument("--_side", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.step0:
    batch = args.batch
    if args._side:
      import json
      print(json.dumps((step0_torch if args._side == "torch" else step0_ours)(args.step0, batch)))
      return 0
    return step0(args.step0, batch)
  args.batch = args.batch or 1

  import jax
  import torch

  print(f"jax {jax.__version__}, torch {torch.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
        f"layers {args.layers}, vocab {args.vocab}, hidden {args.hidden}, prompt {args.prompt}, canvas {args.canvas}, "
        f"batch {args.batch}", flush=True)
  res = compare(args.layers, args.vocab, args.hidden, args.prompt, args.canvas, args.batch,
                [s.strip() for s in args.moe_impl.split(",")], args.per_layer, args.seed, not args.no_perturb,
                log=lambda s: print(s, flush=True))
  print()
  print(f"torch fp32 vs torch fp64 (transformers' own fp32 rounding): {fmt(res['torch_fp32_vs_fp64'])}")
  for impl in res["fp32"]:
    print(f"[{impl}] ours fp32 vs ours fp64 (our own fp32 rounding):       {fmt(res['ours_fp32_vs_fp64'][impl])}")
    print(f"[{impl}] ours fp32 vs transformers fp32:                      {fmt(res['fp32'][impl])}")
    print(f"[{impl}] ours fp64 vs transformers fp64 (formula check):       {fmt(res['fp64'][impl])}")
    if res["layers"].get(impl):
      print(f"[{impl}] per layer, max |diff| / max |h|:  fp32 ours-torch | fp64 ours-torch | torch fp32-fp64")
      for key, r32, r64, rt in res["layers"][impl]:
        print(f"   {key[0]} {key[1]}: {r32:.2e} | {r64:.2e} | {rt:.2e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
