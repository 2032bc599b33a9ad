"""`hd.SFTTrainer`: fine-tuning from Python in a few lines, on the trainer the CLI runs.

    import hackable_diffusion as hd

    trainer = hd.SFTTrainer(model="path/or/hub-id", train_dataset="train.jsonl",
                            args=hd.SFTConfig(max_steps=200, learning_rate=1e-4, lora=hd.LoraConfig(rank=8),
                                              output_dir="runs/my_sft"))
    trainer.train(); trainer.evaluate()
    trainer.save_adapter("out/adapter"); trainer.export("out/merged")

The arguments become the experiment config of `runs/config.py` (`SFTConfig.experiment_sections` plus the
model, data and task below), written as `output_dir/config.json` like a CLI run's, and `training.trainer.SFTTrainer`
runs it: same checkpoints, resume, evaluation and errors. `SFTTrainer.from_config(file_or_dict, output_dir)` takes a
config file (`sudoku.py`, a path, or a ConfigDict) instead - the CLI's input.

model: a Hugging Face DiffusionGemma directory or Hub id (fine-tuning), a previous run's workdir (its latest
  checkpoint as the base), a `ModelConfig` (a fresh init of exactly that config) or a `DiffusionGemma` module (its
  weights are saved once as `output_dir/base_model`, a HF checkpoint, so that a rerun resumes from the same base).
train_dataset / eval_dataset: a JSONL path, or records (a list of dicts, a grain data source / MapDataset, any
  finite iterable of dicts with the prompt/completion keys or chat `messages`), written once as `output_dir/data/<split>-<hash>.jsonl`.
task: the evaluation task (a name in `tasks.base.BUILTIN_TASKS` or 'module:factory'; default 'text': exact match
  and character accuracy), with `task_args`.
The trainer is created at the first `train()` / `evaluate()` / `model` use and holds the output directory's lock
until `close()` (or the end of a `with` block, or garbage collection).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections
from flax import nnx

from hackable_diffusion.data.tokenizer import TOKENIZER_FILENAME, Tokenizer
from hackable_diffusion.errors import CheckpointError, ConfigError, DataError
from hackable_diffusion.hub import resolve_model_path
from hackable_diffusion.interop import export as export_lib
from hackable_diffusion.interop.hf import save_pretrained
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion.model.transformer import DiffusionGemma
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.training import trainer as trainer_lib
from hackable_diffusion.training.sft_config import SFTConfig

BASE_MODEL_DIR = "base_model"
_NON_HF_FIELDS = ("attention_structure", "moe_impl", "remat", "scan_layers", "matmul_dtype")  # not in config.json


# ---- model ------------------------------------------------------------------------------------------------------
def _model_section(model: Any, args: SFTConfig, output_dir: str) -> tuple[dict[str, Any], str]:
  """(`model` config section, the tokenizer path: '' = train a character model on the data)."""
  overrides = dict(args.model_overrides)
  if isinstance(model, ModelConfig):
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelConfig)}
    fields.update(overrides)
    fields = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in fields.items()}
    return {"preset": "tiny", "checkpoint": "", "dtype": args.dtype, "overrides": fields}, ""
  if isinstance(model, DiffusionGemma):
    path = _save_base(model, os.path.join(output_dir, BASE_MODEL_DIR))
    keep = {k: getattr(model.config, k) for k in _NON_HF_FIELDS}
    return {"preset": "", "checkpoint": path, "dtype": args.dtype, "overrides": {**keep, **overrides}}, ""
  if isinstance(model, (str, os.PathLike)):
    name = os.fspath(model)
    local = resolve_model_path(name)  # a Hub id: the local cache first (downloads only what is missing)
    checkpoint = os.path.abspath(local) if os.path.isdir(name) else name
    if run_lib.is_run_workdir(local):
      return {"preset": "", "checkpoint": checkpoint, "dtype": args.dtype, "overrides": overrides}, os.path.join(
          local, TOKENIZER_FILENAME)
    if not os.path.isfile(os.path.join(local, "config.json")):
      raise CheckpointError(f"{name}: no config.json; model= takes a Hugging Face DiffusionGemma directory or Hub id, "
                            "a training run's workdir, a hd.ModelConfig or a hd.DiffusionGemma")
    return {"preset": "", "checkpoint": checkpoint, "dtype": args.dtype, "overrides": overrides}, local
  raise ConfigError(f"model={type(model).__name__}: expected a checkpoint directory or Hub id, a run's workdir, a "
                    "hd.ModelConfig or a hd.DiffusionGemma")


def _save_base(model: DiffusionGemma, path: str) -> str:
  """Writes the module's weights once as a HF checkpoint; an existing one must hold the same config."""
  expected = model.config.to_hf_config(torch_dtype=model.config.param_dtype)
  config_path = os.path.join(path, "config.json")
  if os.path.isfile(config_path):
    with open(config_path, encoding="utf-8") as f:
      stored = json.load(f)
    if stored.get("text_config") != json.loads(json.dumps(expected.get("text_config"))):
      raise ConfigError(f"{path} holds the base model of an earlier run with another config; use a new output_dir "
                        "(or delete it to start over)")
    return path
  save_pretrained(model, path)
  return path


