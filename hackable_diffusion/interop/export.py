"""Export a (LoRA-)fine-tuned model for serving: a PEFT adapter, or a merged Hugging Face checkpoint.

- `export_peft`: `adapter_model.safetensors` + `adapter_config.json` for `PeftModel.from_pretrained(base, dir)`
  on transformers' `DiffusionGemmaForBlockDiffusion` (see `hackable_diffusion.interop.peft`).
- `export_merged`: adapters folded into the weights (`hackable_diffusion.lora.merge`, each update added once;
  PEFT's own `merge_and_unload()` adds it once per mode on this model, see docs/lora.md) as they are written
  (`interop.hf_write.save_merged`: the model as it is plus one merged tensor on the host, one layer on a device),
  plus a `generation_config.json` that transformers reads into its `DiffusionGemmaGenerationConfig` (our sampling
  defaults) and the tokenizer. This is what vLLM serves (its
  DiffusionGemma has no LoRA support).

Both refuse (one-line `ConfigError`, before anything is written) an output directory that is a file, a training
run's workdir (`looks_like_run_workdir`: its config.json would be replaced) or, unless `overwrite=True`, a
non-empty directory (`check_out_dir`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flax import nnx

from hackable_diffusion.errors import AdapterError, CheckpointError, ConfigError
from hackable_diffusion.files import write_atomic, write_json
from hackable_diffusion.interop import hf_write
from hackable_diffusion.interop import peft as peft_io
from hackable_diffusion.lora.adapters import has_lora
from hackable_diffusion.sampling.config import SamplingConfig

GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
MERGED_DTYPES = ("bfloat16", "float32", "float16")
# SamplingConfig fields that only steer our implementation (transformers has no such setting).
_OURS_ONLY = ("prompt_length_buckets", "canvas_length", "early_stopping")
# What marks a directory written by `hackable_diffusion.train` (runs.checkpoints.CHECKPOINT_DIR and
# training.logging.METRICS_FILENAME; named here because interop sits below training in the import graph).
RUN_WORKDIR_MARKERS = ("checkpoints", "metrics.jsonl")


def looks_like_run_workdir(path: str) -> bool:
  """A training run's workdir (it holds `checkpoints/` or `metrics.jsonl`), not a place to export into."""
  return os.path.isdir(os.path.join(path, RUN_WORKDIR_MARKERS[0])) or os.path.isfile(
      os.path.join(path, RUN_WORKDIR_MARKERS[1]))


def is_within(path: str, parent: str) -> bool:
  """`path` is `parent` or inside it, symlinks resolved (neither needs to exist)."""
  path, parent = os.path.realpath(path), os.path.realpath(parent)
  return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def check_out_dir(out_dir: str, *, overwrite: bool = False, protect: Sequence[str] = ()) -> None:
  """Raises a one-line ConfigError if exporting into `out_dir` could destroy something; writes nothing.

  Refused: an empty path, a file, a directory in `protect` or inside one (what the export reads: the run's
  workdir, the source checkpoint), a training run's workdir (always: the export's config.json would replace the
  run's), and a non-empty directory unless `overwrite` (then the files an export writes are replaced, others are
  left as they are). A missing or empty directory is fine.
  """
  if not out_dir:
    raise ConfigError("the export directory is empty; pass a directory to write, e.g. --out=exports/model")
  for source in protect:
    if source and is_within(out_dir, source):
      where = "is" if os.path.realpath(out_dir) == os.path.realpath(source) else "is inside"
      raise ConfigError(f"{out_dir}: {where} {source}, which the export reads (its files would be replaced); pass a "
                        "directory outside it")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ConfigError(f"{out_dir}: exists and is not a directory; pass a new or empty directory as --out")
  if not os.path.isdir(out_dir):
    return
  if looks_like_run_workdir(out_dir):
    raise ConfigError(f"{out_dir}: is a training run's workdir (it has {' or '.join(RUN_WORKDIR_MARKERS)}); exporting "
                      "there would replace the run's config.json; pass a new or empty directory as --out")
  if not overwrite:
    try:
      entries = sorted(os.listdir(out_dir))
    except OSError as e:
      raise ConfigError(f"{out_dir}: cannot list the export directory ({e.strerror or type(e).__name__})") from None
    if entries:
      shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
      count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
      raise ConfigError(f"{out_dir}: not empty ({count}: {shown}); pass a new or empty directory, or --overwrite "
                        "(overwrite=True) to replace the exported files in it")


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
      with open(src, "rb") as f:  # through a fresh temporary file: a link at `dst` is refused, never followed
        write_atomic(dst, f.read())
    written.append(dst)
  return written


