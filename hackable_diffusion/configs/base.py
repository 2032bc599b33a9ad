"""The defaults every shipped config starts from: all nine sections, each key with what it does.

Each config file in this folder calls `base.get_config()` and overrides what its experiment changes:

  from hackable_diffusion.configs import base

  def get_config():
    config = base.get_config()
    config.data.train_path = "data/train.jsonl"
    config.train.steps = 500
    return config

The import works from a copy of a config anywhere (`--config=/path/my.py`) once the package is installed. On its
own this file trains the 'tiny' preset from scratch on a JSONL file of `{"prompt", "completion"}` records:

  python -m hackable_diffusion.train --config=configs/base.py --config.data.train_path=train.jsonl --workdir=runs/base

Keys only some configs set (e.g. `data.messages_field`, `eval.ablations`, the LoRA settings) are added by the files
that use them; the typed default of every key is in docs/training.md ("The config"). `sudoku_task` and
`sudoku_ablations` hold what the Sudoku configs share.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  config.model = ml_collections.ConfigDict(dict(
      preset="tiny",  # a name in hackable_diffusion.model.config.PRESETS ('' when fine-tuning a checkpoint)
      checkpoint="",  # or a HF DiffusionGemma directory or a previous run's workdir to fine-tune (then preset='')
      dtype="auto",  # parameter dtype when loading a checkpoint ("auto": the dtype it was saved in)
      # ModelConfig fields (vocab_size and the pad/eos/bos ids default to the tokenizer's)
      overrides=ml_collections.ConfigDict(),
  ))

  config.tokenizer = ml_collections.ConfigDict(dict(
      path="train",  # a char model trained on the data; or 'checkpoint', or a tokenizer.json/.model path
      model_type="char",
      vocab_size=0,  # needed for bpe/unigram/word only
  ))

  config.data = ml_collections.ConfigDict(dict(
      generator="",  # hackable_diffusion.tasks.base.BUILTIN_TASKS or "module:factory" ('' = use train_path)
      generator_args=ml_collections.ConfigDict(),  # keyword arguments of the generator's task
      train_path="",  # SFT JSONL; with a generator, a path that is set replaces the generated split
      validation_path="",
      prompt_field="prompt",
      completion_field="completion",
      chat_template="",  # e.g. '<|turn>user\n{prompt}<turn|>\n<|turn>model\n', a jinja template, or 'tokenizer'
      max_prompt_length=128,  # prompt tokens (left-padded)
      max_canvases=1,  # completion canvases of model canvas_length tokens each
      add_bos=False,
      append_eos=True,
      on_overlength="error",  # or 'truncate'
      on_malformed="error",  # or 'skip'
      shuffle=True,
      prefetch_batches=2,
      pinned_field="",  # JSON key of a '0'/'1' string of completion tokens known at sampling time (infilling)
      max_images=-1,  # images per example of chat records with image parts (-1: the most any record has)
      image_processor=ml_collections.ConfigDict(),  # ImageProcessorConfig fields replacing the run's (e.g. do_resize)
  ))

  # The SFT objective (docs/reference.md, "Training recipe").
  config.diffusion = ml_collections.ConfigDict(dict(
      loss_variant="flat",  # 'flat' | 'corrupted' | 'elbo'
      schedule="linear",  # alpha_t = 1 - t
      time_eps=1e-4,
      self_conditioning_prob=0.5,
      encoder_ar_weight=1.0,  # weight of the encoder's autoregressive loss on the prompt
      logits_tile_mib=256.0,  # most fp32 logits (MiB) alive at once in the loss; 0 = untiled
  ))

  # A small model trained from scratch: a much larger learning rate than the fine-tuning recipe.
  config.optimizer = ml_collections.ConfigDict(dict(
      peak_lr=2e-3,
      end_lr_ratio=0.1,  # final lr = peak_lr * end_lr_ratio
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
      steps=1000,
      batch_size=32,
      grad_accum_steps=1,  # micro-batches per step (batch_size must be a multiple)
      seed=0,
      log_every=25,
      checkpoint_every=200,
      keep_checkpoints=2,
      eval_every=0,  # 0: evaluate at the end only
      eval_at_end=True,
      async_checkpointing=True,
      freeze_router="auto",  # MoE routers kept as loaded when fine-tuning a checkpoint in full ('auto'), or True/False
      train_vision="none",  # vision tower: 'none' (frozen), 'projector' (embed_vision) or 'all' (full fine-tuning)
  ))

  # Accuracy against the denoising-step budget, and with early stopping.
  config.eval = ml_collections.ConfigDict(dict(
      task="",  # '' = the data generator's task, else 'text' (exact match + character accuracy)
      task_args=ml_collections.ConfigDict(),
      split="validation",
      num_examples=128,
      batch_size=64,  # slots of the refilling sampling loop
      step_budgets=(8, 16, 32, 64),  # one run per budget, early stopping off
      early_stopping_steps=64,  # the early-stopping run's step cap
      max_new_tokens=0,  # 0 = max_canvases * canvas_length
      # the sampler of every evaluation run (hd.SamplingConfig; each run sets its own step cap / early stopping)
      sampling=ml_collections.ConfigDict(dict(
          entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1,
          confidence_threshold=0.005,
          acceptance="entropy_bound",  # or 'top_k' / 'confidence_threshold' / 'package.module:Rule'
          # with eval.checker: raise flagged entropies / drop their self-conditioning / restart invalid rows
          checker_confidence=False, checker_forget=False, checker_restarts=0,
          checker_step_budget=config_dict.placeholder(int),  # forwards per row and canvas (unset: (restarts+1)*cap)
      )),
      checker=False,  # the sampler re-noises what the task's checker flags (a task with a `checker` hook)
      samples_per_prompt=1,  # tries per example; later tries only for examples the checker rejects
      seed=0,
      num_samples=8,  # examples shown in the evaluation report
  ))

  config.lora = ml_collections.ConfigDict(dict(enabled=False))  # full fine-tuning / training from scratch

  # Device mesh (hackable_diffusion.sharding, docs/scaling.md): all 1 = one device. -1 on one axis = the rest.
  config.mesh = ml_collections.ConfigDict(dict(
      data=1, fsdp=1, tensor=1, expert=1,
      # multi-host; unset = from $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES / $JAX_PROCESS_ID
      coordinator_address=config_dict.placeholder(str), num_processes=config_dict.placeholder(int),
      process_id=config_dict.placeholder(int),
      auto_distributed=False,  # let JAX detect a TPU pod / SLURM / Open MPI cluster
  ))
  return config


def sudoku_task(config: ml_collections.ConfigDict, num_train: int, mix: tuple[float, float, float] = (0.5, 0.5, 0.0),
                workers: int = 2, **generator_args) -> ml_collections.ConfigDict:
  """Sets `config` up for the Sudoku task (docs/sudoku.md) and returns it; the model section is left to the caller.

  num_train: generated training puzzles; mix: easy / medium / hard weights of the generated splits; workers:
  generator processes; generator_args: further `SudokuTask` arguments (e.g. `train_easy`, the training split's
  own mix).
  """
  config.data.generator = "sudoku"  # hackable_diffusion.tasks.sudoku.task.SudokuTask writes train/validation/test
  config.data.generator_args = ml_collections.ConfigDict(dict(
      num_train=num_train, num_validation=500, num_test=500, seed=0, easy=mix[0], medium=mix[1], hard=mix[2],
      workers=workers, **generator_args))
  config.data.max_prompt_length = 81  # the puzzle, one character per cell
  config.data.append_eos = False  # the 81 solution digits fill exactly one canvas: no end-of-sequence token
  # the givens: never corrupted in training, pinned at sampling
  config.data.pinned_field = "pinned"
  config.diffusion.encoder_ar_weight = 0.0  # one canvas: the AR term would only double the encoder's cost
  # held-out puzzles, disjoint from train and validation
  config.eval.update(task="sudoku", split="test", num_examples=300, batch_size=100)
  return config


def sudoku_ablations() -> ml_collections.ConfigDict:
  """`eval.ablations` of a Sudoku run: one extra run each without pinning the givens (the canvas starts from noise
  and every cell may change) and without restricting sampling to the digits 1-9 (at `eval.ablation_steps`)."""
  return ml_collections.ConfigDict(dict(
      no_pins=dict(pin_givens=False),
      all_tokens=dict(digits_only=False),
  ))
