"""Runs: what a run is, apart from how it trains. Evaluation, sampling and export read a run through here.

  config_files.py  finding, running and overriding config files; a run's `config.json`
  config.py        `ExperimentConfig`: the typed, validated config sections (model, data, optimizer, eval, ...)
  workdir.py       a workdir before training: preflight checks, the lock, resume compatibility, config.json
  checkpoints.py   the orbax checkpoints of a run (`workdir/checkpoints/<step>/`): choosing a step, saving,
                   restoring
  run.py           the workdir layout; building a run's tokenizer, model, mesh, data and evaluation from its
                   config; `load_run` (a trained model restored from a workdir)
  sampling.py      sampling prompts with a run's (or a checkpoint's) model: the prompt as training encodes it,
                   the task's start canvas and allowed tokens, infilling; `sample` returns the completions

`training/` (the train step, optimizer, logging, the trainer) sits above this package; nothing here imports it.
"""
