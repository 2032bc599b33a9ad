"""Compiled memory of the DiffusionGemma 26B-A4B train and sampler steps, per device, on this CPU (nothing allocated).

Every case is `jax.jit(step).lower(<abstract shapes>).compile().memory_analysis()`: XLA's own buffer assignment for
the real shapes (25.25B parameters, vocab 262,144, 128 experts top-8), with fake CPU devices for the mesh case.

    python scripts/memory_report.py                  # all cases, as the 26B recipe runs (30 scanned layers)
    python scripts/memory_report.py --cases=a,c      # a subset; --validate: the CPU-convert check alone
    python scripts/memory_report.py --unrolled       # the layers unrolled: 6 + 12 compiled, extrapolated to 30
    python scripts/memory_report.py --smoke --cases=c   # the same steps on a tiny 30-layer model (CI)

Cases (prompt 256 + canvas 256, LoRA r8 on all linear layers as configs/diffusiongemma_26b_lora.py):
  a  LoRA, one device, batch 8 (in one pass, and as 4 micro-batches of 2: the recipe), remat 'nothing_saveable',
     vocabulary-tiled loss
  b  full fine-tuning, fp32 master weights + fp32 Adam moments, 8 devices (fsdp=8), batch 8 per device
  b16 case b compiled in bf16 as it runs (the fp32 master in the state, the step's casts): a cross-check of b
  c  one sampler step (decode with the self-conditioning input, sample/argmax/entropy/softmax in two passes, accept,
     renoise, the next self-conditioning input), batch 8 and 64
  d  case a at batch 1 with remat off and the loss untiled, then with each turned on: what each saves (tiles of 32
     positions, 32 MiB at batch 1, as the recipe's 256 MiB gives at batch 8)
  q8 QLoRA: case a with the base in FP8 (`lora.base_quantization='fp8'`: float8 values, one fp32 scale per output
     channel), batch 8 as 4 micro-batches of 2 (target: a 48 GB card, <= 44 GiB); q8p: the same in one pass
  q4 QLoRA: case a with the base in int4 (blocks of 64 inputs, one bf16 scale each), batch 4 as 2 micro-batches of
     2 (target: a 24 GB card, <= 22 GiB); q4p: the same in one pass
  qn QLoRA: case q4 with the base in NVFP4 (FP4 values, one float8 scale per 16 inputs, a 1 KiB scale table per
     tensor: what an NVFP4 checkpoint keeps with `lora.base_quantization='nvfp4'`)
  i  case a (4 micro-batches of 2) with one image per example at the image processor's default size (2,520
     patches, 280 soft tokens + begin/end: the prompt grows by 282 tokens) through transformers' default Gemma 4
     vision tower (768 wide, 16 layers), frozen as `train.train_vision='none'` keeps it

How the CPU's bf16 converts are kept out (see --validate): XLA:CPU computes every bf16 dot in f32 and keeps f32
copies of bf16 weights as temporaries (a bf16 [4096, 4096] weight in `x @ w` compiles to a 64 MiB temporary; a GPU
or TPU has none). So each case is compiled with fp32 parameters and fp32 compute - no converts exist - and
reported as: arguments with every parameter at its bf16 size (LoRA adapters, master weights and Adam moments stay
fp32), temporaries as compiled in fp32. Every activation is then twice its bf16 size, so the temporaries are an
upper bound on what bf16 compute needs (fp32 parts - softmax, norms, router, logits, loss - are fp32 either way).
Case b adds the bf16 compute copy of the (sharded) parameters that the master-weights step makes (with scanned
layers, the other parameters and one period of layers: the step casts each layer inside the scan). The QLoRA cases
keep the quantized values and scales as they are (fp8 / int4 / bf16 scales in the compile too; fp32 FP8 scales) and
count the rest of the frozen base (embedding, norms, router) at bf16; their dequantized weights are fp32 temporaries,
twice a GPU's bf16 ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

# 8 fake devices for the mesh case; XLA:CPU's memory-minimising scheduler (its default one favours running thunks
# concurrently and keeps far more alive: at the real width, batch 8, 4 layers, 17.2 -> 7.3 GiB of temporaries; an
# accelerator's scheduler works under a memory limit, so this is the closer model)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_cpu_enable_concurrency_optimized_scheduler=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hackable_diffusion.data.sft import SFTBatch  # noqa: E402
from hackable_diffusion.diffusion.loss import LossConfig  # noqa: E402
from hackable_diffusion.lora.adapters import ALL_LINEAR, LoraConfig, apply_lora  # noqa: E402
from hackable_diffusion.lora.qlora import QuantizedBase  # noqa: E402
from hackable_diffusion.model import scan  # noqa: E402
from hackable_diffusion.model.config import get_preset  # noqa: E402
from hackable_diffusion.model.transformer import DiffusionGemma  # noqa: E402
from hackable_diffusion.model.vision_config import VisionConfig  # noqa: E402
from hackable_diffusion.sampling import entropy_bound as eb  # noqa: E402
from hackable_diffusion.sampling.denoise import self_conditioning_embeddings  # noqa: E402
from hackable_diffusion.sharding.mesh import MeshConfig, make_mesh  # noqa: E402
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer  # noqa: E402
from hackable_diffusion.training.step import (abstract_train_state, make_train_step, master_params,  # noqa: E402
                                              train_state_shardings)

GIB = 2**30
UNIT = (GIB, "GiB")  # (bytes, name) of the printed numbers; --smoke prints MiB
PRESET = "diffusion_gemma_26b_a4b"
PROMPT, CANVAS = 256, 256
SMOKE = False  # --smoke: the same cases on a 30-layer model of hidden 32 (tests/test_benchmark_scripts.py)
CASES = ("a", "b", "b2", "b16", "c", "d", "q8", "q4", "q8p", "q4p", "qn", "i")
IMAGE_PATCHES, IMAGE_TOKENS = 2520, 280 + 2  # one image at the processor's default budget, with begin/end tokens
LORA = LoraConfig(rank=8, alpha=16.0, target_modules=ALL_LINEAR)
KEY = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)


SCAN = True  # the layers stacked and run under one scan (ModelConfig.scan_layers); --unrolled: False
LAYERS: int | None = None  # compile this many layers (whole 5 sliding : 1 full groups) instead of all 30


def model_config(remat: str = "nothing_saveable", dtype: str = "float32", vision: bool = False):
  cfg = get_preset(PRESET, moe_impl="tiled", remat=remat, dtype=dtype, param_dtype=dtype)
  if SMOKE:
    cfg = get_preset("tiny", moe_impl="tiled", remat=remat, dtype=dtype, param_dtype=dtype, vocab_size=512,
                     num_hidden_layers=30, layer_types=None, canvas_length=CANVAS)
  if vision:  # image token ids: any three ids of the vocabulary (they do not change the memory)
    tower = VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=16) if SMOKE else VisionConfig()
    v = cfg.vocab_size
    cfg = cfg.replace(vision=tower, image_token_id=v - 1, boi_token_id=v - 2, eoi_token_id=v - 3)
  if LAYERS is not None:
    cfg = cfg.replace(num_hidden_layers=LAYERS, layer_types=cfg.layer_types[:LAYERS])
  return cfg.replace(scan_layers=SCAN)


def abstract_model(cfg, lora: bool, quantization: str = "none"):
  config = dataclasses.replace(LORA, base_quantization=quantization, base_block_size=16 if SMOKE else 64)

  def build():
    model = DiffusionGemma(cfg, rngs=nnx.Rngs(0))
    model = apply_lora(model, config, rngs=nnx.Rngs(1)) if lora else model
    return scan.stack_layers(model) if cfg.scan_layers else model  # what a run does (runs/run.py)
  return nnx.eval_shape(build)


def batch_shapes(b: int, vision: VisionConfig | None = None) -> SFTBatch:
  """Abstract SFT batch; with `vision`, one image per example and its tokens added to the prompt."""
  prompt = PROMPT + (IMAGE_TOKENS if vision is not None else 0)
  images = {}
  if vision is not None:
    patches = IMAGE_PATCHES if not SMOKE else 36  # smoke: 6 x 6 patches
    images = dict(pixel_values=jax.ShapeDtypeStruct((b, 1, patches, vision.patch_dim), jnp.float32),
                  image_position_ids=jax.ShapeDtypeStruct((b, 1, patches, 2), jnp.int32))
  return SFTBatch(prompt_ids=jax.ShapeDtypeStruct((b, prompt), jnp.int32),
                  prompt_mask=jax.ShapeDtypeStruct((b, prompt), bool),
                  completion_ids=jax.ShapeDtypeStruct((b, CANVAS), jnp.int32),
                  completion_mask=jax.ShapeDtypeStruct((b, CANVAS), bool), **images)


def nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def analysis(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  return dict(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes,
              temporaries=m.temp_size_in_bytes)


def row(name: str, arguments: float, temporaries: float, extra: float = 0.0, note: str = "", **more) -> dict:
  return dict(name=name, arguments=arguments, temporaries=temporaries, extra=extra, note=note, **more)


def print_row(r: dict) -> None:
  total = r["arguments"] + r["temporaries"] + r["extra"]
  if "logits" in r:
    r = dict(r, note=f"temporaries = {r['temporaries'] / r['logits']:.2f} fp32 [B, C, V] logits buffers; {r['note']}")
  unit = UNIT[0]
  print(f"| {r['name']} | {r['arguments'] / unit:.1f} | {r['temporaries'] / unit:.1f} | {r['extra'] / unit:.1f} | "
        f"**{total / unit:.1f}** | {r['note']} |", flush=True)


def measure(case, *args, full: bool) -> list[dict]:
  """The case's rows for the 30-layer model: compiled whole (`full`), or compiled at 6 and 12 layers (one and two
  5:1 groups) and extrapolated linearly to 30 (exact for the arguments, whose per-group bytes are equal; for the
  temporaries see docs/scaling.md, where a whole 30-layer compile checks it)."""
  global LAYERS
  if full:
    LAYERS = None
    return case(*args)
  LAYERS = 6
  six = case(*args)
  LAYERS = 12
  twelve = case(*args)
  LAYERS = None
  out = []
  for a, b in zip(six, twelve):
    grow = lambda k, a=a, b=b: b[k] + (b[k] - a[k]) * 3  # noqa: E731 - 12 -> 30 layers: three more 6-layer steps
    more = {"logits": b["logits"]} if "logits" in b else {}
    out.append(row(b["name"], grow("arguments"), grow("temporaries"), grow("extra"),
                   b["note"].replace("compiled in", "12 layers compiled in") + "; from 6 + 12 layers", **more))
  return out


# ---- training ----------------------------------------------------------------------------------------------------
def lora_step(batch: int, *, remat: str, tile_mib: float, dtype: str = "float32", accum: int = 1,
              quantization: str = "none", vision: bool = False) -> tuple[dict, dict]:
  """Compiled LoRA train step on one device (`accum` micro-batches; `quantization`: QLoRA's base; `vision`: one
  image per example) -> (XLA analysis, {'frozen': bytes of the dense frozen base in this compile, 'quantized': of
  the quantized base, ...})."""
  cfg = model_config(remat, dtype, vision)
  graphdef, params, rest = nnx.split(abstract_model(cfg, lora=True, quantization=quantization), nnx.LoRAParam, ...)
  quantized = nnx.state(nnx.merge(graphdef, params, rest), QuantizedBase)
  tx, _ = make_optimizer(OptimizerConfig())
  state = abstract_train_state(params, rest, tx)
  step = make_train_step(graphdef, tx, LossConfig(logits_tile_mib=tile_mib), jit=False, grad_accum_steps=accum)
  compiled = jax.jit(step, donate_argnums=0).lower(state, batch_shapes(batch, cfg.vision), KEY).compile()
  packed = sum(int(np.prod(x.shape)) * (0.5 if jnp.dtype(x.dtype) == jnp.dtype(jnp.int4) else
                                        jnp.dtype(x.dtype).itemsize) for x in jax.tree.leaves(quantized))
  return analysis(compiled), dict(frozen=nbytes(rest) - nbytes(quantized), quantized=int(packed),
                                  trainable=nbytes(params), opt=nbytes(state.opt_state))


def case_a(batch: int = 8) -> list[dict]:
  rows = []
  for accum in (1, 4):
    t = time.time()
    a, sizes = lora_step(batch, remat="nothing_saveable", tile_mib=256.0, accum=accum)
    # arguments: the frozen base at bf16 (it is fp32 in this compile), adapters + Adam state as compiled (fp32)
    args = a["arguments"] - sizes["frozen"] // 2
    how = "one pass" if accum == 1 else f"{accum} micro-batches of {batch // accum} (train.grad_accum_steps={accum})"
    rows.append(row(f"a: LoRA r8, 1 device, batch {batch}, {how}", args, a["temporaries"],
                    note=f"compiled in {time.time() - t:.0f} s"))
  return rows


def case_i(batch: int = 8, accum: int = 4) -> list[dict]:
  """Case a's recipe with one image per example through the (frozen) vision tower."""
  t = time.time()
  a, sizes = lora_step(batch, remat="nothing_saveable", tile_mib=256.0, accum=accum, vision=True)
  args = a["arguments"] - sizes["frozen"] // 2  # the frozen base, vision tower included, at bf16
  return [row(f"i: LoRA r8, 1 device, batch {batch} as {accum} micro-batches of {batch // accum}, one image each "
              f"(prompt {PROMPT} + {IMAGE_TOKENS})", args, a["temporaries"],
              note=f"compiled in {time.time() - t:.0f} s")]


