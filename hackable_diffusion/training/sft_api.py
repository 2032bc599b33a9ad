"""`hd.SFTTrainer`: fine-tuning from Python in a few lines, on the trainer the CLI runs.

    import hackable_diffusion as hd

    trainer = hd.SFTTrainer(model="path/or/hub-id", train_dataset="train.jsonl",
                            args=hd.SFTConfig(max_steps=200, learning_rate=1e-4, output_dir="runs/my_sft"),
                            peft_config=hd.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    out = trainer.train(); trainer.evaluate()     # out.global_step, out.training_loss; trainer.state.log_history
    trainer.save_model()                          # the adapter (LoRA) or the merged model, in output_dir/final
    trainer.export("out/merged")

TRL's names and conventions are accepted (see `SFTTrainer` and `SFTConfig`); settings can also be keywords:
`hd.SFTTrainer(model=..., dataset_path="train.jsonl", batch_size=8, learning_rate=1e-4, num_steps=1000).train()`.
The arguments become the experiment config of `runs/config.py` (`SFTConfig.experiment_sections` plus the
model, data and task below), written as `output_dir/config.json` like a CLI run's, and `training.trainer.Trainer`
runs it: same checkpoints, resume, evaluation and errors. `SFTTrainer.from_config(file_or_dict, output_dir)` takes a
config file (`sudoku.py`, a path, or a ConfigDict) instead - the CLI's input.

model: a Hugging Face DiffusionGemma directory or Hub id (fine-tuning), a previous run's workdir (its latest
  checkpoint as the base), a `ModelConfig` (a fresh init of exactly that config) or a `DiffusionGemma` module (its
  weights are saved once as `output_dir/base_model`, a HF checkpoint, so that a rerun resumes from the same base).
train_dataset / eval_dataset: a JSONL path, or records (a list of dicts, a grain data source / MapDataset, any
  finite iterable of dicts with the prompt/completion keys or chat `messages`), written once as
  `output_dir/data/<split>-<hash>.jsonl`.
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
import time
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections
from flax import nnx

from hackable_diffusion.data.tokenizer import TOKENIZER_FILENAME, Tokenizer
from hackable_diffusion.errors import CheckpointError, ConfigError, DataError
from hackable_diffusion.files import makedirs_no_link, write_atomic
from hackable_diffusion.hub import resolve_model_path
from hackable_diffusion.interop import export as export_lib
from hackable_diffusion.interop.hf import save_pretrained
from hackable_diffusion.lora.adapters import LoraConfig
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion.model.transformer import DiffusionGemma
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.runs.checkpoints import CHECKPOINT_DIR
from hackable_diffusion.training import trainer as trainer_lib
from hackable_diffusion.training.sft_config import SFTConfig, unknown_setting_error

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
    makedirs_no_link(os.path.dirname(path))
    write_atomic(path, text)  # never through a link planted at its name
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


def _canvas_length(model: Any, args: SFTConfig) -> int:
  """The model's completion canvas length (for `SFTConfig.max_length`)."""
  if "canvas_length" in args.model_overrides:
    return int(args.model_overrides["canvas_length"])
  if isinstance(model, ModelConfig):
    return model.canvas_length
  if isinstance(model, DiffusionGemma):
    return model.config.canvas_length
  local = resolve_model_path(os.fspath(model))
  if run_lib.is_run_workdir(local):
    raise ConfigError(f"SFTConfig.max_length={args.max_length}: with a run's workdir as the model give "
                      "max_prompt_length instead (the canvas length is the run's)")
  return ModelConfig.from_pretrained(local).canvas_length


def _count_records(path: str) -> int:
  with open(path, encoding="utf-8") as f:
    return sum(1 for line in f if line.strip())


def resolve_args(model: Any, train_path: str, args: SFTConfig) -> SFTConfig:
  """`args` with the settings that depend on the model or the data resolved: max_steps from num_train_epochs
  (the records of `train_path`) and max_prompt_length from max_length (the model's canvas length)."""
  if args.max_steps is None:
    args = args.with_num_records(_count_records(train_path))
  if args.max_length is not None:
    args = args.with_canvas_length(_canvas_length(model, args))
  return args


def experiment_config(model: Any, train_dataset: Any, args: SFTConfig, *, eval_dataset: Any = None,
                      task: str | None = None, task_args: Mapping[str, Any] | None = None
                      ) -> config_lib.ExperimentConfig:
  """The experiment config the arguments of `SFTTrainer` mean (validated; writes only data/base-model files)."""
  return _experiment_config(model, train_dataset, args, eval_dataset=eval_dataset, task=task, task_args=task_args)[0]


