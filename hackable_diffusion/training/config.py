"""Experiment configs: ml_collections files -> typed, validated section objects; CLI flag plumbing.

A config file (`configs/*.py`) defines `get_config()` returning a `ConfigDict` with the sections below (every
section is optional; missing keys take the defaults of the typed objects). `ExperimentConfig.from_config_dict`
turns it into frozen dataclasses, rejecting unknown keys with a one-line `ConfigError` that lists the valid ones.

  model      preset | checkpoint, dtype, overrides (ModelConfig fields for a fresh init)
  tokenizer  path ('train' = a char model trained on the data, saved as workdir/tokenizer.model), model_type
  data       generator (+ generator_args) | train_path / validation_path, fields, chat_template, lengths
  diffusion  loss_variant, schedule, time_eps, self_conditioning_prob, encoder_ar_weight  (-> LossConfig)
  optimizer  peak_lr, end_lr_ratio, warmup_steps, decay_steps, schedule, b1, b2, eps, weight_decay, clip_norm
  train      steps, batch_size, grad_accum_steps, seed, log_every, checkpoint_every, keep_checkpoints, eval_every
  eval       task (+ task_args), split, num_examples, batch_size, step_budgets, early_stopping_steps, sampler knobs
  lora       enabled (the LoRA section; its other keys belong to hackable_diffusion.lora)
  mesh       data, fsdp, tensor, expert (device mesh; all 1 = one device), multi-host coordinator settings

CLIs parse `--config=FILE` with absl `config_flags.DEFINE_config_file`; `make_flags_parser` resolves a bare file
name into `configs/`, checks `--config.a.b=...` keys before absl sees them, and `run_cli` turns the project's
input errors into one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

from hackable_diffusion import sharding
from hackable_diffusion.data.sft import DataError
from hackable_diffusion.diffusion.loss import LossConfig
from hackable_diffusion.interop.hf import CheckpointError
from hackable_diffusion.model.config import ConfigError, ModelConfig
from hackable_diffusion.training.optimizer import OptimizerConfig
from hackable_diffusion.errors import TrainingError

CONFIG_FILENAME = "config.json"
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
SECTIONS = ("model", "tokenizer", "data", "diffusion", "optimizer", "train", "eval", "lora", "mesh")


# ---- sections ---------------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(section: str, name: str, v: Any, *, allow_zero: bool = False) -> None:
  if not _is_int(v) or v < (0 if allow_zero else 1):
    raise ConfigError(f"{section}.{name}={v!r}; expected an integer >= {0 if allow_zero else 1}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
  """Which network to train: a preset (fresh init) or a HF checkpoint directory (fine-tune).

  preset: a name in `hackable_diffusion.model.config.PRESETS` ('' when `checkpoint` is set).
  checkpoint: a HF DiffusionGemma directory loaded with `hd.load_pretrained` ('' for a fresh init).
  dtype: parameter dtype when loading a checkpoint ('float32' or 'bfloat16').
  overrides: ModelConfig fields. For a fresh init, `vocab_size` defaults to the tokenizer's size.
  """

  preset: str = "tiny"
  checkpoint: str = ""
  dtype: str = "float32"
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if bool(self.preset) == bool(self.checkpoint):
      raise ConfigError(f"model: set exactly one of model.preset ({self.preset!r}) and model.checkpoint "
                        f"({self.checkpoint!r})")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(self.overrides) - fields)
    if unknown:
      raise ConfigError(f"model.overrides has unknown key(s) {unknown}; valid keys: {sorted(fields)}")
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ConfigError(f"model.dtype={self.dtype!r}; expected 'float32', 'bfloat16' or 'float16'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerSection:
  """path: 'train' (train a SentencePiece model on the training data, saved as workdir/tokenizer.model) or the
  path of a tokenizer.model (or a directory holding one). model_type / vocab_size: for 'train' ('char' needs no
  vocab_size)."""

  path: str = "train"
  model_type: str = "char"
  vocab_size: int = 0

  def __post_init__(self):
    if not self.path:
      raise ConfigError("tokenizer.path is empty; use 'train' or the path of a tokenizer.model")
    if self.model_type not in ("char", "bpe", "unigram", "word"):
      raise ConfigError(f"tokenizer.model_type={self.model_type!r}; expected char, bpe, unigram or word")
    _positive_int("tokenizer", "vocab_size", self.vocab_size, allow_zero=True)
    if self.path == "train" and self.model_type != "char" and not self.vocab_size:
      raise ConfigError(f"tokenizer.vocab_size is required for tokenizer.model_type={self.model_type!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
  """SFT data: JSONL files with prompt/completion strings, or a built-in generator that writes them.

  generator: a task name (see `hackable_diffusion.evaluation.tasks.TASKS`) or 'module:factory' whose task writes
    train/validation JSONL into workdir/data ('' = use train_path / validation_path).
  generator_args: keyword arguments of that task.
  max_prompt_length / max_canvases: prompt tokens (left-padded) and completion canvases per example.
  pinned_field: '' or the JSON key of a '0'/'1' string marking completion tokens known at sampling time
    (infilling): never corrupted in training, pinned by the sampler in evaluation.
  """

  generator: str = ""
  generator_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  train_path: str = ""
  validation_path: str = ""
  prompt_field: str = "prompt"
  completion_field: str = "completion"
  chat_template: str = ""
  max_prompt_length: int = 128
  max_canvases: int = 1
  add_bos: bool = False
  append_eos: bool = True
  on_overlength: str = "error"
  on_malformed: str = "error"
  shuffle: bool = True
  prefetch_batches: int = 2
  pinned_field: str = ""

  def __post_init__(self):
    if not self.generator and not self.train_path:
      raise ConfigError("data: set data.train_path (a JSONL file) or data.generator (a built-in task)")
    for name in ("max_prompt_length", "max_canvases"):
      _positive_int("data", name, getattr(self, name))
    _positive_int("data", "prefetch_batches", self.prefetch_batches, allow_zero=True)
    if self.on_overlength not in ("error", "truncate"):
      raise ConfigError(f"data.on_overlength={self.on_overlength!r}; expected 'error' or 'truncate'")
    if self.on_malformed not in ("error", "skip"):
      raise ConfigError(f"data.on_malformed={self.on_malformed!r}; expected 'error' or 'skip'")
    if self.chat_template and "{prompt}" not in self.chat_template:
      raise ConfigError(f"data.chat_template={self.chat_template!r} must contain '{{prompt}}'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSection:
  """The loop. Intervals count optimizer steps; 0 disables periodic evaluation (it still runs at the end)."""

  steps: int = 1000
  batch_size: int = 8
  grad_accum_steps: int = 1
  seed: int = 0
  log_every: int = 50
  checkpoint_every: int = 500
  keep_checkpoints: int = 3
  eval_every: int = 0
  eval_at_end: bool = True
  async_checkpointing: bool = True

  def __post_init__(self):
    for name in ("steps", "batch_size", "grad_accum_steps", "log_every", "checkpoint_every", "keep_checkpoints"):
      _positive_int("train", name, getattr(self, name))
    _positive_int("train", "eval_every", self.eval_every, allow_zero=True)
    if not _is_int(self.seed):
      raise ConfigError(f"train.seed={self.seed!r}; expected an integer")
    if self.batch_size % self.grad_accum_steps:
      raise ConfigError(f"train.batch_size={self.batch_size} is not divisible by "
                        f"train.grad_accum_steps={self.grad_accum_steps}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection:
  """Generation-based evaluation: one run per step budget (early stopping off) and one with early stopping.

  task: metric task name or 'module:factory' ('' = the data generator's task, else 'text': exact match and
    character accuracy). task_args: its keyword arguments ('' task with a data generator reuses generator_args).
  split: 'validation' or 'train'. num_examples: examples generated (the first ones of the split).
  early_stopping_steps: the step cap of the early-stopping run. max_new_tokens: 0 = the data's completion
  capacity (max_canvases * canvas_length). The sampler knobs mean what they mean in `hd.SamplingConfig`.
  ablations: name -> task-argument overrides, each evaluated once at `ablation_steps` (fixed steps; 0 turns
  them off), e.g. `{'no_pins': {'pin_givens': False}}` reports Sudoku without pinning the givens.
  """

  task: str = ""
  task_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  split: str = "validation"
  num_examples: int = 128
  batch_size: int = 64
  step_budgets: tuple[int, ...] = (32, 64, 96)
  early_stopping_steps: int = 96
  max_new_tokens: int = 0
  entropy_bound: float = 0.1
  t_min: float = 0.4
  t_max: float = 0.8
  stability_threshold: int = 1
  confidence_threshold: float = 0.005
  seed: int = 0
  num_samples: int = 8
  ablation_steps: int = 0
  ablations: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "step_budgets", tuple(self.step_budgets))
    for name, args in self.ablations.items():
      if not hasattr(args, "items"):
        raise ConfigError(f"eval.ablations.{name}={args!r}; expected a mapping of task arguments to override")
    if not (_is_int(self.ablation_steps) and self.ablation_steps >= 0):
      raise ConfigError(f"eval.ablation_steps={self.ablation_steps!r}; expected an integer >= 0 (0: no ablation runs)")
    for name in ("num_examples", "batch_size", "early_stopping_steps"):
      _positive_int("eval", name, getattr(self, name))
    for name in ("max_new_tokens", "num_samples", "stability_threshold"):
      _positive_int("eval", name, getattr(self, name), allow_zero=True)
    if not all(_is_int(b) and b > 0 for b in self.step_budgets):
      raise ConfigError(f"eval.step_budgets={self.step_budgets!r}; expected positive integers")
    if self.split not in ("validation", "train", "test"):
      raise ConfigError(f"eval.split={self.split!r}; expected 'validation', 'test' (generated data) or 'train'")
    for name in ("entropy_bound", "t_min", "t_max", "confidence_threshold"):
      v = getattr(self, name)
      if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or v < 0:
        raise ConfigError(f"eval.{name}={v!r}; expected a number >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSection:
  """The device mesh of a sharded run (`hackable_diffusion.sharding`, docs/scaling.md); the fields of
  `sharding.MeshConfig`, with config-file friendly "unset" values.

  data, fsdp, tensor, expert: mesh axis sizes; -1 on one axis = all remaining devices. All 1 (the default) means
    no mesh: the run uses one device, exactly as without this section.
  coordinator_address, num_processes, process_id: join a multi-host job (one process per host); '' / 0 / -1 =
    take it from $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES / $JAX_PROCESS_ID.
  auto_distributed: let JAX detect the cluster (Cloud TPU pods, SLURM, Open MPI) instead.
  """

  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  expert: int = 1
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1
  auto_distributed: bool = False

  def __post_init__(self):
    if not isinstance(self.coordinator_address, str):
      raise ConfigError(f"mesh.coordinator_address={self.coordinator_address!r}; expected a 'host:port' string "
                        "('' = $JAX_COORDINATOR_ADDRESS)")
    _positive_int("mesh", "num_processes", self.num_processes, allow_zero=True)
    if not _is_int(self.process_id) or self.process_id < -1:
      raise ConfigError(f"mesh.process_id={self.process_id!r}; expected an integer >= 0 (-1 = $JAX_PROCESS_ID)")
    if not isinstance(self.auto_distributed, bool):
      raise ConfigError(f"mesh.auto_distributed={self.auto_distributed!r}; expected a bool")
    self.mesh_config()  # axis sizes: MeshConfig's one-line errors ("mesh.fsdp=0; ...")

  @property
  def enabled(self) -> bool:
    """Whether the config asks for a mesh (any axis other than 1) or for a multi-host job."""
    return (any(getattr(self, a) != 1 for a in sharding.MESH_AXES) or bool(self.coordinator_address)
            or self.num_processes > 1 or self.auto_distributed)

  def mesh_config(self) -> sharding.MeshConfig:
    return sharding.MeshConfig(
        data=self.data, fsdp=self.fsdp, tensor=self.tensor, expert=self.expert,
        coordinator_address=self.coordinator_address or None, num_processes=self.num_processes or None,
        process_id=None if self.process_id < 0 else self.process_id, auto_distributed=self.auto_distributed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
  """Every section of an experiment, typed and validated. `raw` is the resolved config as a plain dict."""

  model: ModelSection
  tokenizer: TokenizerSection
  data: DataSection
  diffusion: LossConfig
  optimizer: OptimizerConfig
  train: TrainSection
  eval: EvalSection
  lora: Mapping[str, Any]
  mesh: MeshSection = MeshSection()
  raw: Mapping[str, Any]

  @classmethod
  def from_config_dict(cls, config: ml_collections.ConfigDict | Mapping[str, Any]) -> ExperimentConfig:
    raw = config_to_dict(config)
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
      raise ConfigError(f"unknown config section(s) {unknown}; valid sections: {list(SECTIONS)}")
    sec = {name: dict(raw.get(name) or {}) for name in SECTIONS}
    diffusion = {("variant" if k == "loss_variant" else k): v for k, v in sec["diffusion"].items()}
    lora = dict(sec["lora"])
    lora.setdefault("enabled", False)
    if not isinstance(lora["enabled"], bool):
      raise ConfigError(f"lora.enabled={lora['enabled']!r}; expected a bool")
    return cls(
        model=_build(ModelSection, "model", sec["model"]),
        tokenizer=_build(TokenizerSection, "tokenizer", sec["tokenizer"]),
        data=_build(DataSection, "data", sec["data"]),
        diffusion=_build(LossConfig, "diffusion", diffusion, rename={"variant": "loss_variant"}),
        optimizer=_build(OptimizerConfig, "optimizer", sec["optimizer"]),
        train=_build(TrainSection, "train", sec["train"]),
        eval=_build(EvalSection, "eval", sec["eval"]),
        lora=lora,
        mesh=_build(MeshSection, "mesh", sec["mesh"]),
        raw=raw,
    )


def _build(cls: type, section: str, values: dict[str, Any], rename: Mapping[str, str] | None = None):
  rename = rename or {}
  fields = [f.name for f in dataclasses.fields(cls) if f.init]
  unknown = sorted(set(values) - set(fields))
  if unknown:
    valid = sorted(rename.get(f, f) for f in fields)
    raise ConfigError(f"unknown key(s) {[f'{section}.{k}' for k in unknown]}; valid keys of {section!r}: "
                      f"{', '.join(valid)}")
  try:
    return cls(**values)
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ConfigError(msg if msg.startswith(f"{section}.") else f"{section}: {msg}") from None


# ---- loading, overrides, serialisation -------------------------------------------------------------------------
def config_to_dict(config: ml_collections.ConfigDict | Mapping[str, Any]) -> dict[str, Any]:
  """A plain, JSON-friendly dict (nested ConfigDicts -> dicts, tuples kept)."""
  if isinstance(config, ml_collections.ConfigDict):
    config = config.to_dict()
  return {k: (config_to_dict(v) if isinstance(v, (Mapping, ml_collections.ConfigDict)) else v)
          for k, v in config.items()}


def resolve_config_path(path: str) -> str:
  """A config file path: as given if it exists, else looked up in the repository's (or cwd's) `configs/`."""
  if not path:
    raise ConfigError("--config is empty; pass a config file, e.g. --config=configs/tiny.py")
  file, sep, arg = path.partition(":")
  candidates = [file]
  if not os.path.isabs(file):
    name = file[len("configs/"):] if file.startswith("configs/") else file
    for root in (os.path.join(os.getcwd(), "configs"), CONFIGS_DIR):
      candidates += [os.path.join(root, name), os.path.join(root, name + ".py")]
  for c in candidates:
    if os.path.isfile(c):
      return c + sep + arg
  available = sorted(f for f in os.listdir(CONFIGS_DIR) if f.endswith(".py")) if os.path.isdir(CONFIGS_DIR) else []
  raise ConfigError(f"config file {file!r} not found (also looked in configs/); available: {available}")


def load_config_file(path: str, overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
  """Runs `get_config()` of a config file (bare names resolve into configs/) and applies `{'a.b': value}`."""
  resolved = resolve_config_path(path)
  file, _, arg = resolved.partition(":")
  module_name = "_hd_config_" + re.sub(r"\W", "_", os.path.abspath(file))
  spec = importlib.util.spec_from_file_location(module_name, file)
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module  # dataclasses defined in a config file need their module registered
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # noqa: BLE001 - a broken config file: say where, in one line
    raise ConfigError(f"{file}: cannot load ({type(e).__name__}: {' '.join(str(e).split())})") from None
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{file}: defines no get_config()")
  config = module.get_config(arg) if arg else module.get_config()
  if not isinstance(config, ml_collections.ConfigDict):
    config = ml_collections.ConfigDict(config)
  config.lock()
  if overrides:
    apply_overrides(config, overrides)
  return config


def config_from_json(path: str) -> ml_collections.ConfigDict:
  """The `config.json` a run wrote (lists become tuples again, so CLI overrides of them keep working)."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except FileNotFoundError:
    raise ConfigError(f"{path}: no such file (is this a workdir written by hackable_diffusion.train?)") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConfigError(f"{path}: not valid JSON ({e})") from None

  def fix(v):
    if isinstance(v, dict):
      return {k: fix(x) for k, x in v.items()}
    return tuple(fix(x) for x in v) if isinstance(v, list) else v

  config = ml_collections.ConfigDict(fix(data))
  config.lock()
  return config