# ---- data -------------------------------------------------------------------------------------------------------
def _records(dataset: Any, what: str) -> list[dict[str, Any]]:
  """The records of a list / grain source (len + getitem) / iterable, each a dict."""
  if isinstance(dataset, Mapping):
    raise DataError(f"{what} is a dict; pass a list of records (dicts) or a JSONL path")
  if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
    items: Iterable[Any] = (dataset[i] for i in range(len(dataset)))
  elif isinstance(dataset, Iterable):
    items = dataset
  else:
    raise DataError(f"{what}={type(dataset).__name__}: expected a JSONL path, a list of dicts or a grain data source")
  out = []
  for i, record in enumerate(items):
    if not isinstance(record, Mapping):
      raise DataError(f"{what}[{i}] is a {type(record).__name__}, not a dict with the prompt/completion keys")
    out.append(dict(record))
  if not out:
    raise DataError(f"{what} has no records")
  return out


def _check_fields(records: list[dict[str, Any]], args: SFTConfig, what: str) -> None:
  """Each record is a prompt/completion pair of strings or a chat record (a list under `messages_field`)."""
  for i, record in enumerate(records):
    if isinstance(record.get(args.messages_field), list) and args.prompt_field not in record:
      continue  # a chat record: its messages are checked when the data is read (data/sft.py)
    for key in (args.prompt_field, args.completion_field):
      if not isinstance(record.get(key), str):
        got = "missing" if key not in record else f"a {type(record[key]).__name__}"
        raise DataError(f"{what}[{i}][{key!r}] is {got}, expected a string (keys: {sorted(record)[:6]}; "
                        f"SFTConfig.prompt_field / completion_field name them, or a chat record has "
                        f"{args.messages_field!r})")


def dataset_path(dataset: Any, args: SFTConfig, output_dir: str, split: str) -> str:
  """A JSONL path for `dataset`: as given, or its records written once to `output_dir/data/<split>-<hash>.jsonl`
  (named by content: rerunning with the same records reuses the file, other records get another file)."""
  if isinstance(dataset, (str, os.PathLike)):
    path = os.fspath(dataset)
    if not os.path.isfile(path):
      raise DataError(f"{split}_dataset={path}: no such file (a JSONL file of records, or pass the records)")
    return os.path.abspath(path)
  records = _records(dataset, f"{split}_dataset")
  _check_fields(records, args, f"{split}_dataset")
  try:
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
  except (TypeError, ValueError) as e:
    raise DataError(f"{split}_dataset: a record is not JSON-serialisable ({e})") from None
  digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
  path = os.path.join(output_dir, run_lib.DATA_DIR, f"{split}-{digest}.jsonl")
  if not os.path.isfile(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
    os.replace(tmp, path)
  return path


# ---- config -----------------------------------------------------------------------------------------------------
def _add_bos(args: SFTConfig, tokenizer_path: str, checkpoint: bool) -> bool:
  """`args.add_bos`, or (None) True for a pretrained checkpoint whose tokenizer has a bos token."""
  if args.add_bos is not None:
    return args.add_bos
  if not (checkpoint and tokenizer_path):
    return False
  try:
    return Tokenizer.load(tokenizer_path).bos_id >= 0
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"tokenizer {tokenizer_path}: {e}; pass SFTConfig(tokenizer=PATH)") from None


def experiment_config(model: Any, train_dataset: Any, args: SFTConfig, *, eval_dataset: Any = None,
                      task: str | None = None, task_args: Mapping[str, Any] | None = None) -> config_lib.ExperimentConfig:
  """The experiment config the arguments of `SFTTrainer` mean (validated; writes only data/base-model files)."""
  output_dir = os.path.abspath(args.output_dir)
  model_section, found_tokenizer = _model_section(model, args, output_dir)
  tokenizer_path = args.tokenizer or found_tokenizer
  sections = args.experiment_sections()
  sections["model"] = model_section
  sections["tokenizer"]["path"] = tokenizer_path or "train"
  sections["data"].update(train_path=dataset_path(train_dataset, args, output_dir, "train"),
                          validation_path="" if eval_dataset is None else dataset_path(eval_dataset, args, output_dir,
                                                                                       "validation"),
                          add_bos=_add_bos(args, tokenizer_path, bool(model_section["checkpoint"])))
  sections["eval"].update(task=task or "text", task_args=dict(task_args or {}))
  return config_lib.ExperimentConfig.from_config_dict(sections)


