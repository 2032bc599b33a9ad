"""Writing HF DiffusionGemma checkpoints: `save_pretrained`, a directory transformers' `from_pretrained` loads.

Owns the written layout: `config.json` (our config as transformers' `text_config`, optionally with a
compressed-tensors FP8 / NVFP4 `quantization_config`, `interop.quantized_export`), every tensor name transformers
expects (`interop.names`; kernels transposed to torch's `[out, in]`), a vision tower (a tiny stub, or copied from a
source checkpoint) so that `from_pretrained` reports no missing or unexpected keys, and sharding into
`model-0000N-of-0000M.safetensors` with an index above `max_shard_size`, each file written atomically (temporary
file + rename).

Writing streams: the names, shapes and dtypes of every stored tensor are worked out first from the model's shapes
alone (`checkpoint_specs`), then the model is merged, cast and quantized a part at a time
(`lora.merge.merged_parts`) and each tensor written at its place in its file (`safetensors_io.ShardedWriter`).
Peak memory is the model as it is plus one merged tensor on the host (one layer on a device, or for NVFP4, whose
fused matrices share a scale); no merged copy of the model and no shard is ever held whole. Extra tensors (`extra_tensors`, e.g. a vision tower) are appended after the text model.
`save_merged` folds LoRA adapters (and a QLoRA base) in as it writes; `save_pretrained` refuses them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hackable_diffusion.errors import CheckpointError
from hackable_diffusion.files import makedirs_no_link, read_json, write_json
from hackable_diffusion.interop import quantized_export
from hackable_diffusion.interop.names import hf_name, is_vision, iter_variables
from hackable_diffusion.interop.safetensors_io import ShardedWriter, TensorSpec, iter_tensors, spec_of
from hackable_diffusion.lora.adapters import has_lora
from hackable_diffusion.lora.merge import VariablePath, merge, merged_parts
from hackable_diffusion.lora.qlora import base_quantization
from hackable_diffusion.model.config import TINY_VISION_CONFIG
from hackable_diffusion.model.transformer import DiffusionGemma

_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _vision_stub(hidden: int, vision: dict[str, Any]) -> dict[str, np.ndarray]:
  """Minimal vision tower weights for `TINY_VISION_CONFIG` (transformers always builds one)."""
  vh, inter, hd = vision["hidden_size"], vision["intermediate_size"], vision["head_dim"]
  heads, kv, patch = vision["num_attention_heads"], vision["num_key_value_heads"], vision["patch_size"]
  rng = np.random.default_rng(0)
  normal = lambda *s: (0.02 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
  ones = lambda *s: np.ones(s, np.float32)  # noqa: E731
  out = {
      "model.encoder.embed_vision.embedding_projection.weight": normal(hidden, vh),
      "model.encoder.vision_tower.patch_embedder.input_proj.weight": normal(vh, 3 * patch * patch),
      "model.encoder.vision_tower.patch_embedder.position_embedding_table":
          ones(2, vision["position_embedding_size"], vh),
  }
  for i in range(vision["num_hidden_layers"]):
    p = f"model.encoder.vision_tower.encoder.layers.{i}."
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
      out[p + norm + ".weight"] = ones(vh)
    out[p + "self_attn.q_norm.weight"] = ones(hd)
    out[p + "self_attn.k_norm.weight"] = ones(hd)
    out[p + "self_attn.q_proj.linear.weight"] = normal(heads * hd, vh)
    out[p + "self_attn.k_proj.linear.weight"] = normal(kv * hd, vh)
    out[p + "self_attn.v_proj.linear.weight"] = normal(kv * hd, vh)
    out[p + "self_attn.o_proj.linear.weight"] = normal(vh, heads * hd)
    out[p + "mlp.gate_proj.linear.weight"] = normal(inter, vh)
    out[p + "mlp.up_proj.linear.weight"] = normal(inter, vh)
    out[p + "mlp.down_proj.linear.weight"] = normal(vh, inter)
  return out


def _to_numpy(x: jax.Array | np.ndarray, dtype: str) -> np.ndarray:
  if isinstance(x, np.ndarray):  # a host array: cast by numpy (the same rounding), no copy when the dtype matches
    return x.astype(jnp.dtype(dtype), copy=False)
  return np.asarray(jnp.asarray(x, dtype=jnp.dtype(dtype)))


Tensors = Iterable[tuple[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class _Extra:
  """Tensors written after the text model: their specs (known before any data) and a function yielding them."""

  specs: list[TensorSpec]
  tensors: Callable[[], Tensors]


def checkpoint_specs(model: nnx.Module, dtype: str, qscheme: quantized_export.Scheme | None) -> list[TensorSpec]:
  """Name, shape and dtype of every stored text-model tensor, in writing order, from the shapes of the merged model
  alone (`merge` traced abstractly: nothing is computed or allocated)."""
  abstract = nnx.eval_shape(merge, model)
  specs = []
  for path, var in iter_variables(abstract):
    name, transpose = hf_name(path)
    shape = tuple(var.shape)[::-1] if transpose else tuple(var.shape)
    specs += [TensorSpec(n, tuple(sh), dt) for n, sh, dt in quantized_export.stored_shapes(name, shape, qscheme, dtype)]
  return specs


def _part_tensors(part: list[tuple[VariablePath, jax.Array | np.ndarray]], dtype: str,
                  qscheme: quantized_export.Scheme | None) -> Iterator[tuple[str, np.ndarray]]:
  """The stored tensors of one merged part (a layer): HF names, `[out, in]` kernels, cast or quantized."""
  group_amax: dict[str, float] = {}  # max |w| of each matrix vLLM fuses (NVFP4's shared global scales; per layer)
  if qscheme is not None and qscheme.kind == "nvfp4":
    for path, value in part:
      group = quantized_export.fused_group(hf_name(path)[0])
      if group is not None:
        amax = float(np.max(np.abs(np.asarray(value, np.float32))))
        group_amax[group] = max(group_amax.get(group, 0.0), amax)
  for path, value in part:
    name, transpose = hf_name(path)
    if qscheme is not None and quantized_export.is_quantized(name, qscheme):  # in float32 inside, expert by expert
      host = np.asarray(value.T if transpose else value)
      yield from quantized_export.quantized_tensors(name, host, qscheme, dtype, group_amax)
      continue
    yield name, _to_numpy(value.T if transpose else value, dtype)


def _model_tensors(model: nnx.Module, dtype: str, qscheme: quantized_export.Scheme | None) -> Tensors:
  nvfp4 = qscheme is not None and qscheme.kind == "nvfp4"  # its fused matrices share a scale: a layer at a time
  for part in merged_parts(model, whole_layers=nvfp4):
    yield from _part_tensors(part, dtype, qscheme)
    del part


def _vision_tensors(hidden: int, dtype: str, vision_source: str | None) -> _Extra:
  """The vision tower's tensors: `vision_source`'s (read one at a time) or the tiny stub, in `dtype`."""
  if vision_source is None:
    stub = {n: _to_numpy(jnp.asarray(v), dtype) for n, v in _vision_stub(hidden, TINY_VISION_CONFIG).items()}
    return _Extra([spec_of(n, a) for n, a in stub.items()], lambda: iter(stub.items()))
  specs = [TensorSpec(name, tuple(handle.get_slice(name).get_shape()), dtype)
           for _, name, handle in iter_tensors(vision_source) if is_vision(name)]

  def read() -> Tensors:
    for _, name, handle in iter_tensors(vision_source):
      if is_vision(name):
        yield name, np.asarray(jnp.asarray(handle.get_tensor(name)).astype(jnp.dtype(dtype)))

  return _Extra(specs, read)


def _extra_tensors(extra: Mapping[str, Any] | Tensors, dtype: str) -> _Extra:
  values = {name: _to_numpy(jnp.asarray(value), dtype) for name, value in dict(extra).items()}
  return _Extra([spec_of(n, a) for n, a in values.items()], lambda: iter(values.items()))


def save_pretrained(model: DiffusionGemma, path: str, *, dtype: str | None = None, max_shard_size: int = 4 << 30,
                    vision_source: str | None = None, extra_config: dict[str, Any] | None = None,
                    quantize: str | None = None, extra_tensors: Mapping[str, Any] | Tensors | None = None) -> None:
  """Writes a directory that transformers' `DiffusionGemmaForBlockDiffusion.from_pretrained` loads.

  `dtype`: storage dtype (default: the model's parameter dtype). `quantize`: one of
  `quantized_export.QUANTIZE_MODES` - 'fp8' / 'nvfp4': the attention and dense MLP projections and the experts
  (one tensor per expert, the layout vLLM loads) in compressed-tensors FP8 (per-channel scales, dynamic
  activations: vLLM's "FP8 dynamic") or NVFP4 (weights only); 'fp8-linear' / 'nvfp4-linear': the same with the
  experts dense (what transformers + compressed-tensors load); everything else in `dtype`. Shards above
  `max_shard_size` bytes, with an index. `vision_source`: a HF checkpoint whose vision tower and vision config are
  copied (default: a tiny stub, since transformers always builds a vision tower). `extra_tensors`: more
  `(name, array)` tensors (or a mapping) written after the text model in `dtype` (held in memory while writing:
  meant for the vision tower); when one of them is a vision tensor they are the tower, and neither the stub nor
  `vision_source`'s tensors are written. A model with its own vision tower (`config.vision`) saves it, and refuses
  `vision_source`. Streams (see the module doc). Refuses a model with
  adapters or a quantized base (`save_merged` folds them in) and one whose attention structure transformers
  cannot run.
  """
  if has_lora(model):
    raise CheckpointError("the model has LoRA adapters: merge them first (hackable_diffusion.lora.merge, or "
                          "interop.export.export_merged)")
  if base_quantization(model) != "none":
    raise CheckpointError(f"the model's base is quantized ({base_quantization(model)}, QLoRA): dequantize it first "
                          "(hackable_diffusion.lora.merge, or lora.qlora.dequantize_base)")
  save_merged(model, path, dtype=dtype, max_shard_size=max_shard_size, vision_source=vision_source,
              extra_config=extra_config, quantize=quantize, extra_tensors=extra_tensors)


def save_merged(model: nnx.Module, path: str, *, dtype: str | None = None, max_shard_size: int = 4 << 30,
                vision_source: str | None = None, extra_config: dict[str, Any] | None = None,
                quantize: str | None = None, extra_tensors: Mapping[str, Any] | Tensors | None = None) -> None:
  """`save_pretrained` of `lora.merge(model)` without ever holding the merged model: adapters are folded in (and a
  QLoRA base dequantized) as the tensors are written (`lora.merge.merged_parts`). Same files, byte for byte."""
  config = model.config
  if config.attention_structure is not None:
    raise CheckpointError(
        f"model uses attention_structure={config.attention_structure!r}, which transformers/vLLM cannot run; "
        "export a pure-architecture model (a config without one, e.g. a shipped configs/*_pure.py) instead"
    )
  dtype = dtype or config.param_dtype
  if dtype not in _TORCH_DTYPES:
    raise CheckpointError(f"unsupported save dtype {dtype!r}; expected one of {sorted(_TORCH_DTYPES)}")
  qscheme = None if quantize is None else quantized_export.scheme(quantize)  # ConfigError for an unknown mode
  makedirs_no_link(path)
  hf_config = config.to_hf_config(torch_dtype=dtype)
  if qscheme is not None:
    hf_config["quantization_config"] = quantized_export.quantization_config(quantize)
  own_tower = config.vision is not None  # its tensors are model variables, written with the text model's
  if own_tower and vision_source is not None:
    raise CheckpointError(f"vision_source={vision_source!r}: the model has its own vision tower, which is what is "
                          "saved; vision_source is for a text-only model")
  if vision_source is not None:
    src = read_json(os.path.join(vision_source, "config.json"), error=CheckpointError)
    for key in ("vision_config", "boi_token_id", "eoi_token_id", "image_token_id"):
      if key in src:
        hf_config[key] = src[key]
  if extra_config:
    hf_config.update(extra_config)

  extras = [_extra_tensors(extra_tensors, dtype)] if extra_tensors is not None else []
  if not own_tower and not any(is_vision(s.name) for e in extras for s in e.specs):
    extras.insert(0, _vision_tensors(config.hidden_size, dtype, vision_source))
  specs = checkpoint_specs(model, dtype, qscheme) + [s for e in extras for s in e.specs]
  with ShardedWriter(path, specs, max_shard_size=max_shard_size, metadata={"format": "pt"}) as writer:
    writer.write_all(_model_tensors(model, dtype, qscheme))
    for extra in extras:
      writer.write_all(extra.tensors())
    writer.finish()
  write_json(os.path.join(path, "config.json"), hf_config)


__all__ = ["checkpoint_specs", "save_merged", "save_pretrained"]
