"""Writing HF DiffusionGemma checkpoints: `save_pretrained`, a directory transformers' `from_pretrained` loads.

Owns the written layout: `config.json` (our config as transformers' `text_config`, optionally with a
compressed-tensors FP8 / NVFP4 `quantization_config`, `interop.quantized_export`), every tensor name transformers
expects (`interop.names`; kernels transposed to torch's `[out, in]`), a vision tower (a tiny stub, or copied from a
source checkpoint) so that `from_pretrained` reports no missing or unexpected keys, and sharding into
`model-0000N-of-0000M.safetensors` with an index above `max_shard_size`, each file written atomically (temporary
file + rename).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import flax as safetensors_flax
from safetensors.numpy import save_file

from hackable_diffusion.errors import CheckpointError
from hackable_diffusion.files import check_not_link, make_readable, read_json, write_json
from hackable_diffusion.interop import quantized_export
from hackable_diffusion.interop.names import hf_name, is_vision, iter_variables
from hackable_diffusion.interop.safetensors_io import INDEX_NAME, WEIGHTS_NAME, iter_tensors
from hackable_diffusion.lora.adapters import has_lora
from hackable_diffusion.lora.qlora import base_quantization
from hackable_diffusion.model import scan
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


def _to_numpy(x: jax.Array, dtype: str) -> np.ndarray:
  return np.asarray(jnp.asarray(x, dtype=jnp.dtype(dtype)))


def save_pretrained(model: DiffusionGemma, path: str, *, dtype: str | None = None, max_shard_size: int = 4 << 30,
                    vision_source: str | None = None, extra_config: dict[str, Any] | None = None,
                    quantize: str | None = None) -> None:
  """Writes a directory that transformers' `DiffusionGemmaForBlockDiffusion.from_pretrained` loads.

  `dtype`: storage dtype (default: the model's parameter dtype). `quantize`: one of
  `quantized_export.QUANTIZE_MODES` - 'fp8' / 'nvfp4': the attention and dense MLP projections and the experts
  (one tensor per expert, the layout vLLM loads) in compressed-tensors FP8 (per-channel scales, dynamic
  activations: vLLM's "FP8 dynamic") or NVFP4 (weights only); 'fp8-linear' / 'nvfp4-linear': the same with the
  experts dense (what transformers + compressed-tensors load); everything else in `dtype`. Shards above
  `max_shard_size` bytes, with an index. `vision_source`: a HF checkpoint whose vision tower and vision config are
  copied (default: a tiny stub, since transformers always builds a vision tower). Refuses a model whose attention
  structure transformers cannot run.
  """
  model = scan.unstack_layers(model, on_host=True)  # layer by layer, as transformers names it; no device copy
  config = model.config
  if has_lora(model):
    raise CheckpointError("the model has LoRA adapters: merge them first (hackable_diffusion.lora.merge, or "
                          "interop.export.export_merged)")
  if base_quantization(model) != "none":
    raise CheckpointError(f"the model's base is quantized ({base_quantization(model)}, QLoRA): dequantize it first "
                          "(hackable_diffusion.lora.merge, or lora.qlora.dequantize_base)")
  if config.attention_structure is not None:
    raise CheckpointError(
        f"model uses attention_structure={config.attention_structure!r}, which transformers/vLLM cannot run; "
        "export a pure-architecture model (a config without one, e.g. a shipped configs/*_pure.py) instead"
    )
  dtype = dtype or config.param_dtype
  if dtype not in _TORCH_DTYPES:
    raise CheckpointError(f"unsupported save dtype {dtype!r}; expected one of {sorted(_TORCH_DTYPES)}")
  qscheme = None if quantize is None else quantized_export.scheme(quantize)  # ConfigError for an unknown mode
  os.makedirs(path, exist_ok=True)
  hf_config = config.to_hf_config(torch_dtype=dtype)
  if qscheme is not None:
    hf_config["quantization_config"] = quantized_export.quantization_config(quantize)
  if vision_source is not None:
    src = read_json(os.path.join(vision_source, "config.json"), error=CheckpointError)
    for key in ("vision_config", "boi_token_id", "eoi_token_id", "image_token_id"):
      if key in src:
        hf_config[key] = src[key]
  if extra_config:
    hf_config.update(extra_config)

  group_amax: dict[str, float] = {}  # max |w| of each matrix vLLM fuses (NVFP4's shared global scales)
  if qscheme is not None and qscheme.kind == "nvfp4":
    for p, var in iter_variables(model):
      group = quantized_export.fused_group(hf_name(p)[0])
      if group is not None:
        amax = float(np.max(np.abs(np.asarray(var[...], np.float32))))
        group_amax[group] = max(group_amax.get(group, 0.0), amax)

  def tensors() -> Iterator[tuple[str, np.ndarray]]:
    for p, var in iter_variables(model):
      name, transpose = hf_name(p)
      value = var[...]
      if qscheme is not None and quantized_export.is_quantized(name, qscheme):
        dense = np.asarray(value.T if transpose else value, np.float32)
        yield from quantized_export.quantized_tensors(name, dense, qscheme, dtype, group_amax)
        continue
      yield name, _to_numpy(value.T if transpose else value, dtype)
    if vision_source is not None:
      for _, name, handle in iter_tensors(vision_source):
        if is_vision(name):
          yield name, np.asarray(jnp.asarray(handle.get_tensor(name)).astype(jnp.dtype(dtype)))
    else:
      for name, value in _vision_stub(config.hidden_size, TINY_VISION_CONFIG).items():
        yield name, _to_numpy(jnp.asarray(value), dtype)

  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, array in tensors():
    if size and size + array.nbytes > max_shard_size:
      shards.append({})
      size = 0
    shards[-1][name] = np.ascontiguousarray(array)
    size += array.nbytes
  metadata = {"format": "pt"}
  if len(shards) == 1:
    _atomic_save(shards[0], os.path.join(path, WEIGHTS_NAME), metadata)
    stale = os.path.join(path, INDEX_NAME)
    if os.path.exists(stale):
      os.remove(stale)
  else:
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      _atomic_save(shard, os.path.join(path, fname), metadata)
      for name, array in shard.items():
        weight_map[name] = fname
        total += array.nbytes
    write_json(os.path.join(path, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
  write_json(os.path.join(path, "config.json"), hf_config)


def _atomic_save(tensors: dict[str, np.ndarray], file: str, metadata: dict[str, str]) -> None:
  """Writes a safetensors file through a temporary file and a rename (streamed by safetensors, not via bytes).

  A symbolic link at `file` is refused (`files.check_not_link`), one at the temporary name removed, never followed;
  the file gets the usual permissions (0666 less the umask); a failed write (a full disk) is a one-line
  `CheckpointError` and leaves no temporary file.
  """
  check_not_link(file)
  tmp = file + ".tmp"
  if os.path.lexists(tmp):
    os.remove(tmp)
  try:
    if any(a.dtype == jnp.bfloat16 for a in tensors.values()):  # numpy has no bf16 in safetensors' numpy writer
      safetensors_flax.save_file({k: jnp.asarray(v) for k, v in tensors.items()}, tmp, metadata=metadata)
    else:
      save_file(tensors, tmp, metadata=metadata)
    make_readable(tmp)
    os.replace(tmp, file)
  except Exception as e:  # safetensors' SafetensorError (e.g. no space left on device), OSError
    if os.path.lexists(tmp):
      os.remove(tmp)
    reason = (e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())) or type(e).__name__
    raise CheckpointError(f"cannot write {file}: {reason}") from None


__all__ = ["save_pretrained"]
