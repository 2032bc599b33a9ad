"""PEFT LoRA adapters, both ways: `adapter_model.safetensors` + `adapter_config.json` (peft 0.21 layout).

Tensor names are `base_model.model.<module>.lora_A.weight [r, in]` and `.lora_B.weight [out, r]` (PEFT drops the
adapter name `default` when saving). transformers' DiffusionGemma has separate encoder
(`model.encoder.language_model.layers.N.*`) and decoder (`model.decoder.layers.N.*`) modules with tied weights,
and PEFT wraps each of them; our model has one set of weights, so one adapter is written under both paths (the
decoder-only self-conditioning MLP once), and reading requires the two copies to be identical.

The vision tower exists once (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`), so its adapters are
written once. Its projections are `Gemma4ClippableLinear`s, which PEFT cannot wrap, but it wraps their inner
`nn.Linear`: our `vision_tower.encoder.layers.N.self_attn.q_proj` is PEFT's
`model.encoder.vision_tower.encoder.layers.N.self_attn.q_proj.linear` (the update inside the clamps, as
`lora.adapters.LoRAClippableLinear` computes it); `patch_embedder.input_proj` and
`embed_vision.embedding_projection` are plain `nn.Linear`s.

`adapter_config.json.target_modules` is one regex over exactly the adapted module names (PEFT `re.fullmatch`es a
string against module names); a plain list of suffixes would also match the vision tower's `Gemma4ClippableLinear`s
themselves. Expert tensors use `target_parameters` (full parameter names): PEFT wraps the 3-D
`gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` with `lora.ParamWrapper`, treating `[E, out, in]` as `E` linears
with `lora_A.weight [r*E, in]` (rows expert-major: `A[e*r + k]`) and
`lora_B.weight [out, r*E]` (columns expert-minor: `B[:, k*E + e]`), delta `W[e] += scale * B_e @ A_e`. When both
tensors of one module are targeted the wrappers nest in parameter order, so `gate_up_proj`'s factors are saved
as `experts.base_layer.lora_*` and `down_proj`'s as `experts.lora_*`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from hackable_diffusion.errors import AdapterError
from hackable_diffusion.files import makedirs_no_link, read_json, write_json
from hackable_diffusion.interop.names import DECODER, DECODER_LAYERS, ENCODER_LAYERS, hf_name
from hackable_diffusion.interop.safetensors_io import write_file
from hackable_diffusion.interop.vision_io import VISION_PREFIXES
from hackable_diffusion.lora.adapters import (EXPERT_PARAMS, LINEAR_ADAPTERS, AdapterModule, LoRAExperts, LoraConfig,
                                              apply_lora, has_lora, lora_modules, targetable)
from hackable_diffusion.lora.merge import layer_module
from hackable_diffusion.model import scan

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
_BASE = ".base_layer"
VISION_LAYERS = "model.encoder.vision_tower.encoder.layers."
_ENCODER = "model.encoder."


# ---- names ------------------------------------------------------------------------------------------------------
def decoder_module(path: tuple[Any, ...], param: str | None) -> str:
  """HF name of the decoder module holding our target: `model.decoder.layers.0.self_attn.q_proj`,
  `model.decoder.layers.0.experts` (expert tensors), `model.decoder.self_conditioning.gate_proj`; for the vision
  tower, the module PEFT wraps: `model.encoder.vision_tower.encoder.layers.0.self_attn.q_proj.linear`,
  `model.encoder.embed_vision.embedding_projection`."""
  if param is None:
    return hf_name((*path, "kernel"))[0][: -len(".weight")]
  return hf_name((*path, param))[0].rsplit(".", 1)[0]


def module_copies(decoder_name: str) -> list[str]:
  """The decoder module and, for layer modules, the encoder module with the same (tied) weights."""
  if decoder_name.startswith(DECODER_LAYERS):
    return [decoder_name, ENCODER_LAYERS + decoder_name[len(DECODER_LAYERS):]]
  return [decoder_name]


def _rx(names: Iterable[str]) -> str:
  names = sorted(set(names))
  return names[0] if len(names) == 1 else "(?:" + "|".join(names) + ")"


def _layer_parts(names: Iterable[str], prefix: str, prefix_rx: str, num_layers: int) -> list[str]:
  """Regexes for the modules `prefix + "N." + sub` of `names`, grouped by the set of layers N they cover."""
  by_sub: dict[str, set[int]] = {}
  for name in names:
    layer, sub = name[len(prefix):].split(".", 1)
    by_sub.setdefault(sub, set()).add(int(layer))
  groups: dict[frozenset[int], list[str]] = {}
  for sub, layer_set in by_sub.items():
    groups.setdefault(frozenset(layer_set), []).append(re.escape(sub))
  parts = []
  for layer_set, subs in sorted(groups.items(), key=lambda g: sorted(g[0])):
    idx = r"\d+" if layer_set == frozenset(range(num_layers)) else _rx(str(i) for i in layer_set)
    parts.append(rf"{prefix_rx}\.{idx}\.{_rx(subs)}")
  return parts


def target_modules_regex(decoder_names: Iterable[str], num_layers: int, num_vision_layers: int = 0) -> str:
  """One regex that `re.fullmatch`es exactly the encoder and decoder copies of `decoder_names` (and the vision
  modules among them, which exist once; `num_vision_layers`: the tower's layer count)."""
  names = list(decoder_names)
  text_layers = [n for n in names if n.startswith(DECODER_LAYERS)]
  vision_layers = [n for n in names if n.startswith(VISION_LAYERS)]
  text_other = [re.escape(n[len(DECODER):]) for n in names if n.startswith(DECODER) and n not in text_layers]
  vision_other = [re.escape(n[len(_ENCODER):]) for n in names
                  if n.startswith(VISION_PREFIXES) and n not in vision_layers]
  parts = _layer_parts(text_layers, DECODER_LAYERS, r"model\.(?:encoder\.language_model|decoder)\.layers",
                       num_layers)
  if text_other:
    parts.append(rf"model\.decoder\.{_rx(text_other)}")
  parts += _layer_parts(vision_layers, VISION_LAYERS, re.escape(VISION_LAYERS[:-1]), num_vision_layers)
  if vision_other:
    parts.append(rf"model\.encoder\.{_rx(vision_other)}")
  return parts[0] if len(parts) == 1 else "|".join(f"(?:{p})" for p in parts)


# ---- export -----------------------------------------------------------------------------------------------------
def _linear_factors(m: Any) -> tuple[np.ndarray, np.ndarray]:
  """[r, in], [out, r] of a `LINEAR_ADAPTERS` module."""
  return np.asarray(m.lora_a[...]).T, np.asarray(m.lora_b[...]).T  # [r, in], [out, r]


def _expert_factors(m: LoRAExperts, name: str) -> tuple[np.ndarray, np.ndarray]:
  a = np.asarray(getattr(m, f"{name}_lora_a")[...])  # [E, in, r]
  b = np.asarray(getattr(m, f"{name}_lora_b")[...])  # [E, r, out]
  e, d_in, r = a.shape
  return a.transpose(0, 2, 1).reshape(e * r, d_in), b.transpose(2, 1, 0).reshape(b.shape[2], r * e)


def _expert_module_name(module: str, targets: tuple[str, ...], name: str) -> str:
  """PEFT nests one ParamWrapper per targeted tensor in parameter order: the first is innermost."""
  depth = len(targets) - 1 - targets.index(name)
  return module + _BASE * depth


def adapter_modules(model: nnx.Module) -> Iterator[tuple[tuple[Any, ...], AdapterModule]]:
  """(path as in the unrolled model, module) of every adapter of `model`; a stacked model's layers are sliced one
  at a time, their adapters only (`lora.merge.layer_module`): the base weights are never read, so a model whose
  base is shapes only (`runs.run.load_run_adapters`) works too."""
  if not scan.is_scanned(model):
    yield from lora_modules(model)
    return
  for i in range(len(model.layers)):
    for path, m in lora_modules(layer_module(model, i, adapters_only=True)):
      yield ("layers", i, *path), m
  for path, m in lora_modules(model):
    if path[0] != "layers":
      yield path, m


def adapter_state(model: nnx.Module) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """(PEFT tensors by name, the fields of adapter_config.json that depend on the model)."""
  mods = list(adapter_modules(model))
  if not mods:
    raise AdapterError("the model has no LoRA adapters (apply_lora it, or export the merged model instead)")
  tensors: dict[str, np.ndarray] = {}
  linear_names, params, ranks, scales, dropouts = [], [], set(), set(), set()
  for path, m in mods:
    scales.add(round(m.scale, 12))
    if isinstance(m, LINEAR_ADAPTERS):
      ranks.add(m.rank)
      dropouts.add(m.dropout_rate)
      dec = decoder_module(path, None)
      linear_names.append(dec)
      pairs = [(dec, _linear_factors(m))]
    else:
      dec = decoder_module(path, m.targets[0])
      pairs = []
      for name in m.targets:
        a, b = _expert_factors(m, name)
        ranks.add(a.shape[0] // m.weight_shape("gate_up_proj")[0])
        params.append(f"{dec}.{name}")
        pairs.append((_expert_module_name(dec, m.targets, name), (a, b)))
    for module, (a, b) in pairs:
      for copy in module_copies(module):
        tensors[f"{PREFIX}{copy}.lora_A.weight"] = a
        tensors[f"{PREFIX}{copy}.lora_B.weight"] = b
  if len(ranks) != 1 or len(scales) != 1:
    raise AdapterError(f"adapters of different ranks {sorted(ranks)} or scales {sorted(scales)} cannot be written as "
                       "one PEFT adapter")
  rank, scale = ranks.pop(), scales.pop()
  alpha = scale * rank
  alpha = int(round(alpha)) if abs(alpha - round(alpha)) < 1e-9 else alpha
  fields = {
      "r": rank,
      "lora_alpha": alpha,
      # PEFT refuses dropout on expert tensors (ParamWrapper); dropout does not matter for inference anyway.
      "lora_dropout": 0.0 if params else (max(dropouts) if dropouts else 0.0),
      "target_modules": (target_modules_regex(linear_names, model.config.num_hidden_layers, _vision_layers(model))
                         if linear_names else None),
      "target_parameters": sorted(c for p in params for c in _param_copies(p)) or None,
  }
  return tensors, fields


def _vision_layers(model: nnx.Module) -> int:
  vision = getattr(model.config, "vision", None)
  return vision.num_hidden_layers if vision is not None else 0


def _param_copies(decoder_param: str) -> list[str]:
  module, name = decoder_param.rsplit(".", 1)
  return [f"{m}.{name}" for m in module_copies(module)]


def adapter_config(model: nnx.Module, base_model_name_or_path: str | None) -> dict[str, Any]:
  """The adapter_config.json of `model`'s adapters."""
  return _config_json(adapter_state(model)[1], base_model_name_or_path)


def _config_json(fields: Mapping[str, Any], base_model_name_or_path: str | None) -> dict[str, Any]:
  return {
      "peft_type": "LORA",
      "task_type": None,
      "base_model_name_or_path": base_model_name_or_path,
      "revision": None,
      **fields,
      "exclude_modules": None,
      "bias": "none",
      "lora_bias": False,
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "init_lora_weights": True,
      "modules_to_save": None,
      "layers_to_transform": None,
      "layers_pattern": None,
      "rank_pattern": {},
      "alpha_pattern": {},
      "inference_mode": True,
  }


def save_adapter(model: nnx.Module, out_dir: str, base_model_name_or_path: str | None = None, *,
                 dtype: str | None = None) -> dict[str, str]:
  """Writes `out_dir/adapter_model.safetensors` + `adapter_config.json` for `PeftModel.from_pretrained`.

  `dtype`: storage dtype of the factors (default: the adapter parameter dtype). Returns the written paths. Only
  the adapters are read (`adapter_modules`), so `model`'s base may be shapes only. Both files are written through a
  fresh temporary file and a rename; a symbolic link at either name is refused (`UnsafePathError`), never followed.
  """
  tensors, fields = adapter_state(model)
  makedirs_no_link(out_dir)
  weights = os.path.join(out_dir, ADAPTER_WEIGHTS_NAME)
  config = os.path.join(out_dir, ADAPTER_CONFIG_NAME)
  cast = {id(v): v if dtype is None else np.asarray(jnp.asarray(v, dtype)) for v in tensors.values()}  # once each
  write_file(weights, {k: cast[id(v)] for k, v in tensors.items()}, metadata={"format": "pt"})
  write_json(config, _config_json(fields, base_model_name_or_path))
  return {"weights": weights, "config": config}


# ---- import -----------------------------------------------------------------------------------------------------
_UNSUPPORTED = {  # adapter_config.json field -> value PEFT uses when the feature is off
    "use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "modules_to_save": None, "rank_pattern": {},
    "alpha_pattern": {}, "layer_replication": None, "trainable_token_indices": None, "bias": "none",
}
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def read_adapter_config(path: str) -> dict[str, Any]:
  file = os.path.join(path, ADAPTER_CONFIG_NAME)
  if not os.path.isdir(path):
    raise AdapterError(f"{path}: not a directory")
  config = read_json(file, error=AdapterError, missing="no such file (not a PEFT adapter directory)", expect=None)
  if not isinstance(config, dict) or config.get("peft_type") != "LORA":
    raise AdapterError(f"{file}: peft_type={config.get('peft_type') if isinstance(config, dict) else None!r}; "
                       "only LORA adapters are supported")
  for key, off in _UNSUPPORTED.items():
    value = config.get(key)
    if value is not None and value != off and value not in ([], {}):
      raise AdapterError(f"{file}: {key}={value!r} is not supported (hackable_diffusion reads plain LoRA)")
  r = config.get("r")
  alpha = config.get("lora_alpha")
  if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
    raise AdapterError(f"{file}: r={r!r}, lora_alpha={alpha!r}; expected an integer r >= 1 and lora_alpha > 0")
  return config


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  file = os.path.join(path, ADAPTER_WEIGHTS_NAME)
  if not os.path.exists(file):
    other = [n for n in ("adapter_model.bin",) if os.path.exists(os.path.join(path, n))]
    hint = f" (found {other[0]}: re-save it with safe_serialization=True)" if other else ""
    raise AdapterError(f"{file}: no such file{hint}")
  try:
    with safe_open(file, framework="flax") as f:
      return {k: np.asarray(f.get_tensor(k), np.float32) for k in f.keys()}
  except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
    raise AdapterError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def _targeted_params(module: str, target_parameters: Iterable[str]) -> tuple[str, ...]:
  """The expert tensors of HF module `module` that PEFT's `target_parameters` matching selects (exact name or
  `.`-suffix), in parameter (= nesting) order."""
  targets = list(target_parameters or ())
  out = []
  for name in EXPERT_PARAMS:
    key = f"{module}.{name}"
    if any(key == t or key.endswith("." + t) for t in targets):
      out.append(name)
  return tuple(out)


def load_adapter(model: nnx.Module, path: str) -> nnx.Module:
  """Reads a PEFT LoRA adapter (as `PeftModel.save_pretrained` writes it for transformers' DiffusionGemma) into
  a LoRA-wrapped copy of `model`.

  Vision tower adapters (`...q_proj.linear`, `embed_vision.embedding_projection`, ...) are read into its
  `ClippableLinear`s. Raises `AdapterError` (one line) for: a missing/malformed file, unsupported PEFT features, a
  module that is not part of the model, an encoder copy that differs from (or lacks) its decoder copy, and a tensor
  whose shape does not fit this model (naming the tensor and both shapes).
  """
  if has_lora(model):
    raise AdapterError("the model already has LoRA adapters; merge() it first to stack another adapter")
  if scan.is_scanned(model):  # read into the layer-by-layer form, then stacked again
    return scan.stack_layers(load_adapter(scan.unstack_layers(model), path))
  config = read_adapter_config(path)
  tensors = _read_tensors(path)
  file = os.path.join(path, ADAPTER_WEIGHTS_NAME)
  r = int(config["r"])
  alpha = float(config["lora_alpha"]) * (math.sqrt(r) if config.get("use_rslora") else 1.0)  # same scale
  table = targetable(model)
  by_module: dict[str, tuple[str, tuple[Any, ...], str | None]] = {}  # `_relative` HF module -> ours
  for name, (mpath, param) in table.items():
    if param is None:
      by_module[_relative(decoder_module(mpath, None))] = (name, mpath, None)
  expert_modules = {decoder_module(mpath, param)[len(DECODER):]: mpath for _, (mpath, param) in table.items() if param}
  # ours -> {'dec'|'enc': {'A'|'B': (key, array)}}
  found: dict[str, dict[str, dict[str, tuple[str, np.ndarray]]]] = {}
  for key, value in tensors.items():
    m = _KEY.match(key[len(PREFIX):]) if key.startswith(PREFIX) else None
    if m is None:
      raise AdapterError(f"{file}: unexpected tensor {key!r} (expected '{PREFIX}<module>.lora_A.weight' / "
                         "'.lora_B.weight')")
    module = m.group("module")
    depth = 0
    while module.endswith(_BASE):
      module, depth = module[: -len(_BASE)], depth + 1
    if module.startswith(ENCODER_LAYERS):
      mode, rel = "enc", "layers." + module[len(ENCODER_LAYERS):]
    elif module.startswith((DECODER, *VISION_PREFIXES)):  # a vision module has one copy, read as the decoder's
      mode, rel = "dec", _relative(module)
    else:
      raise AdapterError(f"{file}: tensor {key!r} adapts {module!r}, which is not part of the model (expected "
                         f"model.decoder.*, model.encoder.language_model.* or {', '.join(VISION_PREFIXES)}*)")
    if rel in expert_modules:
      targeted = _targeted_params(module, config.get("target_parameters"))
      if depth >= len(targeted):
        raise AdapterError(f"{file}: tensor {key!r} does not correspond to a target_parameters entry "
                           f"({config.get('target_parameters')!r})")
      ours = f"{'.'.join(str(p) for p in expert_modules[rel])}.{targeted[len(targeted) - 1 - depth]}"
    elif rel in by_module and depth == 0:
      ours = by_module[rel][0]
    else:
      raise AdapterError(f"{file}: tensor {key!r} adapts {module!r}, which this model does not have (an adapter "
                         "for a different base model?)")
    found.setdefault(ours, {}).setdefault(mode, {})[m.group("ab")] = (key, value)
  if not found:
    raise AdapterError(f"{file}: no LoRA tensors")
  for ours, modes in found.items():  # shapes first: a different base is the more basic mistake
    for copy in modes.values():
      _check_shapes(file, model, table[ours], copy, r)
  for ours, modes in found.items():
    _check_copies(file, ours, modes)
  names = [n for n in table if n in found]
  lora_config = LoraConfig(rank=r, alpha=alpha, target_modules=tuple(f"^{re.escape(n)}$" for n in names))
  wrapped = apply_lora(model, lora_config, rngs=nnx.Rngs(0))
  for name in names:
    mpath, param = table[name]
    a, b = found[name]["dec"]["A"][1], found[name]["dec"]["B"][1]
    _set_factors(wrapped, mpath, param, a, b)
  return wrapped


def _relative(module: str) -> str:
  """A HF module name as `load_adapter` keys it: decoder modules without `model.decoder.`, vision ones whole."""
  return module[len(DECODER):] if module.startswith(DECODER) else module


def _check_copies(file: str, ours: str, modes: dict[str, dict[str, tuple[str, np.ndarray]]]) -> None:
  if "dec" not in modes:
    key = next(iter(modes["enc"].values()))[0]
    raise AdapterError(f"{file}: {key!r} has no decoder copy; hackable_diffusion has one set of weights for both "
                       "modes, so encoder and decoder must carry the same adapter")
  for ab in ("A", "B"):
    if ab not in modes["dec"]:
      raise AdapterError(f"{file}: lora_{ab} of {ours} is missing (only {next(iter(modes['dec'].values()))[0]!r})")
  is_layer = ours.startswith("layers.")
  if not is_layer:
    return
  if "enc" not in modes or set(modes["enc"]) != {"A", "B"}:
    key = modes["dec"]["A"][0]
    raise AdapterError(f"{file}: {key!r} has no encoder copy (model.encoder.language_model.*); hackable_diffusion "
                       "has one set of weights for both modes, so both copies must be present and identical")
  for ab in ("A", "B"):
    (kd, vd), (ke, ve) = modes["dec"][ab], modes["enc"][ab]
    if vd.shape != ve.shape or not np.array_equal(vd, ve):
      diff = float(np.max(np.abs(vd - ve))) if vd.shape == ve.shape else float("nan")
      raise AdapterError(f"{file}: encoder copy {ke!r} differs from decoder copy {kd!r} (max |diff| {diff:.3g}); "
                         "hackable_diffusion has one set of weights for both modes and cannot hold two adapters")


def _check_shapes(file: str, model: nnx.Module, target: tuple[tuple[Any, ...], str | None],
                  dec: dict[str, tuple[str, np.ndarray]], r: int) -> None:
  """`dec`: {'A'|'B': (tensor name, array)} of one copy (encoder or decoder)."""
  mpath, param = target
  module = _module_at(model, mpath)
  if param is None:
    d_in, d_out = module.in_features, module.out_features
    expected = {"A": (r, d_in), "B": (d_out, r)}
  else:
    e, d_out, d_in = module.weight_shape(param)
    expected = {"A": (r * e, d_in), "B": (d_out, r * e)}
  for ab in ("A", "B"):
    if ab not in dec:
      continue  # reported by _check_copies
    key, value = dec[ab]
    if tuple(value.shape) != expected[ab]:
      raise AdapterError(f"{file}: tensor {key!r} has shape {tuple(value.shape)}, expected {expected[ab]} for this "
                         f"model with r={r} (an adapter for a different base model?)")


def _module_at(model: nnx.Module, path: tuple[Any, ...]) -> Any:
  """The submodule of `model` at `path` (e.g. `('layers', 0, 'self_attn', 'q_proj')`)."""
  for p in path:
    model = model[p] if isinstance(p, int) else getattr(model, p)
  return model


def _set_factors(model: nnx.Module, mpath: tuple[Any, ...], param: str | None, a: np.ndarray, b: np.ndarray) -> None:
  module = _module_at(model, mpath)
  if param is None:
    module.lora_a.value = jnp.asarray(a.T, module.lora_a.dtype)
    module.lora_b.value = jnp.asarray(b.T, module.lora_b.dtype)
    return
  va, vb = getattr(module, f"{param}_lora_a"), getattr(module, f"{param}_lora_b")
  e, d_in, r = va.shape
  d_out = vb.shape[2]
  va.value = jnp.asarray(a.reshape(e, r, d_in).transpose(0, 2, 1), va.dtype)
  vb.value = jnp.asarray(b.reshape(d_out, r, e).transpose(2, 1, 0), vb.dtype)


__all__ = ["ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "AdapterError", "adapter_config", "adapter_modules",
           "adapter_state", "load_adapter", "read_adapter_config", "save_adapter", "target_modules_regex"]
