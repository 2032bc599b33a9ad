"""Export a (LoRA-)fine-tuned model for serving: a PEFT adapter, or a merged Hugging Face checkpoint.

- `export_peft`: `adapter_model.safetensors` + `adapter_config.json` for `PeftModel.from_pretrained(base, dir)`
  on transformers' `DiffusionGemmaForBlockDiffusion` (see `hackable_diffusion.interop.peft`).
- `export_merged`: adapters folded into the weights (`hackable_diffusion.lora.merge`, each update added once;
  PEFT's own `merge_and_unload()` adds it once per mode on this model, see docs/lora.md), written with
  `hd.save_pretrained`, plus a `generation_config.json` that transformers reads into its
  `DiffusionGemmaGenerationConfig` (our sampling defaults) and the tokenizer. This is what vLLM serves (its
  DiffusionGemma has no LoRA support).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping
from typing import Any

from flax import nnx

from hackable_diffusion.errors import AdapterError, CheckpointError, ConfigError
from hackable_diffusion.files import write_json
from hackable_diffusion.interop import hf
from hackable_diffusion.interop import peft as peft_io
from hackable_diffusion.lora.adapters import has_lora
from hackable_diffusion.lora.merge import merge
from hackable_diffusion.sampling.config import SamplingConfig

GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
MERGED_DTYPES = ("bfloat16", "float32", "float16")
# SamplingConfig fields that only steer our implementation (transformers has no such setting).
_OURS_ONLY = ("prompt_length_buckets", "canvas_length", "early_stopping")


def generation_config(model_config: Any, defaults: Mapping[str, Any] | SamplingConfig | None = None) -> dict[str, Any]:
  """`generation_config.json` contents for transformers' `DiffusionGemmaGenerationConfig`.

  `defaults`: a `SamplingConfig` or a dict of its fields (validated by `SamplingConfig`); missing fields take
  `SamplingConfig`'s defaults (which are transformers' own), token ids come from the model config. Field names
  follow transformers: `max_new_tokens`, `max_denoising_steps`, `sampler_config.entropy_bound`, `t_min`, `t_max`,
  `stability_threshold`, `confidence_threshold`, `bos/pad/eos_token_id`.
  """
  if isinstance(defaults, SamplingConfig):
    sc = defaults
  else:
    values = dict(defaults or {})
    valid = {f.name for f in dataclasses.fields(SamplingConfig)}
    unknown = sorted(set(values) - valid)
    if unknown:
      raise ConfigError(f"generation defaults have unknown key(s) {unknown}; valid keys: {sorted(valid)}")
    sc = SamplingConfig(**values)
  if not sc.early_stopping:
    raise ConfigError("generation defaults: early_stopping=False has no transformers equivalent; leave it on")
  rule_args = dict(sc.acceptance_args)
  if sc.acceptance != "entropy_bound" or set(rule_args) - {"bound"}:
    raise ConfigError(f"generation defaults: acceptance={sc.acceptance!r} with args {rule_args} has no transformers "
                      f"equivalent (it samples with the entropy bound only); export with acceptance='entropy_bound'")
  bound = float(rule_args.get("bound", sc.entropy_bound))
  if sc.canvas_length is not None and sc.canvas_length != model_config.canvas_length:
    raise ConfigError(f"generation defaults: canvas_length={sc.canvas_length} differs from the model's "
                      f"canvas_length={model_config.canvas_length} (transformers reads it from config.json)")
  eos = sc.eos_token_id if sc.eos_token_id is not None else model_config.eos_token_id
  out = {
      "max_new_tokens": int(sc.max_new_tokens),
      "max_denoising_steps": int(sc.max_denoising_steps),
      "sampler_config": {"entropy_bound": bound, "_cls_name": "EntropyBoundSamplerConfig"},
      "t_min": float(sc.t_min),
      "t_max": float(sc.t_max),
      "stability_threshold": int(sc.stability_threshold),
      "confidence_threshold": float(sc.confidence_threshold),
      "bos_token_id": model_config.bos_token_id,
      "pad_token_id": sc.pad_token_id if sc.pad_token_id is not None else model_config.pad_token_id,
      "eos_token_id": list(eos) if isinstance(eos, (tuple, list)) else eos,
  }
  return out


def copy_tokenizer(tokenizer_path: str, out_dir: str) -> list[str]:
  """Copies a tokenizer file (e.g. `tokenizer.model`), or the tokenizer files of a directory, into `out_dir`."""
  if os.path.isfile(tokenizer_path):
    files = [tokenizer_path]
  elif os.path.isdir(tokenizer_path):
    files = [os.path.join(tokenizer_path, n) for n in TOKENIZER_FILES
             if os.path.isfile(os.path.join(tokenizer_path, n))]
    if not files:
      raise CheckpointError(f"{tokenizer_path}: no tokenizer file ({', '.join(TOKENIZER_FILES)})")
  else:
    raise CheckpointError(f"{tokenizer_path}: no such tokenizer file or directory")
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for src in files:
    dst = os.path.join(out_dir, os.path.basename(src))
    if os.path.abspath(src) != os.path.abspath(dst):
      shutil.copyfile(src, dst)
    written.append(dst)
  return written


def export_peft(model: nnx.Module, out_dir: str, base_model_name_or_path: str | None,
                tokenizer_path: str | None = None) -> dict[str, Any]:
  """Writes the adapters of a LoRA-wrapped `model` as a PEFT adapter directory; returns the written paths.

  `base_model_name_or_path`: the HF checkpoint the adapter applies to (recorded in adapter_config.json, which is
  where `PeftModel`/`AutoPeftModel` look for the base).
  """
  if not has_lora(model):
    raise AdapterError("the model has no LoRA adapters: export it with format 'merged' instead")
  written: dict[str, Any] = peft_io.save_adapter(model, out_dir, base_model_name_or_path)
  if tokenizer_path:
    written["tokenizer"] = copy_tokenizer(tokenizer_path, out_dir)
  return written


def export_merged(model: nnx.Module, out_dir: str, dtype: str = "bfloat16",
                  generation_defaults: Mapping[str, Any] | SamplingConfig | None = None,
                  tokenizer_path: str | None = None, vision_source: str | None = None) -> dict[str, Any]:
  """Writes a full HF checkpoint (`config.json`, safetensors, `generation_config.json`, tokenizer).

  Adapters, if any, are folded in first (`lora.merge`). `dtype`: 'bfloat16' (default, serving) or 'float32'.
  `vision_source`: a HF checkpoint whose vision tower is copied (default: a tiny stub; see `hd.save_pretrained`).
  """
  if dtype not in MERGED_DTYPES:
    raise ConfigError(f"dtype={dtype!r}; expected one of {MERGED_DTYPES}")
  gen = generation_config(model.config, generation_defaults)  # validate before writing anything
  plain = merge(model) if has_lora(model) else model
  hf.save_pretrained(plain, out_dir, dtype=dtype, vision_source=vision_source)
  path = write_json(os.path.join(out_dir, GENERATION_CONFIG_NAME), gen)
  written: dict[str, Any] = {"checkpoint": out_dir, "generation_config": path}
  if tokenizer_path:
    written["tokenizer"] = copy_tokenizer(tokenizer_path, out_dir)
  return written


__all__ = ["GENERATION_CONFIG_NAME", "copy_tokenizer", "export_merged", "export_peft", "generation_config"]
