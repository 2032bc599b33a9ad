"""LoRA fine-tuning of the released DiffusionGemma 26B-A4B on any SFT JSONL, on one 80 GB GPU.

  python -m hackable_diffusion.train --config=configs/diffusiongemma_26b_lora.py --workdir=runs/dg26b_lora \
      --config.model.checkpoint=/path/to/diffusiongemma-26b-a4b --config.data.train_path=train.jsonl

The official recipe's numbers (REFERENCE §3, the gemma JAX adapter): LoRA rank 8 on all linear layers, batch 8,
2,000 steps, lr 1.5e-4 warmed up over 100 steps and cosine-decayed to 1.5e-5, gradient clipping 1.0, Adam
(0.95, 0.99), weight decay 1e-4. The base loads in the dtype it was saved in (bf16, 47 GiB); adapters and their
Adam moments are fp32.

Memory (scripts/memory_report.py --scan, compiled on CPU for the real shapes; table in docs/scaling.md): per-layer
rematerialisation ('nothing_saveable') with the layers scanned (`scan_layers`), the vocabulary-tiled loss (256 MiB
of fp32 logits at a time) and a step of 8 examples as 4 micro-batches of 2 (`train.grad_accum_steps=4`): 52.7 GiB
on one 80 GB device; in one pass (`--config.train.grad_accum_steps=1`) 58.6 GiB. Evaluation samples at batch 8.

Other hardware (same file, override on the command line):
- 8 GPUs on one host: `--config.mesh.fsdp=8 --config.train.batch_size=64 --config.train.grad_accum_steps=1`
  (parameters, adapters and optimizer state sharded 8 ways; batch 8 per device). Full fine-tuning instead of
  LoRA: `--config.lora.enabled=False`; fp32 master weights and fp32 Adam moments are on by default then
  (`optimizer.master_weights='auto'`): the report's case b compiles to 61.9 GiB per device at fsdp=8, batch 8 per
  device (docs/scaling.md; not run on GPUs).
- TPU v5p-8 (4 chips x 95 GB): `--config.mesh.fsdp=4 --config.train.batch_size=32`. TPU v5e-8 (8 chips x 16 GB):
  the bf16 base alone is 47 GiB, 5.9 GiB a chip at fsdp=8, plus activations: `--config.mesh.fsdp=8
  --config.train.batch_size=8` (batch 1 per chip). Neither has been run; check with the report's mesh case first.
"""

import ml_collections
from ml_collections import config_dict

CHECKPOINT = "checkpoints/diffusiongemma-26b-a4b"  # a HF DiffusionGemma directory (config.json + safetensors)
STEPS = 2_000
BATCH = 8


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  config.model = ml_collections.ConfigDict(dict(
      preset="",
      checkpoint=CHECKPOINT,
      dtype="auto",  # the dtype it was saved in: bfloat16 for the release
      overrides=ml_collections.ConfigDict(dict(
          remat="nothing_saveable",  # keep only each layer's input for the backward pass (model/remat.py)
          scan_layers=True,  # one scan over the 5 groups of 6 layers (model/scan.py): 1/5 of the compile
          moe_impl="tiled",  # each token through its top-8 experts only (what the memory report measured)
      )),
  ))

  config.tokenizer = ml_collections.ConfigDict(dict(
      path="checkpoint",  # the release's own tokenizer files (tokenizer.json, tokenizer_config.json, chat template)
      model_type="char",  # only used by path='train'

      vocab_size=0,
  ))

  config.data = ml_collections.ConfigDict(dict(
      generator="",
      generator_args=ml_collections.ConfigDict(),
      train_path="data/train.jsonl",  # SFT JSONL: {"prompt": ..., "completion": ...} or {"messages": [...]} lines
      validation_path="",
      prompt_field="prompt",
      completion_field="completion",
      messages_field="messages",  # chat records: the loss is on the final assistant turn only
      chat_template="tokenizer",  # the checkpoint's jinja chat template (Gemma 4: <|turn>user ... <turn|>)
      max_prompt_length=256,
      max_canvases=1,  # one canvas of 256 completion tokens
      add_bos=True,  # not added twice when the chat template writes <bos> itself
      append_eos=True,
      on_overlength="error",  # or 'truncate'
      on_malformed="error",  # or 'skip'
      shuffle=True,
      prefetch_batches=2,
      pinned_field="",
  ))

  config.diffusion = ml_collections.ConfigDict(dict(
      loss_variant="flat",
      schedule="linear",
      time_eps=1e-4,
      self_conditioning_prob=0.5,
      encoder_ar_weight=1.0,
      logits_tile_mib=256.0,  # at most 256 MiB of fp32 logits alive at once in the loss
  ))

  config.optimizer = ml_collections.ConfigDict(dict(
      peak_lr=1.5e-4,
      end_lr_ratio=0.1,
      warmup_steps=100,
      decay_steps=0,  # 0: the run's train.steps (the schedule follows --config.train.steps)
      schedule="cosine",
      b1=0.95,
      b2=0.99,
      eps=1e-8,
      weight_decay=1e-4,
      clip_norm=1.0,
      master_weights="auto",  # fp32 master + fp32 Adam moments for full fine-tuning; no effect on LoRA
  ))

  config.train = ml_collections.ConfigDict(dict(
      steps=STEPS,
      batch_size=BATCH,
      grad_accum_steps=4,  # 4 micro-batches of 2 per step of 8: what fits one 80 GB device (docs/scaling.md)
      seed=0,
      log_every=10,
      checkpoint_every=200,
      keep_checkpoints=2,
      eval_every=0,  # no validation split by default; set data.validation_path to evaluate
      eval_at_end=False,
      async_checkpointing=True,
  ))

  config.eval = ml_collections.ConfigDict(dict(
      task="",  # '' = the generic text task
      task_args=ml_collections.ConfigDict(),
      split="validation",
      num_examples=64,
      batch_size=8,  # sampler temporaries at batch 8: see docs/scaling.md (the report's case c)
      step_budgets=(32,),
      early_stopping_steps=32,  # the early-stopping run's step cap
      max_new_tokens=0,
      sampling=ml_collections.ConfigDict(dict(
          entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005,
          acceptance="entropy_bound",
      )),
      seed=0,
      num_samples=4,
  ))

  config.lora = ml_collections.ConfigDict(dict(
      enabled=True, rank=8, alpha=16.0, dropout=0.0, target_modules="all-linear", param_dtype="float32", seed=0,
      # QLoRA: 'fp8' (a 48 GB card), 'int4' or 'nvfp4' - the frozen base quantized tensor by tensor as it loads
      base_quantization="none", base_block_size=64))

  config.mesh = ml_collections.ConfigDict(dict(
      data=1, fsdp=1, tensor=1, expert=1,
      coordinator_address=config_dict.placeholder(str), num_processes=config_dict.placeholder(int),
      process_id=config_dict.placeholder(int),
      auto_distributed=False,
  ))
  return config
