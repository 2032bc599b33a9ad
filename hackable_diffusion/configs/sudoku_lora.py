"""LoRA fine-tuning of a trained Sudoku model to a new target (base frozen, adapters only).

  python -m hackable_diffusion.train --config=configs/sudoku.py --workdir=runs/sudoku             # the base
  python -m hackable_diffusion.train --config=configs/sudoku_lora.py --workdir=runs/sudoku_lora

`model.checkpoint` is a previous run's workdir (or a Hugging Face DiffusionGemma directory); the tokenizer is the
base run's. Rank-8 adapters on attention + dense MLP; only they train (the optimizer filter is `nnx.LoRAParam`)
and only they are checkpointed. Two targets (`TARGET` below), both measured in docs/lora.md:

- "no_pins" (default): solve without pinned givens. The base was trained with the givens never corrupted and
  sampled with them pinned; without pins it gets 15.8% of the blank cells right. The adapter trains on easy +
  medium puzzles with the givens corrupted like any cell and is evaluated without pins: 50.5% of the blank cells
  (solved grids: 0.0% -> 0.3%, whole grids need longer training).
- "hard": hard puzzles (< 30 givens), the bucket the base never saw. The gain is within noise at this budget
  (solved 3.7% -> 5.0% at 64 steps on 300 puzzles; blank cells 55.2% both).
"""

import ml_collections
from ml_collections import config_dict

