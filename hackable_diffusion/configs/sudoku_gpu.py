"""Sudoku sized for one GPU (e.g. an A100/H100/H200): a larger DiffusionGemma-architecture model, more data, longer.

  python -m hackable_diffusion.train --config=configs/sudoku_gpu.py --workdir=runs/sudoku_gpu
  python -m hackable_diffusion.train --config=configs/sudoku_gpu.py --config.mesh.fsdp=8   # 8 GPUs, sharded

configs/sudoku_structured.py's recipe without its own-cell head (peer attention structure, pinned givens), with hard
puzzles in the data: hidden 256, 8 layers, 8 experts top-2 (~10M parameters), 200k puzzles, 20k steps of 256.
For scaling the Sudoku recipe past a CPU's budget; see docs/sudoku.md.
"""

import ml_collections

from hackable_diffusion.configs import base

STRUCTURE = "hackable_diffusion.tasks.sudoku.structure:peer_mask"  # SudokuTask().attention_structure()


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.preset = "sudoku"
  config.model.overrides = ml_collections.ConfigDict(dict(
      canvas_length=81, attention_structure=STRUCTURE, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
      layer_types=("sliding_attention", "full_attention") * 4, num_attention_heads=8, num_key_value_heads=4,
      num_experts=8, top_k_experts=2, moe_intermediate_size=256))
  base.sudoku_task(config, num_train=200_000, mix=(0.3, 0.4, 0.3), workers=8)
  config.data.generator_args.num_test = 1000
  config.optimizer.peak_lr = 1e-3
  config.train.update(steps=20_000, batch_size=256, log_every=100, checkpoint_every=2000)
  config.eval.num_examples = 1000
  config.eval.ablation_steps = 32  # each ablation evaluated once at 32 steps
  config.eval.ablations = base.sudoku_ablations()
  # Several GPUs, fully sharded data parallel: --config.mesh.fsdp=8 (or data=2, fsdp=4; or fsdp=-1 for all of
  # them); train.batch_size must be a multiple of data x fsdp x expert.
  return config