def check_override_keys(config: ml_collections.ConfigDict, keys: Sequence[str], prefix: str = "config") -> None:
  """Raises a one-line ConfigError for the first `a.b.c` key that is not in `config`, listing the valid ones."""
  for key in keys:
    node: Any = config
    parts = key.split(".")
    for i, part in enumerate(parts):
      if isinstance(node, (ml_collections.ConfigDict, Mapping)) and part in node:
        node = node[part]
        continue
      where = ".".join(parts[:i]) or "<top level>"
      if isinstance(node, (ml_collections.ConfigDict, Mapping)):
        valid = ", ".join(sorted(node.keys()))
        raise ConfigError(f"unknown config key --{prefix}.{key}: {where} has no {part!r}; valid keys: {valid}")
      raise ConfigError(f"unknown config key --{prefix}.{key}: {where} is a value, not a section")


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> None:
  """Sets `{'a.b': value}` in a (locked) config; unknown keys raise a one-line ConfigError."""
  check_override_keys(config, list(overrides))
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    with node.unlocked():
      node[leaf] = value


def write_config_json(config: ml_collections.ConfigDict | Mapping[str, Any], workdir: str) -> str:
  """Writes the resolved config as `workdir/config.json` (atomically); returns the path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, CONFIG_FILENAME)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(config_to_dict(config), f, indent=2, sort_keys=True, default=str)
    f.write("\n")
  os.replace(tmp, path)
  return path


# ---- CLI plumbing -----------------------------------------------------------------------------------------------
_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")
USER_ERRORS = (ConfigError, DataError, CheckpointError, TrainingError, FileNotFoundError)


def flag_value(argv: Sequence[str], name: str) -> tuple[int, str | None]:
  for i, arg in enumerate(argv):
    m = re.match(rf"^--?{re.escape(name)}(=(.*))?$", arg)
    if m:
      if m.group(1) is not None:
        return i, m.group(2)
      return i, argv[i + 1] if i + 1 < len(argv) else None
  return -1, None


def override_keys(argv: Sequence[str], name: str = "config") -> list[str]:
  """The `a.b` of every `--config.a.b=...` in argv (in order, without duplicates)."""
  keys: list[str] = []
  for arg in argv:
    m = re.match(rf"^--?(no)?{re.escape(name)}\.([^=]+)", arg)
    if m and m.group(2) not in keys:
      keys.append(m.group(2))
  return keys


def prepare_argv(argv: list[str], *, name: str = "config",
                 default_config: ml_collections.ConfigDict | None = None) -> list[str]:
  """Resolves `--config=NAME` into configs/ and checks `--config.a.b` keys before absl parses argv.

  `default_config`: the config used when argv has no `--config` (e.g. a workdir's config.json); override keys
  are checked against it. Returns the rewritten argv; raises ConfigError (one line).
  """
  argv = list(argv)
  idx, value = flag_value(argv, name)
  keys = override_keys(argv, name)
  if idx < 0:
    if keys and default_config is None:
      raise ConfigError(f"--{name}.{keys[0]} given without --{name}=FILE")
    if keys:
      check_override_keys(default_config, keys, prefix=name)
    return argv
  if value is None:
    raise ConfigError(f"--{name} needs a value, e.g. --{name}=configs/tiny.py")
  resolved = resolve_config_path(value)
  if "=" in argv[idx]:
    argv[idx] = f"--{name}={resolved}"
  else:
    argv[idx + 1] = resolved
  if keys:
    check_override_keys(load_config_file(resolved), keys, prefix=name)
  return argv


def workdir_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config a run wrote (`workdir/config.json`)."""
  path = os.path.join(workdir, CONFIG_FILENAME)
  if not os.path.isfile(path):
    raise ConfigError(f"{path}: no such file; pass --config=FILE or a --workdir written by hackable_diffusion.train")
  return config_from_json(path)


def run_cli(main: Callable[[list[str]], Any], *, flags_parser: Callable[[list[str]], Any] | None = None) -> None:
  """`absl.app.run(main)` with the project's input errors printed as one line (`error: ...`) and exit code 1."""
  from absl import app  # local: keeps `import hackable_diffusion.training` free of absl app state
  from absl import logging

  def wrapped(argv):
    if not flags_were_set("verbosity", "v"):
      logging.set_verbosity(logging.WARNING)  # library INFO chatter off unless asked for (-v 0)
    try:
      return main(argv)
    except USER_ERRORS as e:
      _fail(e)

  def parser(argv):
    try:
      return flags_parser(argv) if flags_parser else _default_parse(argv)
    except USER_ERRORS as e:
      _fail(e)
    except SystemExit:
      if any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:]):
        sys.exit(0)  # absl exits with 1 after printing help; asking for help is not an error
      raise

  app.run(wrapped, flags_parser=parser)


