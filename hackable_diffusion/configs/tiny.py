"""Toy run: sort a 7-digit string with a ~0.1M-parameter DiffusionGemma (CPU, about a minute).

  python -m hackable_diffusion.train --config=configs/tiny.py --workdir=runs/tiny

The data are generated into workdir/data (5,000 training and 256 validation strings, see
`hackable_diffusion.tasks.text.DigitsTask`); the tokenizer is a character model trained on them
(14 tokens: pad, eos, bos, unk and the ten digits), and the model's vocabulary follows it. Any key can be
overridden on the command line, e.g. `--config.train.steps=300 --config.data.generator_args.op=reverse`.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # The network: the 'tiny' preset (2 layers, hidden 32, 4 experts top-2, canvas 8) with a few changes.
  config.model = ml_collections.ConfigDict(dict(
      preset="tiny",  # a name in hackable_diffusion.model.config.PRESETS
      checkpoint="",  # or a HF DiffusionGemma directory to fine-tune (then preset='')
      dtype="auto",  # parameter dtype when loading a checkpoint ("auto": the dtype it was saved in)
      # ModelConfig fields (vocab_size and the pad/eos/bos ids default to the tokenizer's)
      overrides=ml_collections.ConfigDict(dict(canvas_length=8)),
  ))

  config.tokenizer = ml_collections.ConfigDict(dict(
      path="train",  # a char model trained on the data; or 'checkpoint', or a tokenizer.json/.model path
      model_type="char",
      vocab_size=0,  # needed for bpe/unigram/word only
  ))

  # Data: a built-in generator writes train/validation JSONL into workdir/data.
  config.data = ml_collections.ConfigDict(dict(
      generator="digits",  # hackable_diffusion.tasks.base.BUILTIN_TASKS or "module:factory" ('' = use train_path)
      generator_args=ml_collections.ConfigDict(dict(
          op="sort", length=7, num_train=5000, num_validation=256, seed=0)),
      train_path="",
      validation_path="",
      prompt_field="prompt",
      completion_field="completion",
      chat_template="",  # e.g. '<|turn>user\n{prompt}<turn|>\n<|turn>model\n', a jinja template, or 'tokenizer'
      max_prompt_length=8,  # prompt tokens (left-padded)
      max_canvases=1,  # completion canvases: 7 digits + eos fit one canvas of 8
      add_bos=False,
      append_eos=True,
      on_overlength="error",  # or 'truncate'
      on_malformed="error",  # or 'skip'
      shuffle=True,
      prefetch_batches=2,
      pinned_field="",  # JSON key of a '0'/'1' string of completion tokens known at sampling time (infilling)
  ))

  # The SFT objective (REFERENCE §3).
  config.diffusion = ml_collections.ConfigDict(dict(
      loss_variant="flat",  # 'flat' | 'corrupted' | 'elbo'
      schedule="linear",  # alpha_t = 1 - t
      time_eps=1e-4,
      self_conditioning_prob=0.5,
      encoder_ar_weight=1.0,
      logits_tile_mib=256.0,  # most fp32 logits (MiB) alive at once in the loss; 0 = untiled
  ))

  # A small model trained from scratch takes a much larger learning rate than the fine-tuning recipe.
  config.optimizer = ml_collections.ConfigDict(dict(
      peak_lr=3e-3,
      end_lr_ratio=0.1,
      warmup_steps=20,
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
      steps=1000,
      batch_size=32,
      grad_accum_steps=1,
      seed=0,
      log_every=50,
      checkpoint_every=250,
      keep_checkpoints=2,
      eval_every=0,  # 0: evaluate at the end only
      eval_at_end=True,
      async_checkpointing=True,
  ))

  # Accuracy against the denoising-step budget, and with early stopping.
  config.eval = ml_collections.ConfigDict(dict(
      task="",  # '' = the data generator's task (exact match + character accuracy)
      task_args=ml_collections.ConfigDict(),
      split="validation",
      num_examples=128,
      batch_size=64,
      step_budgets=(2, 4, 8, 16),
      early_stopping_steps=16,
      max_new_tokens=0,  # 0 = max_canvases * canvas_length
      # the sampler of every evaluation run (hd.SamplingConfig; each run sets its own step cap / early stopping)
      sampling=ml_collections.ConfigDict(dict(
          entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1,
          confidence_threshold=0.005,
          acceptance="entropy_bound",  # or 'top_k' / 'confidence_threshold' / 'package.module:Rule'
      )),
      seed=0,
      num_samples=8,
  ))

  config.lora = ml_collections.ConfigDict(dict(enabled=False))

  # Device mesh (hackable_diffusion.sharding, docs/scaling.md): all 1 = one device. -1 on one axis = the rest.
  config.mesh = ml_collections.ConfigDict(dict(
      data=1, fsdp=1, tensor=1, expert=1,
      # multi-host; unset = from $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES / $JAX_PROCESS_ID
      coordinator_address=config_dict.placeholder(str), num_processes=config_dict.placeholder(int),
      process_id=config_dict.placeholder(int),
      auto_distributed=False,  # let JAX detect a TPU pod / SLURM / Open MPI cluster
  ))
  return config