def export_peft(model: nnx.Module, out_dir: str, base_model_name_or_path: str | None,
                tokenizer_path: str | None = None, *, overwrite: bool = False) -> dict[str, Any]:
  """Writes the adapters of a LoRA-wrapped `model` as a PEFT adapter directory; returns the written paths.

  `base_model_name_or_path`: the HF checkpoint the adapter applies to (recorded in adapter_config.json, which is
  where `PeftModel`/`AutoPeftModel` look for the base). `overwrite`: allow a non-empty `out_dir` (`check_out_dir`).
  """
  if not has_lora(model):
    raise AdapterError("the model has no LoRA adapters: export it with format 'merged' instead")
  check_out_dir(out_dir, overwrite=overwrite)
  written: dict[str, Any] = peft_io.save_adapter(model, out_dir, base_model_name_or_path)
  if tokenizer_path:
    written["tokenizer"] = copy_tokenizer(tokenizer_path, out_dir)
  return written


def export_merged(model: nnx.Module, out_dir: str, dtype: str = "bfloat16",
                  generation_defaults: Mapping[str, Any] | SamplingConfig | None = None,
                  tokenizer_path: str | None = None, vision_source: str | None = None, *,
                  overwrite: bool = False, quantize: str | None = None) -> dict[str, Any]:
  """Writes a full HF checkpoint (`config.json`, safetensors, `generation_config.json`, tokenizer).

  Adapters, if any, are folded in as the tensors are written (`hf_write.save_merged`: the model as it is plus one
  merged tensor on the host, one layer on a device; the same files as `save_pretrained(lora.merge(model))`). `dtype`: 'bfloat16'
  (default, serving) or 'float32'.
  `quantize`: 'fp8' / 'nvfp4' (attention, dense MLP and experts in compressed-tensors FP8 / NVFP4, the layout vLLM
  loads) or 'fp8-linear' / 'nvfp4-linear' (experts dense: what transformers loads); `interop.quantized_export`.
  `vision_source`: a HF checkpoint whose vision tower is copied (default: a tiny stub; see `hd.save_pretrained`).
  `overwrite`: allow a non-empty `out_dir` (`check_out_dir`; never a run's workdir or the `vision_source`).
  """
  if dtype not in MERGED_DTYPES:
    raise ConfigError(f"dtype={dtype!r}; expected one of {MERGED_DTYPES}")
  gen = generation_config(model.config, generation_defaults)  # validate before writing anything
  vision = (vision_source,) if vision_source and os.path.isdir(vision_source) else ()
  check_out_dir(out_dir, overwrite=overwrite, protect=vision)  # its vision tower is read while writing
  hf_write.save_merged(model, out_dir, dtype=dtype, vision_source=vision_source, quantize=quantize)
  path = write_json(os.path.join(out_dir, GENERATION_CONFIG_NAME), gen)
  written: dict[str, Any] = {"checkpoint": out_dir, "generation_config": path}
  if tokenizer_path:
    written["tokenizer"] = copy_tokenizer(tokenizer_path, out_dir)
  return written


EXPORT_FORMATS = ("peft", "merged")


def export_model(model: nnx.Module, out_dir: str, format: str, *, base: str | None = None,  # noqa: A002
                 tokenizer_path: str | None = None, generation_defaults: Mapping[str, Any] | None = None,
                 vision_source: str | None = None, dtype: str = "bfloat16", overwrite: bool = False,
                 what: str = "the model", quantize: str | None = None) -> dict[str, Any]:
  """`export_peft` (format 'peft': the adapters against `base`, a HF directory or Hub id) or `export_merged`
  (format 'merged'), the one dispatch of the `export` CLI and `hd.SFTTrainer.export`. One-line ConfigError for
  an unknown format, a model without adapters exported as 'peft', or a PEFT export without a base (`what` names
  the model in those messages)."""
  if format not in EXPORT_FORMATS:
    raise ConfigError(f"format={format!r}; expected one of {EXPORT_FORMATS}")
  if quantize is not None and format != "merged":
    raise ConfigError(f"--quantize={quantize} goes with format 'merged' (a PEFT adapter stays float32)")
  if format == "peft":
    if not has_lora(model):
      raise ConfigError(f"{what} has no LoRA adapters; use format 'merged'")
    if not base:
      raise ConfigError(f"{what} was not fine-tuned from a HF checkpoint, so there is no base model for a PEFT "
                        "adapter; name one (--base_model / base=) or use format 'merged'")
    return export_peft(model, out_dir, base, tokenizer_path=tokenizer_path, overwrite=overwrite)
  return export_merged(model, out_dir, dtype=dtype, generation_defaults=generation_defaults,
                       tokenizer_path=tokenizer_path, vision_source=vision_source, overwrite=overwrite,
                       quantize=quantize)


__all__ = ["EXPORT_FORMATS", "GENERATION_CONFIG_NAME", "RUN_WORKDIR_MARKERS", "check_out_dir", "copy_tokenizer",
           "export_merged", "export_model", "export_peft", "generation_config", "is_within", "looks_like_run_workdir"]