def case_q(mode: str, batch: int, accum: int) -> list[dict]:
  """QLoRA (`lora.base_quantization=mode`) at `batch` as `accum` micro-batches (1: one pass)."""
  t = time.time()
  a, sizes = lora_step(batch, remat="nothing_saveable", tile_mib=256.0, accum=accum, quantization=mode)
  # arguments: the dense frozen part (embedding, norms, router) at bf16, the quantized base and adapters as compiled
  args = a["arguments"] - sizes["frozen"] // 2
  how = "one pass" if accum == 1 else f"{accum} micro-batches of {batch // accum} (train.grad_accum_steps={accum})"
  name = {"fp8": "q8", "int4": "q4", "nvfp4": "qn"}[mode]
  return [row(f"{name}: QLoRA r8, {mode} base, 1 device, batch {batch}, {how}", args,
              a["temporaries"], note=f"quantized base {sizes['quantized'] / UNIT[0]:.1f} {UNIT[1]} of the "
              f"{LAYERS or 'all'}-layer compile's arguments; compiled in {time.time() - t:.0f} s")]


def _case_b_state(cfg, devices: int, master: bool):
  """(graphdef, params as the model stores them, state, shardings, mesh, tx) of case b; `master`: the state's
  params are an fp32 master copy of `params` (what `optimizer.master_weights` keeps)."""
  graphdef, params, rest = nnx.split(abstract_model(cfg, lora=False), nnx.Param, ...)
  state_params = master_params(params) if master else params
  tx, _ = make_optimizer(OptimizerConfig())
  mesh = make_mesh(MeshConfig(fsdp=devices))
  shardings = train_state_shardings(mesh, state_params, rest, tx)
  state = abstract_train_state(state_params, rest, tx)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
  return graphdef, params, state, shardings, mesh, tx


