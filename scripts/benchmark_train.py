"""Training throughput of our jitted train step vs an equivalent PyTorch step on transformers' DiffusionGemma.

Both sides hold identical parameters (our fresh `init_model` -> `save_pretrained` -> transformers
`from_pretrained` -> transformers `save_pretrained` -> our `load_pretrained`, so the weights travel both ways),
see the same batch and the same random draws (canvas, time, corruption, self-conditioning coin: our `draw_noise`
with the key our step uses, fed to torch as tensors), and compute the same SFT objective (docs/reference.md,
"Training recipe"):

  encoder, causal over prompt + clean completion -> AR next-token CE over the completion (weight 1.0);
  decoder over the noisy canvas reading the encoder's cache cut to prompt + clean canvases before it;
  self-conditioning: a first decoder pass under no_grad / stop_gradient for the whole batch, its logits fed to the
  second pass on the rows whose coin (p = 0.5) came up; flat mean CE over the valid canvas positions;
  optimizer: clip global norm 1.0 -> AdamW(b1 0.95, b2 0.99, eps 1e-8, weight decay 1e-4), constant lr.

The first step of each side starts from the same parameters and noise and its loss and pre-clip gradient norm
are compared (printed, and the script fails when they disagree beyond `--check_tol` for the loss and
`--check_tol_grad` for the gradient norm, relative). What to expect is set by float32 rounding, not by the formulas:
in float64 both sides agree to ~1e-14 (loss) and ~1e-12 (gradient norm) at ~100M, but each side's fp32 step 0 is
off its own float64 value by up to ~1e-3 (loss) and ~2.4e-2 (gradient norm) there, and the two fp32 sides differ
by as much (`python scripts/float64_parity.py --step0=100m --batch=1`; docs/results.md). The
amplifier is the self-conditioning pass of a freshly initialised model: near-uniform logits over 32k tokens give a
soft embedding that nearly cancels, and its RMSNorm scales the rounding noise up to unit size. Hence the defaults
5e-3 / 1e-1 (4x the largest fp32-vs-fp64 deviation measured). At the Sudoku size rounding is far smaller; there
the gradient norm differs by ~1e-3 for another reason: transformers' embedding has `padding_idx = pad_token_id`,
so its lookups never send gradient to the pad row, and the uniform corruption does draw the pad id (every other
parameter's gradient agrees to ~3e-5, checked tensor by tensor). The completion is one canvas (as in the Sudoku
recipe), so the decoder's prefix is the prompt and every row decodes canvas 0 (transformers' cache has one length
per batch).

Tokens per step = encoder tokens + decoder canvas tokens = B * (P + C) + B * C (the decoder runs two forward passes and
one backward over its canvas; it is counted once). The two sides run in alternating blocks (`--block=3`: per round, one
untimed step of ours then 3 timed ones, then the same for torch; rounds until `--steps` timed steps per side), so that
load on a shared machine hits both alike while each side is measured in its own steady state: right after the other
library's step, a step of either side is markedly slower (both libraries allocate and free GBs per step, and the first
step after a switch pays for the other's memory state). `--block=0` interleaves single steps (one ours, one torch, ...;
every step timed) and shows that cost. The median step time is reported, and the ratio is torch time / our time. Our
compile time (`lower().compile()` of the whole step) is excluded from the throughput and reported separately. Threads:
torch's default (`torch.get_num_threads()`), XLA's default; `--cpus=0` pins the process to one core first, so that both
run one thread (torch's OpenMP step time swings widely on a shared 2-core machine: see docs/results.md). `--profile`
adds a table of the steps' pieces.

  python scripts/benchmark_train.py                              # sudoku and 100m, 10 timed steps each
  python scripts/benchmark_train.py --sizes=100m --steps=5 --profile
  python scripts/benchmark_train.py --cpus=0                     # one core, one thread for each side
  python scripts/benchmark_train.py --matmul_dtype=bfloat16 --check_tol=5e-2 --check_tol_grad=2e-1 [--torch_autocast]
                                                                 # bf16 products (AMX), vs torch fp32 or autocast
  python scripts/benchmark_train.py --smoke                      # micro config, 2 steps (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion.loss import LossConfig, NoisedCanvas, cross_entropy, diffusion_loss, draw_noise
from hackable_diffusion.model.config import FULL, SLIDING, ModelConfig, get_preset
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer
from hackable_diffusion.training.step import init_train_state, make_train_step

S, F = SLIDING, FULL


@dataclasses.dataclass(frozen=True)
class Size:
  label: str
  model: ModelConfig
  prompt: int
  batch: int


SIZES: dict[str, Size] = {
    # get_preset('sudoku'): vocab 32, hidden 128, 4 layers (S F S F), 4 experts top-2, canvas 81.
    "sudoku": Size("Sudoku", get_preset("sudoku"), prompt=81, batch=32),
    # ~100M parameters (the real model's layer pattern, docs/reference.md "Real model dimensions"; the same text
    # config as scripts/benchmark_sampler.py size b).
    "100m": Size("~100M", ModelConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, global_head_dim=128, num_global_key_value_heads=1, sliding_window=512,
        num_experts=8, top_k_experts=2, moe_intermediate_size=512, layer_types=(S, S, S, F, S, S, S, F),
        canvas_length=256), prompt=128, batch=4),
    # micro: the smoke test (seconds).
    "micro": Size("micro", get_preset("tiny", sliding_window=64), prompt=8, batch=2),
}
LR = 1.5e-4


# ---------------------------------------------------------------------------------------------------- models
def build_pair(size: Size, workdir: str, seed: int = 0, matmul_dtype: str = "auto"):
  """(our model, torch model) with identical parameters, weights copied ours -> HF -> ours (ours computing its
  projections as `matmul_dtype` says: `ModelConfig.matmul_dtype`)."""
  import torch
  from transformers import DiffusionGemmaForBlockDiffusion

  from hackable_diffusion.interop.hf import load_pretrained, save_pretrained
  from hackable_diffusion.model.transformer import init_model

  first, second = os.path.join(workdir, "from_ours"), os.path.join(workdir, "from_torch")
  save_pretrained(init_model(size.model, seed), first)  # ours -> HF (with a tiny vision stub)
  ref = DiffusionGemmaForBlockDiffusion.from_pretrained(first, dtype=torch.float32)
  ref.save_pretrained(second)  # HF -> ours
  # transformers re-saves a full layer whose head_dim equals the sliding one with an empty `per_layer_config`, which
  # our `from_hf_config` reads as global_head_dim 512 (the Sudoku preset hits this): pass the intended shape.
  ours = load_pretrained(second, global_head_dim=size.model.global_head_dim,
                         num_global_key_value_heads=size.model.num_global_key_value_heads, matmul_dtype=matmul_dtype)
  assert ours.config == dataclasses.replace(size.model, matmul_dtype=matmul_dtype), (ours.config, size.model)
  ref.train()
  for name, p in ref.named_parameters():
    p.requires_grad_("vision" not in name)  # text-only training, like ours (the vision tower is never run)
  return ours, ref


def make_batch(size: Size, seed: int = 0) -> SFTBatch:
  cfg = size.model
  rng = np.random.default_rng(seed)
  b, p, c = size.batch, size.prompt, cfg.canvas_length
  lo, hi = 3, max(cfg.vocab_size - 3, 4)
  return SFTBatch(prompt_ids=jnp.asarray(rng.integers(lo, hi, (b, p)), jnp.int32), prompt_mask=jnp.ones((b, p), bool),
                  completion_ids=jnp.asarray(rng.integers(lo, hi, (b, c)), jnp.int32),
                  completion_mask=jnp.ones((b, c), bool))


def tokens_per_step(size: Size) -> int:
  c = size.model.canvas_length
  return size.batch * (size.prompt + c) + size.batch * c


# ---------------------------------------------------------------------------------------------------- torch
def torch_inputs(batch: SFTBatch, noise: NoisedCanvas) -> dict[str, Any]:
  import torch

  t = lambda x, dt=torch.long: torch.from_numpy(np.asarray(x).astype(np.int64)).to(dt)  # noqa: E731
  free = np.asarray(noise.valid) & ~np.asarray(noise.pinned)
  return dict(prompt_ids=t(batch.prompt_ids), prompt_mask=t(batch.prompt_mask),
              completion_ids=t(batch.completion_ids), completion_mask=t(batch.completion_mask),
              canvas_index=np.asarray(noise.canvas_index), noisy=t(noise.noisy), clean=t(noise.clean),
              free=t(free, torch.float32), use_sc=t(noise.use_sc, torch.bool))


def _softcap(logits, cap):
  import torch

  logits = logits.float()
  return logits if cap is None else torch.tanh(logits / cap) * cap


def torch_loss(model, x: dict[str, Any], canvas_length: int):
  """The SFT loss of `hackable_diffusion.diffusion.loss.diffusion_loss` (variant 'flat', AR weight 1) written
  with transformers' modules: returns (loss, diffusion term, AR term)."""
  import torch
  import torch.nn.functional as F
  from transformers import DynamicCache

  text = model.config.text_config
  cap = text.final_logit_softcapping
  c = canvas_length
  p = x["prompt_ids"].shape[1]
  width = x["completion_ids"].shape[1]
  ids = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
  mask = torch.cat([x["prompt_mask"], x["completion_mask"]], 1)
  # Encoder: causal over prompt + clean completion; AR CE of position t predicting token t + 1 over the completion.
  enc = model.model.encoder(input_ids=ids, attention_mask=mask, use_cache=True)
  ar_logits = _softcap(model.lm_head(enc.last_hidden_state[:, p - 1: p + width - 1]), cap)
  ar_ce = F.cross_entropy(ar_logits.reshape(-1, ar_logits.shape[-1]), x["completion_ids"].reshape(-1),
                          reduction="none")
  comp_mask = x["completion_mask"].reshape(-1).float()
  ar = (ar_ce * comp_mask).sum() / comp_mask.sum().clamp_min(1.0)
  # Decoder cache: the encoder's keys/values over the prompt and the clean canvases before the chosen one (one
  # prefix length per batch in transformers: every row must have chosen the same canvas).
  k = np.unique(x["canvas_index"])
  assert k.size == 1, f"rows chose different canvases {k}: transformers' cache has one length per batch"
  prefix = p + int(k[0]) * c
  cache = DynamicCache(config=text)
  for i, layer in enumerate(enc.past_key_values.layers):
    assert layer.keys.shape[-2] == ids.shape[1], "a sliding layer dropped cached positions (window too small)"
    cache.update(layer.keys[:, :, :prefix], layer.values[:, :, :prefix], i)
  dec_mask = torch.cat([mask[:, :prefix], torch.ones_like(x["noisy"])], 1)

  def decode(sc_logits=None, sc_mask=None):
    out = model.model.decoder(decoder_input_ids=x["noisy"], past_key_values=cache, self_conditioning_logits=sc_logits,
                              self_conditioning_mask=sc_mask, decoder_attention_mask=dec_mask)
    return _softcap(model.lm_head(out.last_hidden_state), cap)

  with torch.no_grad():
    first = decode()
  logits = decode(first, x["use_sc"])
  ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x["clean"].reshape(-1), reduction="none")
  free = x["free"].reshape(-1)
  diff = (ce * free).sum() / free.sum().clamp_min(1.0)
  return diff + ar, diff, ar


