"""Export a fine-tuned model for serving: a PEFT adapter or a merged Hugging Face checkpoint.

  python -m hackable_diffusion.export --workdir=runs/sudoku --out=DIR --format=peft|merged [--dtype=bfloat16]
      [--quantize=fp8|nvfp4|fp8-linear|nvfp4-linear]
      [--step=N] [--base_model=HF_DIR_OR_HUB_ID]
  python -m hackable_diffusion.export --checkpoint=HF_DIR [--adapter=PEFT_DIR] --out=DIR --format=peft|merged

From a workdir: the checkpoint of `--step` (default: the latest) of a run of `hackable_diffusion.train`, with the
run's tokenizer and its evaluation sampler settings as generation defaults. `--format=peft` of a workdir reads the
adapters alone (`runs.run.load_run_adapters`): the base model is never loaded. `--format=merged` folds the adapters
in as it writes (the model plus one merged tensor on the host, one layer on a device: `interop.hf_write.save_merged`).
From `--checkpoint`: a HF DiffusionGemma directory, optionally with a PEFT adapter on top (e.g. to merge an
adapter trained elsewhere).

`--format=merged` folds the adapters into the weights (each update once; PEFT's `merge_and_unload()` is wrong on
this model, see docs/lora.md) and writes config.json + safetensors (`--dtype`, default bfloat16) +
generation_config.json + tokenizer: what transformers and vLLM load (`--quantize`: compressed-tensors FP8 or NVFP4,
`interop.quantized_export`). `--format=peft` writes
adapter_model.safetensors + adapter_config.json for `PeftModel.from_pretrained(base, DIR)`; the base is the run's
`model.checkpoint` (or `--checkpoint`) unless `--base_model` says otherwise.

`--out` must be a new or empty directory (`--overwrite` allows a non-empty one, replacing the exported files in
it), and never a run's workdir, the `--workdir` itself or a directory inside it, or the `--checkpoint` /
`--adapter` being read: those are refused with one line before anything is loaded or written.
"""

from __future__ import annotations

import os

from absl import flags

from hackable_diffusion import cli
from hackable_diffusion.errors import ConfigError

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by hackable_diffusion.train.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of --workdir (default: the latest).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A HF DiffusionGemma directory (instead of --workdir).")
_ADAPTER = flags.DEFINE_string("adapter", None, "A PEFT LoRA adapter directory applied on top of --checkpoint.")
_OUT = flags.DEFINE_string("out", None, "Output directory.")
_FORMAT = flags.DEFINE_enum("format", None, ["peft", "merged"], "peft: adapter files; merged: a full checkpoint.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32", "float16"],
                           "Storage dtype of a merged checkpoint (adapters are written in float32).")
_QUANTIZE = flags.DEFINE_enum(
    "quantize", None, ["fp8", "nvfp4", "fp8-linear", "nvfp4-linear"],
    "--format=merged only: write the attention and dense MLP projections and the experts in compressed-tensors FP8 "
    "(per-channel weight scales, dynamic activations: vLLM's 'FP8 dynamic') or NVFP4 (weights only); the experts "
    "one tensor per expert, as vLLM loads them. The '-linear' modes keep the experts dense: what transformers + "
    "compressed-tensors load.")
_BASE = flags.DEFINE_string("base_model", None, "base_model_name_or_path recorded in adapter_config.json.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer file or directory to include (default: the run's, "
                                 "or the tokenizer files of --checkpoint).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Allow a non-empty --out (the exported files in it are "
                               "replaced); a run's workdir is refused even so.")


def check_out(out: str, *, workdir: str | None = None, sources: tuple[str, ...] = (), overwrite: bool = False) -> None:
  """Refuses (one-line ConfigError, nothing written) an `--out` that would damage a run or a source, or replace
  files without `overwrite`: `workdir` or a directory inside it, a `sources` directory (`--checkpoint`,
  `--adapter`) or inside one, any run's workdir (`runs.run.is_run_workdir`), then `check_out_dir`'s rules."""
  from hackable_diffusion.interop import export as export_lib
  from hackable_diffusion.runs import run as run_lib

  if workdir and export_lib.is_within(out, workdir):
    raise ConfigError(f"--out={out} is inside the run being exported (--workdir={workdir}); exporting there would "
                      "replace the run's config.json; pass an --out outside the workdir")
  if os.path.isdir(out) and run_lib.is_run_workdir(out):
    raise ConfigError(f"--out={out} is a training run's workdir; exporting there would replace its config.json; "
                      "pass a new or empty directory")
  export_lib.check_out_dir(out, overwrite=overwrite, protect=[s for s in sources if s and os.path.isdir(s)])