def _experiment_config(model: Any, train_dataset: Any, args: SFTConfig, *, eval_dataset: Any, task: str | None,
                       task_args: Mapping[str, Any] | None) -> tuple[config_lib.ExperimentConfig, SFTConfig]:
  """(the experiment config, `args` resolved by `resolve_args`)."""
  output_dir = os.path.abspath(args.output_dir)
  train_path = dataset_path(train_dataset, args, output_dir, "train")
  args = resolve_args(model, train_path, args)
  model_section, found_tokenizer = _model_section(model, args, output_dir)
  tokenizer_path = args.tokenizer or found_tokenizer
  sections = args.experiment_sections()
  sections["model"] = model_section
  sections["tokenizer"]["path"] = tokenizer_path or "train"
  sections["data"].update(train_path=train_path,
                          validation_path="" if eval_dataset is None else dataset_path(eval_dataset, args, output_dir,
                                                                                       "validation"),
                          add_bos=_add_bos(args, tokenizer_path, bool(model_section["checkpoint"])))
  sections["eval"].update(task=task or "text", task_args=dict(task_args or {}))
  return config_lib.ExperimentConfig.from_config_dict(sections), args


# ---- TRL-style pieces: processing_class, peft_config, callbacks, state, train() output ------------------------
_TRL_UNSUPPORTED = {
    "data_collator": "batches are built by the data pipeline (left-padded prompt + completion canvases)",
    "formatting_func": "use SFTConfig.chat_template, or write the formatted prompt/completion records",
    "compute_metrics": "evaluation uses the task's metrics (task=, task_args=)",
    "optimizers": "the optimizer is AdamW with the SFTConfig schedule",
    "preprocess_logits_for_metrics": "evaluation samples with the diffusion sampler, it has no logits hook",
    "compute_loss_func": "the loss is SFTConfig.loss (a LossConfig)",
    "model_init": "pass the model itself",
}
TOKENIZER_FILES = (TOKENIZER_FILENAME, "tokenizer.json")
PROCESSING_CLASS_DIR = "processing_class"  # where a Tokenizer object given as processing_class is saved
FINAL_DIR = "final"  # save_model()'s default folder inside output_dir


def _tokenizer_path(processing_class: Any, output_dir: str) -> str:
  """What `processing_class` means as SFTConfig.tokenizer: a path, our Tokenizer (saved under output_dir) or a
  transformers tokenizer loaded from a local directory (its `name_or_path`)."""
  if isinstance(processing_class, (str, os.PathLike)):
    return os.fspath(processing_class)
  if isinstance(processing_class, Tokenizer):
    return processing_class.save(os.path.join(output_dir, PROCESSING_CLASS_DIR))
  name = getattr(processing_class, "name_or_path", None)
  if isinstance(name, str) and os.path.isdir(name) and any(
      os.path.isfile(os.path.join(name, f)) for f in TOKENIZER_FILES):
    return os.path.abspath(name)
  raise ConfigError(f"processing_class={type(processing_class).__name__}: expected a tokenizer path, a "
                    "hd Tokenizer, or a transformers tokenizer loaded from a local directory with tokenizer files "
                    f"(its name_or_path is {name!r})")


def _lora_config(peft_config: Any) -> LoraConfig:
  """`peft_config` as our LoraConfig: ours as it is, a `peft.LoraConfig` by its r / lora_alpha / lora_dropout /
  target_modules (duck-typed: peft is not imported here)."""
  if isinstance(peft_config, LoraConfig):
    return peft_config
  if all(hasattr(peft_config, k) for k in ("r", "lora_alpha", "lora_dropout", "target_modules")):
    targets = peft_config.target_modules
    if targets is None:
      raise ConfigError("peft_config.target_modules=None: name the modules (e.g. ['q_proj', 'v_proj']) or "
                        "'all-linear'")
    if getattr(peft_config, "use_rslora", False) or getattr(peft_config, "use_dora", False):
      raise ConfigError("peft_config: use_rslora / use_dora are not supported (plain LoRA, scale = alpha / r)")
    return LoraConfig(r=peft_config.r, lora_alpha=peft_config.lora_alpha, lora_dropout=peft_config.lora_dropout,
                      target_modules=targets if isinstance(targets, str) else sorted(targets))
  raise ConfigError(f"peft_config={type(peft_config).__name__}: expected a hd.LoraConfig (or a peft.LoraConfig)")


@dataclasses.dataclass
class TrainerControl:
  """transformers' `TrainerControl` flags a callback may set; `should_training_stop` stops `train()` after the
  current step (a checkpoint of it is saved); the other flags are accepted and not acted on."""

  should_training_stop: bool = False
  should_epoch_stop: bool = False
  should_save: bool = False
  should_evaluate: bool = False
  should_log: bool = False


