"""Toy run: sort a 7-digit string with a ~0.1M-parameter DiffusionGemma on a CPU.

  python -m hackable_diffusion.train --config=configs/tiny.py --workdir=runs/tiny

For smoke tests and for learning the tools. The data are generated into workdir/data (5,000 training and 256
validation strings, see `hackable_diffusion.tasks.text.DigitsTask`); the tokenizer is a character model trained on
them (14 tokens: pad, eos, bos, unk and the ten digits), and the model's vocabulary follows it. Everything not set
here is configs/base.py's default. Any key can be overridden on the command line, e.g.
`--config.train.steps=300 --config.data.generator_args.op=reverse`.
"""

import ml_collections

from hackable_diffusion.configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  # the 'tiny' preset (2 layers, hidden 32, 4 experts top-2) with a canvas of 8: 7 digits + eos
  config.model.overrides = ml_collections.ConfigDict(dict(canvas_length=8))
  config.data.generator = "digits"
  config.data.generator_args = ml_collections.ConfigDict(dict(
      op="sort", length=7, num_train=5000, num_validation=256, seed=0))
  config.data.max_prompt_length = 8
  config.optimizer.update(peak_lr=3e-3, warmup_steps=20)
  config.train.update(log_every=50, checkpoint_every=250)
  config.eval.update(step_budgets=(2, 4, 8, 16), early_stopping_steps=16)
  return config
