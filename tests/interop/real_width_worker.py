"""Worker for tests/interop/test_real_width.py: one stage per process (`python real_width_worker.py STAGE DIR`).

Stages: `reference` (transformers: fp32 model, its logits, a bf16 checkpoint, transformers' own bf16 logits), `fp32`
and `bf16` (ours). Each runs in a fresh process so that one ~5-10 GB model is alive at a time and its peak RSS is
its own; it prints one JSON line of measurements. A watchdog ends the process if its RSS passes `RW_MAX_RSS_GB`
(default 13) so that a memory regression cannot take the shared machine down.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import resource
import sys
import threading
import time

# XLA:CPU has no bf16 dot: it converts bf16 weights to f32 copies, and its default (concurrency-optimised) scheduler
# keeps the converted copies of several expert tensors alive at once (bf16 forward temp 9.6 GB -> 6.3 GB without it).
os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                           "--xla_cpu_enable_concurrency_optimized_scheduler=false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))  # scripts/: hf_reference

import numpy as np  # noqa: E402

from hf_reference import hf_config  # noqa: E402

SLIDE, FULL = "sliding_attention", "full_attention"
VOCAB = 262_144
# DiffusionGemma 26B-A4B widths (cf. `get_preset("diffusion_gemma_26b_a4b")`), two layers. The sliding window is
# smaller than the prompt (16) so that the sliding layer's mask actually differs from the full layer's.
TEXT = dict(vocab_size=VOCAB, hidden_size=2816, intermediate_size=2112, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2, sliding_window=8,
            num_experts=128, top_k_experts=8, moe_intermediate_size=704, initializer_range=0.02,
            layer_types=[SLIDE, FULL])
BATCH, PROMPT, CANVAS = 2, 16, 16
FP32_REL_TOL = 1e-4  # max |ours - reference| / max |reference logit|
# Our bf16 error may exceed transformers' own bf16 error by at most this factor. Two bf16 implementations round at
# different places (fusions, accumulation order, which ops are upcast), so their errors are equal only in
# distribution; 1.5x leaves room for that while any real mistake (a wrong weight, a dropped term) gives errors of the
# size of the logits themselves, 10-100x larger.
BF16_MARGIN = 1.5


def _truncate_to_bf16_(t) -> None:
  """In place: every fp32 value becomes exactly bf16-representable (the low 16 bits cleared)."""
  import torch

  if t.dtype == torch.float32:
    t.data.view(torch.int32).bitwise_and_(-65536)


def _materialize(model) -> None:
  """Replaces the meta tensors of `model` by empty CPU tensors, keeping tied parameters tied (`to_empty` does not:
  it would allocate the encoder's and decoder's copies of every tied weight separately, 2x the memory)."""
  import torch

  new: dict[int, torch.Tensor] = {}
  for module in model.modules():
    for table in (module._parameters, module._buffers):
      for key, t in list(table.items()):
        if t is None:
          continue
        if id(t) not in new:
          empty = torch.empty_like(t, device="cpu")
          new[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(
              t, torch.nn.Parameter) else empty
        table[key] = new[id(t)]


def _build_torch_model(seed: int = 0):
  """The reference model, fp32, seeded, with bf16-representable weights.

  Built on the meta device and materialised once: a plain constructor allocates the encoder and decoder copies of
  every (tied) weight before tying them, ~18 GB here. The large matrices get U(-a, a) values of std
  `initializer_range` (uniform: twice as fast as normal on 2.3B values); the rest comes from transformers'
  `_init_weights` (rotary tables, embedding scale, ...).
  """
  import torch
  from transformers import DiffusionGemmaForBlockDiffusion

  config = hf_config(TEXT, CANVAS)
  with torch.device("meta"):
    model = DiffusionGemmaForBlockDiffusion(config)
  _materialize(model)
  torch.manual_seed(seed)
  gen = torch.Generator().manual_seed(seed + 1)
  bound = TEXT["initializer_range"] * 3 ** 0.5
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.dim() >= 2 and p.numel() >= 1 << 20 and "vision" not in name:
        p.uniform_(-bound, bound, generator=gen)
        p._is_hf_initialized = True  # transformers' init skips it
    for name, b in model.named_buffers():
      if name.endswith("layer_scalar"):
        b.fill_(1.0)  # (the encoder copy is not covered by `_init_weights`)
    model.init_weights()
    for name, p in model.named_parameters():
      if "vision" in name:
        continue
      # norms, router scales and per-expert scales start at 1: perturb them so that a swapped or dropped one shows
      if "norm" in name or name.endswith("scale") or "per_expert_scale" in name:
        p.add_(0.3 * torch.randn(p.shape, generator=gen))
      _truncate_to_bf16_(p)
    for name, b in model.named_buffers():
      if name.endswith("layer_scalar"):
        b.copy_(0.5 + torch.rand(b.shape, generator=gen))
        _truncate_to_bf16_(b)
  enc, dec = model.model.encoder.language_model, model.model.decoder
  assert enc.layers[0].experts.gate_up_proj is dec.layers[0].experts.gate_up_proj
  assert model.lm_head.weight is enc.embed_tokens.weight
  for name, t in list(model.named_parameters()) + list(model.named_buffers()):
    assert all(torch.isfinite(c).all() for c in t.detach().reshape(-1).split(1 << 22)), name  # chunks: no 2 GB temps
  return model.eval()


def _inputs():
  rng = np.random.default_rng(13)
  ids = rng.integers(3, VOCAB - 3, size=(BATCH, PROMPT)).astype(np.int64)
  canvas = rng.integers(3, VOCAB - 3, size=(BATCH, CANVAS)).astype(np.int64)
  mask = np.ones((BATCH, PROMPT), np.int64)
  mask[1, :5] = 0  # a left-padded row
  ids[mask == 0] = 0
  sc = (3 * rng.standard_normal((BATCH, CANVAS, VOCAB))).astype(np.float32)
  sc_mask = np.array([True, False])  # row 1: no self-conditioning
  return ids, canvas, mask, sc, sc_mask


def _torch_logits(model, ids, canvas, mask, sc, sc_mask) -> np.ndarray:
  import torch

  dec_mask = np.concatenate([mask, np.ones((mask.shape[0], canvas.shape[1]), mask.dtype)], 1)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas),
                attention_mask=torch.tensor(mask), decoder_attention_mask=torch.tensor(dec_mask),
                self_conditioning_logits=torch.tensor(sc).to(model.dtype),
                self_conditioning_mask=torch.tensor(sc_mask)).logits
  return out.float().numpy()


def _max_abs(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _rms(a, b) -> float:
  return float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))



def _rss_gb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def _watchdog(limit_gb: float) -> None:
  def run():
    while True:
      if _rss_gb() > limit_gb:
        print(json.dumps({"error": f"RSS above {limit_gb} GB; aborted"}), flush=True)
        os._exit(3)
      time.sleep(0.05)
  threading.Thread(target=run, daemon=True).start()


def _save(directory: str, name: str, array: np.ndarray) -> None:
  np.save(os.path.join(directory, name), array)


def stage_reference(directory: str) -> dict:
  import torch
  from transformers import DiffusionGemmaForBlockDiffusion

  path = os.path.join(directory, "checkpoint")
  inputs = _inputs()
  model = _build_torch_model()
  ref32 = _torch_logits(model, *inputs)
  # to bf16 one tensor at a time, the embedding last (its bf16 copy would otherwise sit next to all fp32 weights)
  with torch.no_grad():
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if t.dtype == torch.float32]
    tensors.sort(key=lambda t: t is model.lm_head.weight)
    for t in tensors:
      t.data = t.data.to(torch.bfloat16)  # exact: every weight is bf16-representable
  model.config.dtype = torch.bfloat16
  model.save_pretrained(path)
  del model, tensors
  gc.collect()
  model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.bfloat16).eval()
  assert model.model.decoder.layers[0].experts.gate_up_proj.dtype == torch.bfloat16
  ref16 = _torch_logits(model, *inputs)
  _save(directory, "ref32.npy", ref32)
  _save(directory, "ref16.npy", ref16)
  return {"max_abs_logit": float(np.abs(ref32).max()), "logit_std": float(ref32.std()),
          "hf_bf16_max": _max_abs(ref16, ref32), "hf_bf16_rms": _rms(ref16, ref32)}


def _jit_logits(model):
  """`model(...)` compiled with `jax.jit` over the split state (`nnx.jit`, as in `transformer.forward`, returns the
  model state as outputs: a second full copy of the weights per call)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, ids, canvas, mask, sc, sc_mask):
    return nnx.merge(graphdef, state)(ids, canvas, mask, sc, sc_mask).astype(jnp.float32)

  def logits(ids, canvas, mask, sc, sc_mask):
    out = run(nnx.state(model), jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32),
              jnp.asarray(mask, bool), jnp.asarray(sc, model.dtype), jnp.asarray(sc_mask))
    return np.asarray(out)

  del state
  return logits