def make_torch_step(model, canvas_length: int, autocast: bool = False):
  """`autocast`: the forward pass under `torch.autocast('cpu', torch.bfloat16)` (bf16 matmuls on AMX, float32
  parameters and optimizer; torch's own mixed-precision recipe)."""
  import contextlib

  import torch

  params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
  opt = torch.optim.AdamW(params, lr=LR, betas=(0.95, 0.99), eps=1e-8, weight_decay=1e-4)
  context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

  def step(x):
    opt.zero_grad(set_to_none=True)
    with context():
      loss, _, _ = torch_loss(model, x, canvas_length)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return loss.item(), grad_norm.item()

  return step, params, opt


# ---------------------------------------------------------------------------------------------------- ours
def loss_config() -> LossConfig:
  return LossConfig(variant="flat", self_conditioning_prob=0.5, encoder_ar_weight=1.0)


def make_our_step(model, batch: SFTBatch, key):
  """(compiled step, initial state, compile seconds, graphdef, tx)."""
  tx, _ = make_optimizer(OptimizerConfig(peak_lr=LR, warmup_steps=0, schedule="constant"))
  graphdef, state = init_train_state(model, tx)
  state = jax.tree.map(jnp.array, state)  # a copy: the step donates its state, `model` stays usable
  jitted = make_train_step(graphdef, tx, loss_config())
  start = time.perf_counter()
  compiled = jitted.lower(state, batch, key).compile()
  return compiled, state, time.perf_counter() - start, graphdef, tx