# ---- the trainer ------------------------------------------------------------------------------------------------
class SFTTrainer:
  """Supervised fine-tuning from Python (see the module docstring); the engine is `training.trainer.SFTTrainer`."""

  def __init__(self, model: Any, train_dataset: Any, *, args: SFTConfig | None = None, eval_dataset: Any = None,
               task: str | None = None, task_args: Mapping[str, Any] | None = None, progress: bool | None = None):
    if args is not None and not isinstance(args, SFTConfig):
      raise ConfigError(f"args={type(args).__name__}: expected a hd.SFTConfig")
    self.args = args or SFTConfig()
    self.config = experiment_config(model, train_dataset, self.args, eval_dataset=eval_dataset, task=task,
                                    task_args=task_args)
    self.output_dir = os.path.abspath(self.args.output_dir)
    self._progress = progress
    self._engine: trainer_lib.SFTTrainer | None = None

  @classmethod
  def from_config(cls, config: str | ml_collections.ConfigDict | Mapping[str, Any], output_dir: str, *,
                  overrides: Mapping[str, Any] | None = None, progress: bool | None = None) -> SFTTrainer:
    """The trainer of a config file (a path or a shipped name such as 'sudoku.py', `{'a.b': value}` overrides)
    or of a ConfigDict: what `python -m hackable_diffusion.train --config=...` runs."""
    if isinstance(config, str):
      config = config_lib.load_config_file(config, overrides)
    elif overrides:
      raise ConfigError("overrides go with a config file; change the ConfigDict itself")
    self = cls.__new__(cls)
    self.args = None
    self.config = run_lib.as_experiment_config(config)
    self.output_dir = os.path.abspath(output_dir)
    self._progress = progress
    self._engine = None
    return self

  # ---- the engine ---------------------------------------------------------------------------------------------
  @property
  def trainer(self) -> trainer_lib.SFTTrainer:
    """The engine (created and locking `output_dir` at first use)."""
    if self._engine is None:
      self._engine = trainer_lib.SFTTrainer(self.config, self.output_dir, progress=self._progress)
    return self._engine

  @property
  def model(self) -> nnx.Module:
    """The current model (adapters included)."""
    return self.trainer.model()

  @property
  def tokenizer(self) -> Tokenizer:
    return self.trainer.tokenizer

  def train(self) -> dict[str, float]:
    """Trains to `max_steps` (resuming from `output_dir`'s latest checkpoint); returns the last logged metrics."""
    return self.trainer.train()

  def evaluate(self) -> dict[str, Any]:
    """Evaluates the current model on `eval_dataset` (else the training data); returns the report (also written
    to `output_dir/eval/report_step_N.json`)."""
    return self.trainer.evaluate()

  # ---- export -------------------------------------------------------------------------------------------------
  def save_adapter(self, out_dir: str, *, overwrite: bool = False) -> dict[str, Any]:
    """The LoRA adapters as a PEFT adapter directory (against the base checkpoint)."""
    return self.export(out_dir, format="peft", overwrite=overwrite)

  def export(self, out_dir: str, format: str = "merged", *, dtype: str = "bfloat16",  # noqa: A002
             base_model: str | None = None, overwrite: bool = False, quantize: str | None = None) -> dict[str, Any]:
    """Writes the current model as 'merged' (a full HF checkpoint, adapters folded in, `dtype`; `quantize='fp8'`:
    the linear layers in compressed-tensors FP8 for vLLM) or 'peft' (adapters only, against `base_model`, default
    the checkpoint trained from); as the `export` CLI does."""
    engine = self.trainer
    cfg = engine.config
    protect = [self.output_dir] + [cfg.model.checkpoint] * bool(cfg.model.checkpoint)
    export_lib.check_out_dir(out_dir, overwrite=overwrite, protect=[p for p in protect if os.path.isdir(p)])
    tokenizer = os.path.join(self.output_dir, TOKENIZER_FILENAME)
    return export_lib.export_model(
        engine.model(), out_dir, format, base=base_model or cfg.model.checkpoint or None,
        tokenizer_path=tokenizer if os.path.isfile(tokenizer) else None,
        generation_defaults=run_lib.generation_defaults(cfg, engine.model_config),
        vision_source=resolve_model_path(cfg.model.checkpoint) if cfg.model.checkpoint else None, dtype=dtype, overwrite=overwrite,
        what=f"the model of {self.output_dir}", quantize=quantize)

  def close(self) -> None:
    """Releases the output directory (its lock) and the checkpointer."""
    if self._engine is not None:
      self._engine.close()
      self._engine = None

  def __enter__(self) -> SFTTrainer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


__all__ = ["BASE_MODEL_DIR", "SFTTrainer", "dataset_path", "experiment_config"]