def stage_fp32(directory: str) -> dict:
  import jax.numpy as jnp

  import hackable_diffusion as hd

  ref32 = np.load(os.path.join(directory, "ref32.npy"))
  inputs = _inputs()
  t0 = time.time()
  # `load_pretrained(dtype=float32)` of this bf16 checkpoint peaks at 14.6 GB (its per-tensor bf16 -> f32 cast holds
  # ~5x the stored tensor at once), over this machine's budget. So: load with bf16 storage and f32 compute, then
  # upcast the parameters one at a time, largest first (peak: the f32 model + the smallest bf16 tensor). The weights
  # are the same values either way (bf16 -> f32 is exact); names, layouts and transposes go through the loader.
  from flax import nnx

  model = hd.load_pretrained(os.path.join(directory, "checkpoint"), dtype=jnp.bfloat16, compute_dtype=jnp.float32,
                             remat="nothing_saveable")  # remat: used by the LoRA step below
  graphdef, state = nnx.split(model)
  del model
  variables = sorted((v for _, v in nnx.to_flat_state(state)), key=lambda v: -v.value.size)
  for var in variables:
    if var.value.dtype == jnp.bfloat16:
      var.value = var.value.astype(jnp.float32)
  del variables
  model = nnx.merge(graphdef, state)
  del state
  out = {"load_s": time.time() - t0, "load_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
  assert model.embed_tokens[...].dtype == jnp.float32
  assert (model.config.global_head_dim, model.config.global_kv_heads, model.config.num_experts) == (512, 2, 128)
  logits = _jit_logits(model)
  ours = logits(*inputs)
  out.update(err=_max_abs(ours, ref32), scale=float(np.abs(ref32).max()), finite=bool(np.isfinite(ours).all()))
  # sensitivity: what a loader mistake would break moves the logits by far more than the tolerance
  layer = model.layers[0]
  router = layer.router.proj.kernel[...]
  layer.router.proj.kernel.value = jnp.roll(router, 1, axis=1)  # tokens routed to the wrong experts
  out["err_router_rolled"] = _max_abs(logits(*inputs), ref32)
  layer.router.proj.kernel.value = router
  gate, up = layer.mlp.gate_proj.kernel[...], layer.mlp.up_proj.kernel[...]
  layer.mlp.gate_proj.kernel.value, layer.mlp.up_proj.kernel.value = up, gate  # gate and up swapped
  out["err_gate_up_swapped"] = _max_abs(logits(*inputs), ref32)
  layer.mlp.gate_proj.kernel.value, layer.mlp.up_proj.kernel.value = gate, up
  del logits
  # The LoRA step runs on this fp32 model: XLA:CPU computes bf16 matmuls on f32 copies of their weights (the 262k x
  # 2816 head alone: 2.95 GB per use), so a bf16 step needs ~3x the model here (not on a GPU); fp32 has no copies.
  _lora_step(model, out)
  return out


def _hash_leaves(state) -> dict[str, str]:
  from flax import nnx

  return {"/".join(map(str, k)): hashlib.blake2b(np.asarray(v.value).view(np.uint8).data, digest_size=16).hexdigest()
          for k, v in nnx.to_flat_state(state)}


def stage_bf16(directory: str) -> dict:
  import jax.numpy as jnp

  import hackable_diffusion as hd

  ref32 = np.load(os.path.join(directory, "ref32.npy"))
  ref16 = np.load(os.path.join(directory, "ref16.npy"))
  inputs = _inputs()
  model = hd.load_pretrained(os.path.join(directory, "checkpoint"), dtype=jnp.bfloat16)
  assert model.embed_tokens[...].dtype == jnp.bfloat16 and model.layers[0].experts.gate_up_proj[...].dtype == jnp.bfloat16
  ours = _jit_logits(model)(*inputs)
  out = {"finite": bool(np.isfinite(ours).all()), "ours_max": _max_abs(ours, ref32), "ours_rms": _rms(ours, ref32),
         "ours_vs_hf_bf16_max": _max_abs(ours, ref16), "forward_peak_rss_gb":
         resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
  return out


def _lora_step(model, out: dict) -> None:
  """One LoRA train step (default targets: attention q/k/v/o and the dense MLP; fp32 adapters) with the full
  objective (self-conditioning, encoder next-token term), per-layer remat and the vocabulary-tiled loss."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from hackable_diffusion.data.sft import SFTBatch
  from hackable_diffusion.diffusion.loss import LossConfig
  from hackable_diffusion.lora import LoraConfig, apply_lora
  from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer
  from hackable_diffusion.training.step import init_train_state, make_train_step

  lora_model = apply_lora(model, LoraConfig(rank=8, alpha=16), rngs=nnx.Rngs(0))
  del model
  tx, _ = make_optimizer(OptimizerConfig(peak_lr=1e-3, warmup_steps=0, decay_steps=10))
  graphdef, state = init_train_state(lora_model, tx, trainable=nnx.LoRAParam)
  del lora_model
  flat = list(nnx.to_flat_state(state.params))
  out["adapters_are_lora_params"] = all(isinstance(v, nnx.LoRAParam) for _, v in flat)
  out["adapter_modules"] = sorted({"/".join(map(str, k[:-1])) for k, _ in flat})
  before = {k: np.asarray(v.value).copy() for k, v in flat}
  rest_before = _hash_leaves(state.rest)  # the frozen base (hashes: a copy of 4.8 GB would not fit)
  rng = np.random.default_rng(7)
  width = 2 * CANVAS
  batch = SFTBatch(prompt_ids=jnp.asarray(rng.integers(3, VOCAB - 3, (BATCH, PROMPT)), jnp.int32),
                   prompt_mask=jnp.ones((BATCH, PROMPT), bool),
                   completion_ids=jnp.asarray(rng.integers(3, VOCAB - 3, (BATCH, width)), jnp.int32),
                   completion_mask=jnp.asarray(np.arange(width)[None] < np.array([[width], [width - 5]]), bool))
  # the full objective; 1 MiB logits tiles: the tiled head runs at this short canvas too (one position a tile)
  loss_config = LossConfig(self_conditioning_prob=1.0, encoder_ar_weight=1.0, logits_tile_mib=1.0)
  step = make_train_step(graphdef, tx, loss_config)  # donates the state: no second copy of the base
  state, metrics = step(state, batch, jax.random.key(0))
  after = {k: np.asarray(v.value) for k, v in nnx.to_flat_state(state.params)}
  b_keys = [k for k in before if str(k[-1]) == "lora_b"]
  out.update(loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]), step_finite=bool(metrics["finite"]),
             step=int(state.step), lora_b_count=len(b_keys),
             lora_b_changed=sum(not np.array_equal(after[k], before[k]) for k in b_keys),
             lora_b_were_zero=all(not before[k].any() for k in b_keys),
             base_unchanged=_hash_leaves(state.rest) == rest_before)


STAGES = {"reference": stage_reference, "fp32": stage_fp32, "bf16": stage_bf16}


def main() -> None:
  stage, directory = sys.argv[1], sys.argv[2]
  _watchdog(float(os.environ.get("RW_MAX_RSS_GB", "13")))
  t0 = time.time()
  out = STAGES[stage](directory)
  out.update(stage=stage, seconds=round(time.time() - t0, 1),
             peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