@dataclasses.dataclass
class TrainerState:
  """transformers' `TrainerState` fields callbacks read: global_step, max_steps, epoch (records seen / records),
  log_history (a dict per log: `step` and the logged metrics, `learning_rate` = `lr`; evaluation entries hold
  `eval/<run>/<metric>`), is_world_process_zero. log_history holds this object's `train()` / `evaluate()` calls
  (a resumed run's earlier logs are in output_dir/metrics.jsonl)."""

  global_step: int = 0
  max_steps: int = 0
  epoch: float = 0.0
  num_train_records: int = 0
  train_batch_size: int = 0
  log_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  is_world_process_zero: bool = True
  is_local_process_zero: bool = True


@dataclasses.dataclass(frozen=True)
class TrainOutput:
  """What `train()` returns (transformers' `TrainOutput` fields): global_step, training_loss (the mean of the
  losses logged by this call) and metrics (the last logged metrics, `train_loss` and `train_runtime`).
  `output['loss']` reads `output.metrics['loss']`."""

  global_step: int
  training_loss: float
  metrics: dict[str, float]

  def __getitem__(self, key: str) -> float:
    return self.metrics[key]

  def keys(self):
    return self.metrics.keys()


class _WandbCallback:
  """`report_to='wandb'`: the logged and evaluation metrics to Weights & Biases (a run started at the first log)."""

  def __init__(self, output_dir: str):
    self._output_dir = output_dir
    self._run = None

  def _log(self, values: Mapping[str, Any], step: int) -> None:
    import wandb  # optional dependency; SFTConfig checked that it is installed

    if self._run is None:
      self._run = wandb.run or wandb.init(dir=self._output_dir, name=os.path.basename(self._output_dir))
    self._run.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

  def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ARG002 - the callback signature
    self._log(logs or {}, state.global_step)

  def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # noqa: ARG002
    self._log(metrics or {}, state.global_step)


