"""LoRA fine-tuning of the released DiffusionGemma 26B-A4B on any SFT JSONL, on one 80 GB GPU.

  python -m hackable_diffusion.train --config=configs/diffusiongemma_26b_lora.py --workdir=runs/dg26b_lora \
      --config.model.checkpoint=google/diffusiongemma-26B-A4B-it --config.data.train_path=train.jsonl

The SFT recipe of the gemma JAX repository's `gemma/diffusion/` (docs/reference.md, "Training recipe"): LoRA rank
8 on all linear layers, batch 8, 2,000 steps, lr 1.5e-4 warmed up over 100 steps and cosine-decayed to 1.5e-5,
gradient clipping 1.0, Adam (0.95, 0.99), weight decay 1e-4. The base loads in the dtype it was saved in (bf16);
adapters and their Adam moments are fp32. What makes it fit one 80 GB device: per-layer rematerialisation with the
layers scanned, the vocabulary-tiled loss and a step of 8 examples as 4 micro-batches of 2 (memory per case:
`scripts/memory_report.py`, docs/scaling.md).

Other hardware (same file, override on the command line; check the memory report's mesh case first):
- 8 GPUs on one host: `--config.mesh.fsdp=8 --config.train.batch_size=64 --config.train.grad_accum_steps=1`
  (batch 8 per device). Full fine-tuning instead of LoRA: `--config.lora.enabled=False` (fp32 master weights and
  Adam moments by default, `optimizer.master_weights='auto'`).
- TPU v5p-8 (4 chips x 95 GB): `--config.mesh.fsdp=4 --config.train.batch_size=32`. TPU v5e-8 (8 chips x 16 GB):
  `--config.mesh.fsdp=8 --config.train.batch_size=8` (batch 1 per chip).
"""

import ml_collections

from hackable_diffusion.configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  # a HF DiffusionGemma directory (config.json + safetensors), loaded in the dtype it was saved in (bf16)
  config.model.update(preset="", checkpoint="google/diffusiongemma-26B-A4B-it")
  config.model.overrides = ml_collections.ConfigDict(dict(
      remat="nothing_saveable",  # keep only each layer's input for the backward pass (model/remat.py)
      scan_layers=True,  # one scan over the 5 groups of 6 layers (model/scan.py): 1/5 of the compile
      moe_impl="tiled",  # each token through its top-8 experts only
  ))
  # the release's own tokenizer files (tokenizer.json, tokenizer_config.json, chat template)
  config.tokenizer.path = "checkpoint"
  # SFT JSONL: {"prompt": ..., "completion": ...} or {"messages": [...]} lines
  config.data.train_path = "data/train.jsonl"
  config.data.messages_field = "messages"  # chat records: the loss is on the final assistant turn only
  config.data.update(
      chat_template="tokenizer",  # the checkpoint's jinja chat template (Gemma 4: <|turn>user ... <turn|>)
      max_prompt_length=256,  # and one canvas of 256 completion tokens
      add_bos=True)  # not added twice when the chat template writes <bos> itself
  config.optimizer.update(peak_lr=1.5e-4, warmup_steps=100, b1=0.95, weight_decay=1e-4)
  # 4 micro-batches of 2 per step of 8; no validation split by default: set data.validation_path to evaluate
  config.train.update(steps=2_000, batch_size=8, grad_accum_steps=4, log_every=10, eval_at_end=False)
  # sampler temporaries at batch 8: docs/scaling.md (the memory report's case c)
  config.eval.update(num_examples=64, batch_size=8, step_budgets=(32,), early_stopping_steps=32, num_samples=4)
  config.lora = ml_collections.ConfigDict(dict(
      enabled=True, rank=8, alpha=16.0, dropout=0.0, target_modules="all-linear", param_dtype="float32", seed=0,
      # QLoRA: 'fp8' (a 48 GB card), 'int4' or 'nvfp4' - the frozen base quantized tensor by tensor as it loads
      base_quantization="none", base_block_size=64))
  return config
