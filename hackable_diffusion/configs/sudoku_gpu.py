"""Sudoku sized for one GPU (e.g. an A100/H100/H200): a larger DiffusionGemma-architecture model, more data, longer.

  python -m hackable_diffusion.train --config=configs/sudoku_gpu.py --workdir=runs/sudoku_gpu
  python -m hackable_diffusion.train --config=configs/sudoku_gpu.py --config.mesh.fsdp=8   # 8 GPUs, sharded

configs/sudoku.py's recipe without its own-cell head (peer attention structure, pinned givens), with hard
puzzles in the data: hidden 256, 8 layers, 8 experts top-2 (~10M parameters), 200k puzzles, 20k steps of 256. Not
run on this project's CPU-only CI; see docs/sudoku.md.
"""

import ml_collections
from ml_collections import config_dict

STRUCTURE = "hackable_diffusion.tasks.sudoku.structure:peer_mask"  # SudokuTask().attention_structure()
NUM_TRAIN = 200_000
STEPS = 20_000
BATCH = 256
PEAK_LR = 1e-3
NUM_EVAL = 1000
T_MIN, T_MAX = 0.4, 0.8


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The network: the 'tiny' preset (2 layers, hidden 32, 4 experts top-2, canvas 8) with a few changes.
  config.model = ml_collections.ConfigDict(dict(
      preset="sudoku",  # hidden 128, 4 layers (2 sliding + 2 full), 4 heads, 4 experts top-2
      checkpoint="",  # or a HF DiffusionGemma directory to fine-tune (then preset='')
      dtype="auto",  # parameter dtype when loading a checkpoint ("auto": the dtype it was saved in)
      # ModelConfig fields (vocab_size and the pad/eos/bos ids default to the tokenizer's)
      overrides=ml_collections.ConfigDict(dict(
          canvas_length=81, attention_structure=STRUCTURE, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
          layer_types=("sliding_attention", "full_attention") * 4, num_attention_heads=8, num_key_value_heads=4,
          num_experts=8, top_k_experts=2, moe_intermediate_size=256)),
  ))

  config.tokenizer = ml_collections.ConfigDict(dict(
      path="train",  # a char model trained on the data; or 'checkpoint', or a tokenizer.json/.model path
      model_type="char",
      vocab_size=0,  # needed for bpe/unigram/word only
  ))

  # Data: a built-in generator writes train/validation JSONL into workdir/data.
  config.data = ml_collections.ConfigDict(dict(
      generator="sudoku",  # hackable_diffusion.tasks.sudoku.task.SudokuTask writes train/validation/test JSONL
      generator_args=ml_collections.ConfigDict(dict(
          num_train=NUM_TRAIN, num_validation=500, num_test=500, seed=0, easy=0.3, medium=0.4, hard=0.3,
          workers=8)),
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
      pinned_field="pinned",
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
      log_every=100,
      checkpoint_every=2000,
      keep_checkpoints=2,
      eval_every=0,  # 0: evaluate at the end only
      eval_at_end=True,
      async_checkpointing=True,
  ))

  # Accuracy against the denoising-step budget, and with early stopping.
  config.eval = ml_collections.ConfigDict(dict(
      task="sudoku",
      task_args=ml_collections.ConfigDict(),
      split="test",  # held-out puzzles, disjoint from train and validation
      num_examples=NUM_EVAL,
      batch_size=100,
      step_budgets=(8, 16, 32, 64),
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
      # one extra 32-step run each: without pinning the givens (the canvas starts from noise and every cell may
      # change) and without restricting sampling to the digits 1-9
      ablation_steps=32,
      ablations=ml_collections.ConfigDict(dict(
          no_pins=dict(pin_givens=False),
          all_tokens=dict(digits_only=False),
      )),
  ))

  config.lora = ml_collections.ConfigDict(dict(enabled=False))

  # Device mesh (hackable_diffusion.sharding, docs/scaling.md): all 1 = one device. -1 on one axis = the rest.
  # E.g. 8 GPUs, fully sharded data parallel: --config.mesh.fsdp=8 (or data=2, fsdp=4; or fsdp=-1 for all of
  # them); train.batch_size must be a multiple of data x fsdp x expert.
  config.mesh = ml_collections.ConfigDict(dict(
      data=1, fsdp=1, tensor=1, expert=1,
      # multi-host; unset = from $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES / $JAX_PROCESS_ID
      coordinator_address=config_dict.placeholder(str), num_processes=config_dict.placeholder(int),
      process_id=config_dict.placeholder(int),
      auto_distributed=False,  # let JAX detect a TPU pod / SLURM / Open MPI cluster
  ))
  return config