# ---- the trainer ------------------------------------------------------------------------------------------------
class SFTTrainer:
  """Supervised fine-tuning from Python (see the module docstring); the engine is `training.trainer.Trainer`.

  TRL's form: `SFTTrainer(model, args=SFTConfig(...), train_dataset=..., eval_dataset=..., peft_config=LoraConfig,
  processing_class=tokenizer, callbacks=[...])`. Settings may also be given as keywords (`batch_size=8,
  learning_rate=1e-4`: SFTConfig fields, on top of `args`), with `dataset_path` = train_dataset and `num_steps` =
  max_steps. peft_config: a hd.LoraConfig or a peft.LoraConfig (= SFTConfig.lora). processing_class: a tokenizer
  path, a hd Tokenizer, or a transformers tokenizer loaded from a local directory (= SFTConfig.tokenizer).
  callbacks: objects with any of transformers' `on_train_begin / on_log / on_step_end / on_evaluate /
  on_train_end(args, state, control, **kwargs)` methods (a `transformers.TrainerCallback` works; duck-typed).
  """

  def __init__(self, model: Any, args: SFTConfig | None = None, train_dataset: Any = None, eval_dataset: Any = None,
               peft_config: Any = None, processing_class: Any = None, callbacks: Iterable[Any] | None = None, *,
               task: str | None = None, task_args: Mapping[str, Any] | None = None, progress: bool | None = None,
               dataset_path: Any = None, num_steps: int | None = None, **settings: Any):
    if args is not None and not isinstance(args, SFTConfig):
      if train_dataset is None and isinstance(args, (str, os.PathLike, list, tuple)):
        args, train_dataset = None, args  # the earlier positional form SFTTrainer(model, train_dataset)
      else:
        raise ConfigError(f"args={type(args).__name__}: expected a hd.SFTConfig")
    for key in settings:
      if key in _TRL_UNSUPPORTED:
        raise ConfigError(f"SFTTrainer: {key} is not supported: {_TRL_UNSUPPORTED[key]}")
      if key not in {f.name for f in dataclasses.fields(SFTConfig)}:
        raise ConfigError(unknown_setting_error("SFTTrainer", key, [f.name for f in dataclasses.fields(SFTConfig)]))
    if dataset_path is not None:
      if train_dataset is not None:
        raise ConfigError("SFTTrainer: give train_dataset or dataset_path, not both")
      train_dataset = dataset_path
    if num_steps is not None:
      if "max_steps" in settings:
        raise ConfigError("SFTTrainer: give max_steps or num_steps, not both")
      settings["max_steps"] = num_steps
    if train_dataset is None:
      raise ConfigError("SFTTrainer: train_dataset is required (a JSONL path or records)")
    args = args or SFTConfig()
    if settings:
      args = args.replace(**settings)
    output_dir = os.path.abspath(args.output_dir)
    if peft_config is not None:
      if args.lora is not None:
        raise ConfigError("SFTTrainer: give peft_config or SFTConfig.lora, not both")
      args = args.replace(lora=_lora_config(peft_config))
    if processing_class is not None:
      path = _tokenizer_path(processing_class, output_dir)
      if args.tokenizer and os.path.abspath(args.tokenizer) != os.path.abspath(path):
        raise ConfigError(f"SFTTrainer: processing_class ({path}) and SFTConfig.tokenizer ({args.tokenizer}) "
                          "disagree; give one")
      args = args.replace(tokenizer=path)
    self.config, self.args = _experiment_config(model, train_dataset, args, eval_dataset=eval_dataset, task=task,
                                                task_args=task_args)
    self._init_common(output_dir, progress, callbacks)
    self.state.num_train_records = _count_records(self.config.data.train_path)
    if self.args.wandb:
      self.callbacks.append(_WandbCallback(self.output_dir))

  def _init_common(self, output_dir: str, progress: bool | None, callbacks: Iterable[Any] | None) -> None:
    self.output_dir = output_dir
    self._progress = progress
    self._engine: trainer_lib.Trainer | None = None
    self.callbacks = list(callbacks or [])
    self.state = TrainerState(max_steps=self.config.train.steps, train_batch_size=self.config.train.batch_size)
    self.control = TrainerControl()

  @classmethod
  def from_config(cls, config: str | ml_collections.ConfigDict | Mapping[str, Any], output_dir: str, *,
                  overrides: Mapping[str, Any] | None = None, progress: bool | None = None,
                  callbacks: Iterable[Any] | None = None) -> SFTTrainer:
    """The trainer of a config file (a path or a shipped name such as 'sudoku.py', `{'a.b': value}` overrides)
    or of a ConfigDict: what `python -m hackable_diffusion.train --config=...` runs."""
    if isinstance(config, str):
      config = config_lib.load_config_file(config, overrides)
    elif overrides:
      raise ConfigError("overrides go with a config file; change the ConfigDict itself")
    self = cls.__new__(cls)
    self.args = None
    self.config = run_lib.as_experiment_config(config)
    self._init_common(os.path.abspath(output_dir), progress, callbacks)
    return self

  # ---- the engine ---------------------------------------------------------------------------------------------
  @property
  def trainer(self) -> trainer_lib.Trainer:
    """The engine (created and locking `output_dir` at first use)."""
    if self._engine is None:
      self._engine = trainer_lib.Trainer(self.config, self.output_dir, progress=self._progress)
      self._engine.on_event = self._on_event
      self._engine.tensorboard = self.args is None or self.args.tensorboard
      self.state.global_step = self._engine.step
    return self._engine

  @property
  def model(self) -> nnx.Module:
    """The current model (adapters included)."""
    return self.trainer.model()

  @property
  def tokenizer(self) -> Tokenizer:
    return self.trainer.tokenizer

  processing_class = tokenizer

  # ---- callbacks ----------------------------------------------------------------------------------------------
  def add_callback(self, callback: Any) -> None:
    self.callbacks.append(callback)

  def _call(self, event: str, **kwargs: Any) -> None:
    for callback in self.callbacks:
      method = getattr(callback, event, None)
      if method is not None:
        result = method(self.args, self.state, self.control, **kwargs)
        if isinstance(result, TrainerControl) or type(result).__name__ == "TrainerControl":
          self.control = result

  def _on_event(self, name: str, step: int, values: Mapping[str, Any]) -> bool:
    """The engine's events as callback calls and log_history entries; True: a callback asked to stop."""
    self.state.global_step = step
    if self.state.num_train_records:
      self.state.epoch = step * self.state.train_batch_size / self.state.num_train_records
    if name == "log":
      logs = dict(values)
      if "lr" in logs:
        logs["learning_rate"] = logs["lr"]
      self.state.log_history.append({"step": step, **logs})
      self._call("on_log", logs=logs)
    elif name == "evaluate":
      self.state.log_history.append({"step": step, **values})
      self._call("on_evaluate", metrics=dict(values))
    elif name == "step_end":
      self._call("on_step_end")
    return bool(self.control.should_training_stop)

  # ---- training and evaluation --------------------------------------------------------------------------------
  def train(self) -> TrainOutput:
    """Trains to `max_steps` (resuming from `output_dir`'s latest checkpoint); returns a `TrainOutput`."""
    engine = self.trainer
    first = len(self.state.log_history)
    self.control = TrainerControl()
    self._call("on_train_begin")
    start = time.perf_counter()
    last = engine.train()
    runtime = time.perf_counter() - start
    self.state.global_step = engine.step
    losses = [e["loss"] for e in self.state.log_history[first:] if "loss" in e]
    loss = float(sum(losses) / len(losses)) if losses else float("nan")
    self._call("on_train_end")
    return TrainOutput(global_step=engine.step, training_loss=loss,
                       metrics={**last, "train_loss": loss, "train_runtime": runtime})

  def evaluate(self) -> dict[str, Any]:
    """Evaluates the current model on `eval_dataset` (else the training data); returns the report (also written
    to `output_dir/eval/report_step_N.json`); its metrics (`eval/<run>/<metric>`) go to log_history and
    `on_evaluate`."""
    report = self.trainer.evaluate()
    values: dict[str, Any] = {}
    for run in report["runs"]:
      values.update({f"eval/{run['name']}/{k}": v for k, v in run["metrics"].items() if isinstance(v, float)})
      values[f"eval/{run['name']}/mean_denoising_steps"] = run["mean_denoising_steps"]
    self._on_event("evaluate", self.trainer.step, values)
    return report

  # ---- export -------------------------------------------------------------------------------------------------
  def save_model(self, output_dir: str | None = None) -> str:
    """What PEFT/TRL users expect: the adapter (a PEFT adapter directory) for a LoRA run, the merged model (a
    HF checkpoint in bfloat16) otherwise; into `output_dir` (default: `<args.output_dir>/final`), replacing the
    files an earlier save wrote. Returns the directory."""
    out = os.path.abspath(output_dir or os.path.join(self.output_dir, FINAL_DIR))
    inside = os.path.realpath(out).startswith(os.path.realpath(self.output_dir) + os.sep)
    fmt = "peft" if self.config.lora is not None else "merged"
    self._export(out, fmt, overwrite=True, protect_workdir=not inside)
    return out

  def save_adapter(self, out_dir: str, *, overwrite: bool = False) -> dict[str, Any]:
    """The LoRA adapters as a PEFT adapter directory (against the base checkpoint)."""
    return self.export(out_dir, format="peft", overwrite=overwrite)

  def export(self, out_dir: str, format: str = "merged", *, dtype: str = "bfloat16",  # noqa: A002
             base_model: str | None = None, overwrite: bool = False, quantize: str | None = None) -> dict[str, Any]:
    """Writes the current model as 'merged' (a full HF checkpoint, adapters folded in, `dtype`; `quantize='fp8'`:
    the linear layers in compressed-tensors FP8 for vLLM) or 'peft' (adapters only, against `base_model`, default
    the checkpoint trained from); as the `export` CLI does."""
    return self._export(out_dir, format, dtype=dtype, base_model=base_model, overwrite=overwrite, quantize=quantize)

  def _export(self, out_dir: str, format: str, *, dtype: str = "bfloat16", base_model: str | None = None,  # noqa: A002
              overwrite: bool = False, quantize: str | None = None, protect_workdir: bool = True) -> dict[str, Any]:
    engine = self.trainer
    cfg = engine.config
    # what the export reads: the run (its checkpoints, data and base model; the whole workdir unless the target is
    # save_model's folder inside it) and the checkpoint trained from
    run_parts = [self.output_dir] if protect_workdir else [
        os.path.join(self.output_dir, d) for d in (CHECKPOINT_DIR, run_lib.DATA_DIR, BASE_MODEL_DIR, run_lib.EVAL_DIR)]
    protect = run_parts + [cfg.model.checkpoint] * bool(cfg.model.checkpoint)
    export_lib.check_out_dir(out_dir, overwrite=overwrite, protect=[p for p in protect if os.path.isdir(p)])
    tokenizer = os.path.join(self.output_dir, TOKENIZER_FILENAME)
    return export_lib.export_model(
        engine.model(), out_dir, format, base=base_model or cfg.model.checkpoint or None,
        tokenizer_path=tokenizer if os.path.isfile(tokenizer) else None,
        generation_defaults=run_lib.generation_defaults(cfg, engine.model_config),
        vision_source=resolve_model_path(cfg.model.checkpoint) if cfg.model.checkpoint else None, dtype=dtype,
        overwrite=overwrite,
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


__all__ = ["BASE_MODEL_DIR", "FINAL_DIR", "SFTTrainer", "TrainOutput", "TrainerControl", "TrainerState",
           "dataset_path", "experiment_config", "resolve_args"]