def compute_copy_bytes(params, devices: int) -> int:
  """Bytes per device of the bf16 compute copy that a master-weights step makes of `params` (sharded like them):
  scanned layers (remat 'nothing_saveable') are cast one layer at a time inside the scan
  (`training.step.compute_model`), so only the other parameters plus one period of layers exist in bf16 at once;
  unrolled, all of them."""
  if not SCAN:
    return nbytes(params) // 2 // devices
  layers = nbytes(params["layers"])
  groups = jax.tree.leaves(params["layers"])[0].shape[0]  # stacked: [groups, ...]
  return (nbytes(params) - layers + layers // groups) // 2 // devices


def case_b(per_device_batch: int = 8, devices: int = 8, accums: tuple[int, ...] = (1, 4)) -> list[dict]:
  cfg = model_config("nothing_saveable")
  graphdef, params, state, shardings, mesh, tx = _case_b_state(cfg, devices, master=False)
  rows = []
  for accum in accums:
    t = time.time()
    step = make_train_step(graphdef, tx, LossConfig(), jit=False, mesh=mesh, shardings=shardings,
                           grad_accum_steps=accum)
    batch = batch_shapes(per_device_batch * devices)
    a = analysis(jax.jit(step, donate_argnums=0).lower(state, batch, KEY).compile())
    # fp32 params = the master; moments fp32: the arguments are what the master-weights state holds. The step's
    # bf16 compute copy of the parameters (sharded like them) is added.
    how = "one pass" if accum == 1 else f"{accum} micro-batches"
    rows.append(row(f"b: full FT, fp32 master + Adam, fsdp={devices}, batch {per_device_batch}/device, {how}",
                    a["arguments"], a["temporaries"], compute_copy_bytes(params, devices),
                    note=f"per device, + the bf16 compute copy of the params; compiled in {time.time() - t:.0f} s"))
  return rows


def case_b16(per_device_batch: int = 8, devices: int = 8) -> list[dict]:
  """Case b compiled as it runs: a bf16 model, the fp32 master in the state, the step casting it
  (`param_dtypes`). The temporaries include XLA:CPU's f32 copies of bf16 dot operands (none on a GPU): an upper
  bound from the other side, with activations at their bf16 size."""
  cfg = model_config("nothing_saveable", dtype="bfloat16")
  graphdef, params, state, shardings, mesh, tx = _case_b_state(cfg, devices, master=True)
  t = time.time()
  step = make_train_step(graphdef, tx, LossConfig(), jit=False, mesh=mesh, shardings=shardings, param_dtypes=params)
  a = analysis(jax.jit(step, donate_argnums=0).lower(state, batch_shapes(per_device_batch * devices), KEY).compile())
  return [row(f"b16: case b compiled in bf16 (fp32 master, the step's own casts), batch {per_device_batch}/device",
              a["arguments"], a["temporaries"],
              note=f"per device; temporaries include CPU-only f32 copies of bf16 dot operands; compiled in "
                   f"{time.time() - t:.0f} s")]


# ---- sampling ----------------------------------------------------------------------------------------------------
def sampler_step(batch: int, dtype: str = "float32") -> tuple[dict, int]:
  """One denoising step as `sampling.denoise` runs it (decode with the self-conditioning embeddings -> logits ->
  sample/argmax/entropy/softmax weights in two passes -> accept -> renoise -> the next self-conditioning input),
  compiled on one device -> (analysis, parameter bytes)."""
  cfg = model_config("none", dtype)
  graphdef, state = nnx.split(abstract_model(cfg, lora=False))
  cache = jax.eval_shape(lambda: nnx.merge(graphdef, state).init_cache(batch, PROMPT))
  v = cfg.vocab_size

  def step(state, cache, canvas, sc_embeddings, key):
    model = nnx.merge(graphdef, state)
    hidden = model.decode_hidden(canvas, cache, sc_embeddings, jnp.ones((batch,), bool))
    logits = model.lm_logits(hidden)  # [B, C, V] float32
    temp = jnp.float32(0.5)
    k1, k2 = jax.random.split(key)
    stats = eb.step_statistics(k1, logits, temp, weights_dtype=model.embed_tokens[...].dtype)
    accept = eb.accept_entropy_bound(stats.entropy, 0.1)
    soft = self_conditioning_embeddings(model.embed_tokens[...], model.dtype, stats.weights, stats.total)
    return eb.renoise(k2, stats.samples, accept, v), stats.argmax, soft

  args = (state, cache, jax.ShapeDtypeStruct((batch, CANVAS), jnp.int32),
          jax.ShapeDtypeStruct((batch, CANVAS, cfg.hidden_size), jnp.float32), KEY)
  compiled = jax.jit(step, donate_argnums=3).lower(*args).compile()
  return analysis(compiled), nbytes(state)


def case_c(batch: int) -> dict:
  t = time.time()
  a, params = sampler_step(batch)
  logits = batch * CANVAS * model_config().vocab_size * 4
  args = a["arguments"] - params // 2  # weights at bf16
  return [row(f"c: sampler step, batch {batch}", args, a["temporaries"], logits=logits,
              note=f"compiled in {time.time() - t:.0f} s")]


def case_d() -> list[dict]:
  rows = []
  # at batch 1 the recipe's 256 MiB covers the whole canvas (one tile); 32 MiB gives the recipe's batch-8 tiles
  for remat, tile, label in (("none", 0.0, "remat off, loss untiled"), ("none", 32.0, "remat off, loss tiled"),
                             ("nothing_saveable", 0.0, "remat on, loss untiled"),
                             ("nothing_saveable", 32.0, "remat on, loss tiled")):
    t = time.time()
    a, sizes = lora_step(1, remat=remat, tile_mib=tile)
    rows.append(row(f"d: LoRA r8, 1 device, batch 1, {label}", a["arguments"] - sizes["frozen"] // 2,
                    a["temporaries"], note=f"compiled in {time.time() - t:.0f} s"))
  return rows


# ---- the CPU-convert check ---------------------------------------------------------------------------------------
def validate() -> None:
  """A case where the GPU number is known exactly: `x @ w` with bf16 x [4096, 4096], w [4096, 4096]. A GPU needs no
  temporary (the product is the output); XLA:CPU's bf16 compile reports the f32 copies; the fp32 compile used by
  this report reports none."""
  for dtype in ("bfloat16", "float32"):
    s = jax.ShapeDtypeStruct((4096, 4096), jnp.dtype(dtype))
    a = analysis(jax.jit(lambda x, w: x @ w).lower(s, s).compile())
    print(f"| x @ w, {dtype} | temporaries {a['temporaries'] / 2**20:.0f} MiB | (a GPU: 0 MiB) |", flush=True)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--cases", default=",".join(CASES),
                      help="comma-separated subset of a,b,b2 (case b at batch 2 per device),"
                           "b16 (case b compiled in bf16),c,d,q8,q4,q8p,q4p,qn,i (case a with an image per example)")
  parser.add_argument("--smoke", action="store_true", help="every step of the report on a tiny 30-layer model")
  parser.add_argument("--validate", action="store_true", help="only the CPU-convert check")
  parser.add_argument("--unrolled", action="store_true",
                      help="the layers unrolled instead of scanned (the recipe scans them); compiled at 6 + 12 layers "
                           "and extrapolated to 30 unless --full")
  parser.add_argument("--full", action="store_true",
                      help="with --unrolled: compile all 30 layers (slow) instead of 6 + 12 extrapolated")
  parser.add_argument("--scan", action="store_true", help="the default (kept for older command lines)")
  args = parser.parse_args(argv)
  if args.unrolled and args.scan:
    parser.error("--scan and --unrolled contradict each other")
  global SCAN
  SCAN = not args.unrolled
  cases = set(args.cases.split(","))
  if cases - set(CASES):
    parser.error(f"--cases: unknown case(s) {sorted(cases - set(CASES))}; expected a subset of {','.join(CASES)}")
  if args.smoke:
    global SMOKE, PROMPT, CANVAS, UNIT
    SMOKE, PROMPT, CANVAS, UNIT = True, 16, 16, (2**20, "MiB")
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices", flush=True)
  print("\n| check | compiled | known |\n|---|---|---|")
  validate()
  if args.validate:
    return
  u = UNIT[1]
  print(f"\n| case | arguments {u} | temporaries {u} | added {u} | total {u} | note |\n|---|---|---|---|---|---|")
  runs = [("a", case_a, ()), ("b", case_b, ()), ("b2", case_b, (2, 8, (1,))),
          ("b16", case_b16, ()), ("c", case_c, (8,)), ("c", case_c, (64,)),
          ("d", case_d, ()), ("q8", case_q, ("fp8", 8, 4)), ("q4", case_q, ("int4", 4, 2)),
          ("q8p", case_q, ("fp8", 8, 1)), ("q4p", case_q, ("int4", 4, 1)), ("qn", case_q, ("nvfp4", 4, 2)),
          ("i", case_i, ())]
  for name, case, case_args in runs:
    if name in cases:
      # scanned, a 30-layer compile costs what a 6-layer one does: always whole
      for r in measure(case, *case_args, full=args.full or SCAN):
        print_row(r)


if __name__ == "__main__":
  main(sys.argv[1:])