def flags_were_set(*names: str) -> bool:
  from absl import flags

  return any(name in flags.FLAGS and flags.FLAGS[name].present for name in names)


def _default_parse(argv: list[str]) -> list[str]:
  from absl import flags

  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    raise ConfigError(str(e).splitlines()[0]) from None


def _fail(e: BaseException) -> None:
  msg = " ".join(str(e).split()) or type(e).__name__
  if isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in msg:
    msg = f"{msg}: {e.filename}"
  sys.stderr.write(f"error: {msg}\n")
  sys.stderr.flush()
  sys.exit(1)


CONFIG_HELP = "Experiment config file (configs/*.py); override any key with --config.section.key=value."


def make_flags_parser(*, name: str = "config", workdir_default: bool = False):
  """An absl `flags_parser`: resolves `--config`, checks override keys, then parses with absl.

  If the `--config` flag is not defined yet it is defined here: from the file given on the command line or,
  with `workdir_default` and no `--config`, from `--workdir`'s config.json (`config_flags.DEFINE_config_dict`),
  so CLI overrides work in both cases. sys.argv is rewritten too (config_flags reads the overrides there).
  """
  from absl import flags
  from ml_collections import config_flags

  def parse(argv: list[str]) -> list[str]:
    default = None
    if workdir_default and flag_value(argv, name)[0] < 0:
      _, workdir = flag_value(argv, "workdir")
      if workdir:
        default = workdir_config(workdir)
    argv = prepare_argv(argv, name=name, default_config=default)
    if name not in flags.FLAGS:
      if default is not None:
        config_flags.DEFINE_config_dict(name, default, "The run's config (default: <workdir>/config.json); "
                                        "override keys with --config.section.key=value.")
      else:
        config_flags.DEFINE_config_file(name, None, CONFIG_HELP)
      flags.FLAGS.register_flag_by_module(sys.argv[0], flags.FLAGS[name])  # listed by --help of the CLI
    sys.argv[:] = argv  # config_flags finds the override flags in sys.argv
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      raise ConfigError(str(e).splitlines()[0]) from None
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # an override config_flags could not apply
      raise ConfigError(f"bad --{name} override: {' '.join(str(e).split())}") from None

  return parse


__all__ = [
    "CONFIG_FILENAME", "ConfigError", "DataSection", "EvalSection", "ExperimentConfig", "MeshSection", "ModelSection",
    "TokenizerSection", "TrainSection", "TrainingError", "USER_ERRORS", "apply_overrides", "check_override_keys",
    "config_from_json", "config_to_dict", "load_config_file", "make_flags_parser", "prepare_argv",
    "resolve_config_path", "run_cli", "workdir_config", "write_config_json",
]
