"""LoRA fine-tuning of a trained Sudoku model to a new target (base frozen, adapters only).

  python -m hackable_diffusion.train --config=configs/sudoku.py --workdir=runs/sudoku             # the base
  python -m hackable_diffusion.train --config=configs/sudoku_lora.py --workdir=runs/sudoku_lora

`model.checkpoint` is a previous run's workdir (or a Hugging Face DiffusionGemma directory); the tokenizer is the
base run's. Rank-8 adapters on attention + dense MLP; only they train (the optimizer filter is `nnx.LoRAParam`)
and only they are checkpointed. Two targets (`TARGET` below), results in docs/lora.md:

- "no_pins" (default): solve without pinned givens. The base was trained with the givens never corrupted and
  sampled with them pinned; the adapter trains on easy + medium puzzles with the givens corrupted like any cell
  and is evaluated without pins.
- "hard": hard puzzles (< 30 givens), the bucket the base never saw.
"""

import ml_collections

from hackable_diffusion.configs import base

BASE = "runs/sudoku"  # the base run's workdir
TARGET = "no_pins"  # or "hard" (see the docstring)
PIN_GIVENS = TARGET == "hard"


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.update(preset="", checkpoint=BASE)  # the base run's model config and weights
  config.tokenizer.path = BASE + "/tokenizer.model"  # the base run's tokenizer (ids must match the base model)
  config.data.chat_template = "task"  # the base's prompt: the task's cell-identity characters (configs/sudoku.py)
  mix = {"no_pins": (0.5, 0.5, 0.0), "hard": (0.0, 0.0, 1.0)}[TARGET]  # easy, medium, hard weights
  base.sudoku_task(config, num_train=5_000, mix=mix)
  config.data.pinned_field = "pinned" if PIN_GIVENS else ""
  config.optimizer.peak_lr = {"no_pins": 3e-3, "hard": 1e-3}[TARGET]
  config.train.steps = 400
  # SudokuTask sampling hooks
  config.eval.task_args = ml_collections.ConfigDict(dict(pin_givens=PIN_GIVENS, digits_only=True))
  config.eval.step_budgets = (8, 16, 32, 64) if TARGET == "hard" else (16, 32)
  config.lora = ml_collections.ConfigDict(dict(
      enabled=True, rank=8, alpha=16.0, dropout=0.0,
      target_modules=("self_attn.(q|k|v|o)_proj", "mlp.(gate|up|down)_proj"), param_dtype="float32", seed=0,
      base_quantization="none", base_block_size=64))  # QLoRA: 'fp8' / 'int4' / 'nvfp4' (lora.qlora)
  return config