STRUCTURE = "hackable_diffusion.tasks.sudoku.structure:peer_mask"  # SudokuTask().attention_structure()
BASE = "runs/sudoku"  # the base run's workdir
NUM_TRAIN = 5_000
STEPS = 400
BATCH = 32
TARGET = "no_pins"  # or "hard" (see the docstring)
PEAK_LR = {"no_pins": 3e-3, "hard": 1e-3}[TARGET]
BUCKETS = {"no_pins": (0.5, 0.5, 0.0), "hard": (0.0, 0.0, 1.0)}[TARGET]  # easy, medium, hard weights
PIN_GIVENS = TARGET == "hard"
NUM_EVAL = 300
T_MIN, T_MAX = 0.4, 0.8


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The network: the 'tiny' preset (2 layers, hidden 32, 4 experts top-2, canvas 8) with a few changes.
  config.model = ml_collections.ConfigDict(dict(
      preset="",
      checkpoint=BASE,  # a previous run's workdir or a HF DiffusionGemma directory
      dtype="auto",  # parameter dtype when loading a checkpoint ("auto": the dtype it was saved in)
      # ModelConfig fields (vocab_size and the pad/eos/bos ids default to the tokenizer's)
      overrides=ml_collections.ConfigDict(),  # the base run's model config
  ))

  config.tokenizer = ml_collections.ConfigDict(dict(
      path=BASE + "/tokenizer.model",  # the base run's tokenizer (ids must match the base model)
      model_type="char",
      vocab_size=0,  # needed for bpe/unigram/word only
  ))

  # Data: a built-in generator writes train/validation JSONL into workdir/data.
  config.data = ml_collections.ConfigDict(dict(
      generator="sudoku",  # hackable_diffusion.tasks.sudoku.task.SudokuTask writes train/validation/test JSONL
      generator_args=ml_collections.ConfigDict(dict(
          num_train=NUM_TRAIN, num_validation=500, num_test=500, seed=0,
          easy=BUCKETS[0], medium=BUCKETS[1], hard=BUCKETS[2], workers=2)),
      train_path="",
      validation_path="",
      prompt_field="prompt",
      completion_field="completion",
      chat_template="",  # e.g. '<|turn>user\n{prompt}<turn|>\n<|turn>model\n', a jinja template, or 'tokenizer'
      max_prompt_length=81,  # the puzzle, one character per cell
      max_canvases=1,  # the 81 solution digits are exactly one canvas
      add_bos=False,
      append_eos=False,  # fixed length: no end-of-sequence token needed
      on_overlength="error",  # or 'truncate'
      on_malformed="error",  # or 'skip'
      shuffle=True,
      prefetch_batches=2,
      # the givens: never corrupted in training, pinned at sampling. JSON key of a '0'/'1' string of
      # completion tokens known at sampling time (infilling)
      pinned_field="pinned" if PIN_GIVENS else "",
  ))

  # The SFT objective (REFERENCE §3).
  config.diffusion = ml_collections.ConfigDict(dict(
      loss_variant="flat",  # 'flat' | 'corrupted' | 'elbo'
      schedule="linear",  # alpha_t = 1 - t
      time_eps=1e-4,
      self_conditioning_prob=0.5,
      encoder_ar_weight=0.0,  # one canvas: the AR term would only double the encoder's cost (README table)
      logits_tile_mib=256.0,  # most fp32 logits (MiB) alive at once in the loss; 0 = untiled
  ))

  # A small model trained from scratch takes a much larger learning rate than the fine-tuning recipe.
  config.optimizer = ml_collections.ConfigDict(dict(
      peak_lr=PEAK_LR,
      end_lr_ratio=0.1,
      warmup_steps=50,
      decay_steps=0,  # 0: the run's train.steps (the schedule follows --config.train.steps)
      schedule="cosine",
      b1=0.9,
      b2=0.99,
      eps=1e-8,
      weight_decay=0.0,
      clip_norm=1.0,
      master_weights="auto",  # fp32 master + Adam moments for full fine-tuning of a bf16 model
  ))

  config.train = ml_collections.ConfigDict(dict(
      steps=STEPS,
      batch_size=BATCH,
      grad_accum_steps=1,
      seed=0,
      log_every=25,
      checkpoint_every=200,
      keep_checkpoints=2,
      eval_every=0,  # 0: evaluate at the end only
      eval_at_end=True,
      async_checkpointing=True,
  ))

  # Accuracy against the denoising-step budget, and with early stopping.
  config.eval = ml_collections.ConfigDict(dict(
      task="sudoku",
      task_args=ml_collections.ConfigDict(dict(pin_givens=PIN_GIVENS, digits_only=True)),  # SudokuTask sampling hooks
      split="test",  # held-out puzzles, disjoint from train and validation
      num_examples=NUM_EVAL,
      batch_size=100,
      step_budgets=(8, 16, 32, 64) if TARGET == "hard" else (16, 32),
      early_stopping_steps=64,
      max_new_tokens=0,  # 0 = max_canvases * canvas_length
      # the sampler of every evaluation run (hd.SamplingConfig; each run sets its own step cap / early stopping)
      sampling=ml_collections.ConfigDict(dict(
          entropy_bound=0.1, t_min=T_MIN, t_max=T_MAX, stability_threshold=1,
          confidence_threshold=0.005,
          acceptance="entropy_bound",  # or 'top_k' / 'confidence_threshold' / 'package.module:Rule'
      )),
      seed=0,
      num_samples=8,
  ))

  config.lora = ml_collections.ConfigDict(dict(
      enabled=True, rank=8, alpha=16.0, dropout=0.0,
      target_modules=("self_attn.(q|k|v|o)_proj", "mlp.(gate|up|down)_proj"), param_dtype="float32", seed=0,
      base_quantization="none", base_block_size=64))  # QLoRA: 'fp8' / 'int4' / 'nvfp4' (lora.qlora)

  # Device mesh (hackable_diffusion.sharding, docs/scaling.md): all 1 = one device. -1 on one axis = the rest.
  config.mesh = ml_collections.ConfigDict(dict(
      data=1, fsdp=1, tensor=1, expert=1,
      # multi-host; unset = from $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES / $JAX_PROCESS_ID
      coordinator_address=config_dict.placeholder(str), num_processes=config_dict.placeholder(int),
      process_id=config_dict.placeholder(int),
      auto_distributed=False,  # let JAX detect a TPU pod / SLURM / Open MPI cluster
  ))
  return config