def flops_of(compiled) -> float | None:
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])
  except Exception:  # cost analysis is best effort
    return None


# ---------------------------------------------------------------------------------------------------- profile
def interleaved_medians(fns: dict[str, Any], rounds: int) -> tuple[dict[str, float], list[float]]:
  """Runs every zero-argument callable once per round, interleaved; returns each one's median wall time and the
  load averages seen."""
  times: dict[str, list[float]] = {k: [] for k in fns}
  loads = []
  for _ in range(rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
    loads.append(os.getloadavg()[0])
  return {k: statistics.median(v) for k, v in times.items()}, loads


def profile_pieces(size: Size, ours, ref, batch: SFTBatch, key, rounds: int) -> list[str]:
  """Times the pieces of both steps separately (interleaved, medians) and returns markdown table rows.

  Pieces: the encoder alone (forward + backward of the AR loss: encoder over prompt + completion, LM head, CE), the
  whole loss forward, the whole loss forward + backward (encoder + both decoder passes; the decoder share is the
  difference), the optimizer (clip + AdamW, without the step's non-finite guard), the whole train step, and -- ours
  only -- the train step of the same model with `num_experts = top_k_experts` (no routing at all: what the MoE
  layers would cost if every token's experts were the only ones).
  """
  import torch

  cfg = size.model
  lc = loss_config()
  tx, _ = make_optimizer(OptimizerConfig(peak_lr=LR, warmup_steps=0, schedule="constant"))
  graphdef, state = init_train_state(ours, tx)
  state = jax.tree.map(jnp.array, state)
  noise = draw_noise(key, batch, cfg.canvas_length, cfg.vocab_size, lc)
  x = torch_inputs(batch, noise)
  p, width = size.prompt, batch.completion_ids.shape[1]

  def enc_loss(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    ids = jnp.concatenate([batch.prompt_ids, batch.completion_ids], 1)
    mask = jnp.concatenate([batch.prompt_mask, batch.completion_mask], 1)
    hidden, _ = model.encode(ids, model.init_cache(ids.shape[0], ids.shape[1]), mask)
    logits = model.lm_logits(hidden[:, p - 1: p + width - 1])
    return jnp.mean(cross_entropy(logits, batch.completion_ids))

  def full_loss(params, rest, batch, noise):
    return diffusion_loss(nnx.merge(graphdef, params, rest), batch, key, lc, noise=noise)[0]

  def opt_update(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  grads0 = jax.tree.map(lambda a: jnp.full_like(a, 1e-3), state.params)
  pieces = {
      "encoder fwd+bwd": (jax.value_and_grad(enc_loss), (state.params, state.rest, batch)),
      "loss fwd": (full_loss, (state.params, state.rest, batch, noise)),
      "loss fwd+bwd": (jax.value_and_grad(full_loss), (state.params, state.rest, batch, noise)),
      "optimizer": (opt_update, (state.params, state.opt_state, grads0)),
  }
  ours_fns, flops = {}, {}
  for name, (fn, args) in pieces.items():
    compiled = jax.jit(fn).lower(*args).compile()
    flops[name] = flops_of(compiled)
    ours_fns[name] = (lambda c, a: lambda: jax.block_until_ready(c(*a)))(compiled, args)
  from hackable_diffusion.model.transformer import init_model

  def repeated_step(model):  # -> (zero-argument timed call of our compiled step on its own state, its FLOPs)
    compiled, state, _, _, _ = make_our_step(model, batch, key)
    holder = {"state": state}

    def run():
      holder["state"], m = compiled(holder["state"], batch, key)
      jax.block_until_ready((holder["state"], m))

    return run, flops_of(compiled)

  ours_fns["train step"], flops["train step"] = repeated_step(ours)
  sparse = init_model(cfg.replace(num_experts=cfg.top_k_experts), 0)
  ours_fns["train step, experts = top-k"], flops["train step, experts = top-k"] = repeated_step(sparse)

  params = [q for q in ref.parameters() if q.requires_grad]
  opt = torch.optim.AdamW(params, lr=LR, betas=(0.95, 0.99), eps=1e-8, weight_decay=1e-4)
  cap = ref.config.text_config.final_logit_softcapping

  def t_enc():
    for q in params:
      q.grad = None
    ids = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    mask = torch.cat([x["prompt_mask"], x["completion_mask"]], 1)
    hid = ref.model.encoder(input_ids=ids, attention_mask=mask, use_cache=True).last_hidden_state
    logits = _softcap(ref.lm_head(hid[:, p - 1: p + width - 1]), cap)
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x["completion_ids"].reshape(-1)).backward()

  def t_fwd():
    with torch.no_grad():
      torch_loss(ref, x, cfg.canvas_length)

  def t_full():
    for q in params:
      q.grad = None
    torch_loss(ref, x, cfg.canvas_length)[0].backward()

  def t_opt():
    for q in params:  # gradients of the size of real ones (not timed: a cheap fill)
      if q.grad is None:
        q.grad = torch.full_like(q, 1e-3)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()

  torch_step, _, _ = make_torch_step(ref, cfg.canvas_length)
  torch_fns = {"encoder fwd+bwd": t_enc, "loss fwd": t_fwd, "loss fwd+bwd": t_full, "optimizer": t_opt,
               "train step": lambda: torch_step(x)}
  fns = {}
  for name in ours_fns:
    fns["ours:" + name] = ours_fns[name]
    if name in torch_fns:
      fns["torch:" + name] = torch_fns[name]
  for fn in fns.values():  # warm-up
    fn()
  med, loads = interleaved_medians(fns, rounds)
  load = f"{min(loads):.1f}-{max(loads):.1f}"
  rows = []
  for name in ours_fns:
    o = med["ours:" + name]
    t = med.get("torch:" + name)
    eff = f"{flops[name] / o / 1e9:.0f}" if flops.get(name) else "n/a"
    tt, ratio = (f"{1e3 * t:.0f}", f"{t / o:.2f}x") if t is not None else ("-", "-")
    rows.append(f"| {size.label} | {name} | {1e3 * o:.0f} | {tt} | {ratio} | {eff} | {load} |")
  return rows


# ---------------------------------------------------------------------------------------------------- main
def run_size(name: str, size: Size, steps: int, warmup: int, workdir: str, check_tol: float,
             threads: str, block: int, check_tol_grad: float | None = None, matmul_dtype: str = "auto",
             torch_autocast: bool = False) -> tuple[str, dict]:
  import torch

  ours, ref = build_pair(size, workdir, matmul_dtype=matmul_dtype)
  batch = make_batch(size)
  cfg = size.model
  lc = loss_config()
  keys = [jax.random.key(1000 + i) for i in range(warmup + 2 * steps + 1)]  # enough for the untimed block steps
  noises = [torch_inputs(batch, draw_noise(k, batch, cfg.canvas_length, cfg.vocab_size, lc)) for k in keys]
  compiled, state, compile_s, _, _ = make_our_step(ours, batch, keys[0])
  flops = flops_of(compiled)
  torch_step, _, _ = make_torch_step(ref, cfg.canvas_length, torch_autocast)

  # Step 0 of both sides: identical parameters and draws -> same loss and gradient norm.
  state, metrics = compiled(state, batch, keys[0])
  ours_loss, ours_gn = float(metrics["loss"]), float(metrics["grad_norm"])
  ref_loss, ref_gn = torch_step(noises[0])
  loss_err = abs(ours_loss - ref_loss) / max(abs(ref_loss), 1e-6)
  gn_err = abs(ours_gn - ref_gn) / max(abs(ref_gn), 1e-6)
  print(f"[{name}] parity, step 0: loss ours {ours_loss:.6f} torch {ref_loss:.6f} (rel {loss_err:.1e}); "
        f"grad norm ours {ours_gn:.6f} torch {ref_gn:.6f} (rel {gn_err:.1e})", flush=True)
  grad_tol = check_tol if check_tol_grad is None else check_tol_grad
  if not (loss_err <= check_tol and gn_err <= grad_tol):
    raise SystemExit(f"[{name}] the two train steps disagree (relative tolerance: loss {check_tol}, gradient norm "
                     f"{grad_tol}): not comparable")
  for i in range(1, warmup):
    state, _ = compiled(state, batch, keys[i])
    jax.block_until_ready(state)
    torch_step(noises[i])

  def ours_step(i: int) -> float:
    nonlocal state
    start = time.perf_counter()
    state, metrics = compiled(state, batch, keys[i])
    jax.block_until_ready((state, metrics))
    return time.perf_counter() - start

  def ref_step(i: int) -> float:
    start = time.perf_counter()
    torch_step(noises[i])
    return time.perf_counter() - start

  t_ours, t_torch, loads = [], [], []
  if block == 0:  # single steps, interleaved, all timed
    for i in range(warmup, warmup + steps):
      t_ours.append(ours_step(i))
      t_torch.append(ref_step(i))
      loads.append(os.getloadavg()[0])
      print(f"[{name}] step {i - warmup + 1}/{steps}: ours {t_ours[-1]:.3f}s torch {t_torch[-1]:.3f}s "
            f"(load {loads[-1]:.1f})", flush=True)
  else:  # alternating blocks: one untimed step, then `block` timed ones, per side
    i = warmup
    while len(t_ours) < steps:
      n = min(block, steps - len(t_ours))
      for side, fn, times in (("ours", ours_step, t_ours), ("torch", ref_step, t_torch)):
        first = fn(i)
        times.extend(fn(i + 1 + j) for j in range(n))
        loads.append(os.getloadavg()[0])
        print(f"[{name}] {side}: untimed {first:.3f}s, timed " + " ".join(f"{t:.3f}s" for t in times[-n:])
              + f" (load {loads[-1]:.1f})", flush=True)
      i += n + 1
  tok = tokens_per_step(size)
  mo, mt = statistics.median(t_ours), statistics.median(t_torch)
  eff = f"{flops / mo / 1e9:.1f}" if flops else "n/a"
  row = (f"| {size.label} | {cfg.num_parameters() / 1e6:.1f}M | {size.batch} | {tok} | {threads} | {tok / mo:,.0f} "
         f"| {tok / mt:,.0f} | {mt / mo:.2f}x | {min(t_torch) / min(t_ours):.2f}x | {compile_s:.1f} | {eff} "
         f"| {min(loads):.1f}-{max(loads):.1f} |")
  print(row, flush=True)
  info = dict(ours=ours, ref=ref, batch=batch, key=keys[0], ratio=mt / mo)
  return row, info


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", default="sudoku,100m", help=f"comma-separated, of {sorted(SIZES)}")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
  parser.add_argument("--block", type=int, default=3,
                      help="timed steps per side per round, after one untimed step (0: interleave single steps)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side (the first is the parity check)")
  parser.add_argument("--smoke", action="store_true", help="micro config, 2 timed steps (for the tests)")
  parser.add_argument("--profile", action="store_true", help="also time encoder / whole loss / optimizer pieces")
  parser.add_argument("--profile_rounds", type=int, default=5)
  parser.add_argument("--check_tol", type=float, default=5e-3,
                      help="relative tolerance of the step-0 loss check (fp32 rounding: up to ~1e-3 at ~100M)")
  parser.add_argument("--check_tol_grad", type=float, default=1e-1,
                      help="relative tolerance of the step-0 gradient-norm check (fp32 rounding: up to ~2.4e-2 at "
                           "~100M; see `python scripts/float64_parity.py --step0=100m --batch=1`)")
  parser.add_argument("--cpus", default=None,
                      help="comma-separated CPU ids to pin the process to before torch and XLA start (e.g. 0: one "
                           "core, one thread each; default: no pinning, each library's default thread count)")
  parser.add_argument("--matmul_dtype", default="auto", choices=("auto", "bfloat16"),
                      help="our projections' products (ModelConfig.matmul_dtype): bfloat16 = bf16 operands, fp32 "
                           "accumulation (AMX); compare with --torch_autocast and a wider --check_tol")
  parser.add_argument("--torch_autocast", action="store_true",
                      help="torch's forward under torch.autocast('cpu', bfloat16)")
  parser.add_argument("--markdown", default=None, help="also write the table(s) to this file")
  args = parser.parse_args(argv)
  if args.cpus:
    from jax._src import xla_bridge  # private, but the only way to ask whether XLA has started

    if "torch" in sys.modules or xla_bridge.backends_are_initialized():
      parser.error("--cpus must be applied before torch is imported and before JAX starts (run as a script)")
    os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
  if args.smoke:
    args.sizes, args.steps, args.warmup = "micro", 2, 1
  sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
  for s in sizes:
    if s not in SIZES:
      parser.error(f"unknown size {s!r}; expected one of {sorted(SIZES)}")
  if args.steps < 1 or args.warmup < 1 or args.block < 0:
    parser.error("--steps and --warmup must be >= 1, --block >= 0")

  import torch

  print(f"{datetime.datetime.now().isoformat(timespec='seconds')}: jax {jax.__version__} "
        f"({jax.devices()[0].platform}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
  threads = f"{torch.get_num_threads()}" + (f" (cpus {args.cpus})" if args.cpus else "")
  schedule = f"blocks of {args.block}" if args.block else "interleaved"
  header = ("| size | params | batch | tokens/step | torch threads | ours tok/s | torch tok/s | ratio (median) "
            "| ratio (best) | our compile s | our GFLOP/s (XLA count) | load avg |")
  rows, prof_rows = [], []
  prof_header = ["| size | piece | ours ms | torch ms | torch/ours | our GFLOP/s (XLA count) | load avg |",
                 "|" + "---|" * 7]

  def tables() -> str:
    out = "\n".join([f"timed steps: {schedule}", "", header, "|" + "---|" * 12, *rows])
    if prof_rows:
      out += "\n\n" + "\n".join([*prof_header, *prof_rows])
    return out

  with tempfile.TemporaryDirectory() as workdir:
    for name in sizes:
      row, info = run_size(name, SIZES[name], args.steps, args.warmup, os.path.join(workdir, name), args.check_tol,
                           threads, args.block, args.check_tol_grad, args.matmul_dtype, args.torch_autocast)
      rows.append(row)
      if args.profile:
        new = profile_pieces(SIZES[name], info["ours"], info["ref"], info["batch"], info["key"], args.profile_rounds)
        print("\n".join(["", *prof_header, *new]), flush=True)
        prof_rows.extend(new)
      del info
      if args.markdown:  # rewritten after every size, so that a long run that dies keeps what it measured
        with open(args.markdown, "w", encoding="utf-8") as f:
          f.write(tables() + "\n")
  print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
  print("\n" + tables())
  return 0


if __name__ == "__main__":
  from hackable_diffusion import hugepages

  hugepages.reexec_with_malloc_hugepages()  # as the CLIs do (HD_MALLOC_HUGEPAGES=0: without)
  sys.exit(main())