def _source() -> dict:
  """The model to export and what goes with it: model, base, tokenizer, vision source, generation defaults."""
  if bool(_WORKDIR.value) == bool(_CHECKPOINT.value):
    raise ConfigError("give exactly one of --workdir (a training run) and --checkpoint (a HF directory)")
  if _WORKDIR.value:
    if _ADAPTER.value:
      raise ConfigError("--adapter goes with --checkpoint; a workdir carries its own adapters")
    if not os.path.isdir(_WORKDIR.value):
      raise ConfigError(f"--workdir={_WORKDIR.value}: no such directory")
    from hackable_diffusion.data.tokenizer import find_tokenizer_file
    from hackable_diffusion.runs import run as run_lib

    if _FORMAT.value == "peft":  # the adapters alone: the base is never read (a LoRA checkpoint holds none)
      run = run_lib.load_run_adapters(_WORKDIR.value, step=_STEP.value, trust_remote_code=cli.trust_requested())
    else:
      run = run_lib.load_run(_WORKDIR.value, step=_STEP.value, trust_remote_code=cli.trust_requested())
    cfg = run.config
    # the workdir itself: copy_tokenizer copies tokenizer.json/.model, tokenizer_config.json, chat_template.jinja
    has_tok = find_tokenizer_file(_WORKDIR.value) is not None
    return dict(model=run.model, base=cfg.model.checkpoint or None, tokenizer=_WORKDIR.value if has_tok else None,
                vision=cfg.model.checkpoint or None,
                defaults=run_lib.generation_defaults(cfg, run.model.config),
                what=f"{_WORKDIR.value} step {run.step}" + (f" (preset {cfg.model.preset!r})" if cfg.model.preset
                                                            else ""))
  if _STEP.value is not None:
    raise ConfigError("--step goes with --workdir")
  from hackable_diffusion.interop import export as export_lib
  from hackable_diffusion.interop.hf import load_pretrained

  model = load_pretrained(_CHECKPOINT.value, adapter=_ADAPTER.value)
  has_tok = any(os.path.isfile(os.path.join(_CHECKPOINT.value, n)) for n in export_lib.TOKENIZER_FILES)
  what = _CHECKPOINT.value + (f" + {_ADAPTER.value}" if _ADAPTER.value else "")
  return dict(model=model, base=_CHECKPOINT.value, tokenizer=_CHECKPOINT.value if has_tok else None,
              vision=_CHECKPOINT.value, defaults=None, what=what)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise ConfigError(f"unexpected arguments {argv[1:]}; flags look like --name=value")
  if not _OUT.value:
    raise ConfigError("--out is required (the directory to write)")
  if not _FORMAT.value:
    raise ConfigError("--format is required: 'peft' (adapter files) or 'merged' (a full checkpoint)")
  if _QUANTIZE.value and _FORMAT.value != "merged":
    raise ConfigError(f"--quantize={_QUANTIZE.value} goes with --format=merged (a PEFT adapter stays float32)")
  check_out(_OUT.value, workdir=_WORKDIR.value, sources=(_CHECKPOINT.value or "", _ADAPTER.value or ""),
            overwrite=_OVERWRITE.value)  # before the (slow) load
  from hackable_diffusion.interop import export as export_lib
  from hackable_diffusion.lora import has_lora

  src = _source()
  written = export_lib.export_model(src["model"], _OUT.value, _FORMAT.value, base=_BASE.value or src["base"],
                                    tokenizer_path=_TOKENIZER.value or src["tokenizer"],
                                    generation_defaults=src["defaults"], vision_source=src["vision"],
                                    dtype=_DTYPE.value, overwrite=_OVERWRITE.value, what=src["what"],
                                    quantize=_QUANTIZE.value)
  if _FORMAT.value == "peft":
    print(f"wrote a PEFT adapter of {src['what']} (base {_BASE.value or src['base']}) to {_OUT.value}")
  else:
    merged = " (adapters merged)" if has_lora(src["model"]) else ""
    quant = f" (quantized: {_QUANTIZE.value})" if _QUANTIZE.value else ""
    print(f"wrote a {_DTYPE.value} HF checkpoint of {src['what']}{merged}{quant} to {_OUT.value}")
  for key, value in written.items():
    print(f"  {key}: {value}")


def run() -> None:
  cli.run_cli(main)


if __name__ == "__main__":
  run()
