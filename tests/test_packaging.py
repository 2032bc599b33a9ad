"""A plain (non-editable) install works outside the repository: a wheel installed into a fresh virtualenv, run
from an empty directory, finds the shipped configs by bare name and runs the trainer and the Python API."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, **kw):
  res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
  assert res.returncode == 0, f"{cmd}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
  return res


def test_distribution_name_does_not_collide_and_ships_the_configs():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)
  # Google's general `hackable-diffusion` package on the public index uses the same import name
  assert project["project"]["name"].replace("_", "-").lower() != "hackable-diffusion"
  assert "configs/*.py" in project["tool"]["setuptools"]["package-data"]["hackable_diffusion"]
  shipped = sorted(os.listdir(os.path.join(REPO, "hackable_diffusion", "configs")))
  assert "sudoku.py" in shipped and "tiny.py" in shipped
  assert os.path.realpath(os.path.join(REPO, "configs")) == os.path.join(REPO, "hackable_diffusion", "configs")


def running_site_dirs() -> list[str]:
  """The site-packages folders the running interpreter imports from: the system's, or a virtualenv's own (whose
  `--system-site-packages` would expose the base interpreter's folders instead, without this run's dependencies)."""
  dirs = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
  assert dirs, f"no site-packages folder on sys.path: {sys.path}"
  return list(dict.fromkeys(dirs))


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
  """A fresh virtualenv with the wheel of this checkout; the dependencies come from the running interpreter's site
  folders (no network), added after the venv's own so the wheel, not this checkout, is what imports."""
  root = tmp_path_factory.mktemp("wheel")
  src = root / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(REPO, name), src / name)
  shutil.copytree(os.path.join(REPO, "hackable_diffusion"), src / "hackable_diffusion",
                  ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
       str(src)])
  wheels = list((root / "dist").glob("*.whl"))
  assert len(wheels) == 1, wheels
  run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")])
  python = str(root / "venv" / "bin" / "python")
  own_site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
  with open(os.path.join(own_site, "running_interpreter.pth"), "w", encoding="utf-8") as f:
    f.writelines(f"import site; site.addsitedir({d!r})\n" for d in running_site_dirs())
  run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", own_site, str(wheels[0])])
  empty = root / "empty"
  empty.mkdir()
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env.update(JAX_PLATFORMS="cpu", PYTHONNOUSERSITE="1")
  scripts = os.path.join(own_site, "bin")  # pip --target puts the console scripts here
  return python, str(empty), env, str(root / "venv"), scripts


def test_wheel_runs_the_shipped_config_and_the_api_outside_the_repo(venv):
  python, cwd, env, prefix, scripts = venv
  where = run([python, "-c", "import hackable_diffusion as hd; print(hd.__file__)"], cwd=cwd, env=env).stdout
  assert where.strip().startswith(prefix), where  # the installed wheel, not this checkout
  # the console script hd-train is `python -m hackable_diffusion.train`
  res = run([os.path.join(scripts, "hd-train"), "--config=sudoku.py", "--workdir=sudoku_run", "--no_progress",
             "--config.train.steps=2", "--config.train.log_every=1", "--config.train.eval_at_end=false",
             "--config.data.generator_args.num_train=32", "--config.data.generator_args.num_validation=4",
             "--config.data.generator_args.num_test=4", "--config.train.batch_size=8"], cwd=cwd, env=env)
  assert "done: sudoku_run" in res.stdout
  assert os.path.isdir(os.path.join(cwd, "sudoku_run", "checkpoints", "2"))
  script = textwrap.dedent("""
      import json, random
      import hackable_diffusion as hd
      rng = random.Random(0)
      records = []
      for _ in range(32):
        s = "".join(rng.choice("0123456789") for _ in range(5))
        records.append({"prompt": s, "completion": "".join(sorted(s))})
      config = hd.get_preset("tiny", canvas_length=6, vocab_size=16)
      args = hd.SFTConfig(output_dir="api_run", max_steps=2, batch_size=4, eval_at_end=False, max_prompt_length=6)
      with hd.SFTTrainer(model=config, train_dataset=records, args=args, progress=False) as trainer:
        print(json.dumps({"step": trainer.trainer.step if trainer.train() else -1}))
      print(json.dumps({"shipped": hd.SFTTrainer.from_config("tiny.py", "unused").config.data.generator}))
  """)
  res = run([python, "-c", script], cwd=cwd, env=env)
  assert '{"step": 2}' in res.stdout and '{"shipped": "digits"}' in res.stdout, res.stdout


def test_wheel_installs_the_console_scripts(venv):
  python, cwd, env, _, scripts = venv
  for name in ("hd-train", "hd-evaluate", "hd-sample", "hd-export", "hd-import-sudoku"):
    assert os.access(os.path.join(scripts, name), os.X_OK), sorted(os.listdir(scripts))
  grid = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"
  with open(os.path.join(cwd, "puzzles.txt"), "w", encoding="utf-8") as f:
    f.write(grid + "\n")
  res = run([os.path.join(scripts, "hd-import-sudoku"), "--input=puzzles.txt", "--out=mine.jsonl"], cwd=cwd, env=env)
  assert "1 puzzles" in res.stdout and "1 solved here" in res.stdout, res.stdout
  res = run([os.path.join(scripts, "hd-export"), "--helpshort"], cwd=cwd, env=env)
  assert "--format" in res.stdout, res.stdout
