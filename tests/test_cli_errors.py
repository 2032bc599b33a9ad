"""User errors of the CLIs (a broken config file, a refused prompt, and `--verbose`): one `error:` line, exit code 1.

- A broken config file (syntax error, an exception while it runs, no `get_config`) is named with its line before
  absl / ml_collections load it (in-process through `cli.prepare_argv`, and as `train` / `evaluate` print it).
- Every CLI takes `--verbose`: the same line, then the traceback.
- `sample`'s refusal of a prompt training would refuse is tested on its library function in
  tests/runs/test_sampling.py, and through the CLI in tests/test_sample_cli.py.
`export`'s refusal to overwrite is tested with a model in tests/interop/test_export.py.

Only this module imports `hackable_diffusion.sample` in-process (its flags would clash with those of
`hackable_diffusion.export` / `train` in one process); the other CLIs run as subprocesses.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hackable_diffusion import cli as cli_lib
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.runs import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (source, the one line's pattern after 'error: ')
BROKEN_CONFIGS = {
    "bad_syntax.py": ("import ml_collections\n\n\ndef get_config():\n  return ml_collections.ConfigDict(dict(a=(1,)\n",
                      r"bad_syntax\.py:5: SyntaxError: '\(' was never closed$"),
    "bad_indent.py": ("def get_config():\n  x = 1\n    return x\n", r"bad_indent\.py:3: IndentationError: "),
    "raises.py": ("import ml_collections\n\nraise RuntimeError('boom at import')\n",
                  r"raises\.py:3: RuntimeError: boom at import$"),
    "bad_import.py": ("import no_such_module_xyz\n", r"bad_import\.py:1: ModuleNotFoundError: .*no_such_module_xyz"),
    "no_get_config.py": ("X = 1\n", r"no_get_config\.py: defines no get_config\(\)"),
    "get_config_raises.py": ("def get_config():\n  return {'a': 1 / 0}\n",
                             r"get_config_raises\.py:2: ZeroDivisionError: division by zero$"),
}


@pytest.fixture()
def broken_configs(tmp_path):
  for name, (source, _) in BROKEN_CONFIGS.items():
    (tmp_path / name).write_text(source)
  return tmp_path


def test_broken_config_files_are_one_line_errors_naming_file_and_line(broken_configs):
  for name, (_, pattern) in BROKEN_CONFIGS.items():
    path = str(broken_configs / name)
    for call in (lambda: cli_lib.prepare_argv(["prog", f"--config={path}"]),  # what every CLI runs before absl
                 lambda: config_lib.load_config_file(path)):
      with pytest.raises(ConfigError) as err:
        call()
      message = str(err.value)
      assert "\n" not in message and message.startswith(path), message
      assert re.search(pattern, message), (pattern, message)
  # with override keys, the file is still the first thing checked
  with pytest.raises(ConfigError, match=r"bad_syntax\.py:5: SyntaxError"):
    cli_lib.prepare_argv(["prog", f"--config={broken_configs / 'bad_syntax.py'}", "--config.train.steps=3"])
  assert cli_lib.prepare_argv(["prog", "--config=tiny.py"])[1].endswith("tiny.py")  # a good file passes


def test_verbose_requested_reads_argv():
  assert not cli_lib.verbose_requested(["prog"])
  assert cli_lib.verbose_requested(["prog", "--verbose"])
  assert cli_lib.verbose_requested(["prog", "-verbose=true"])
  assert not cli_lib.verbose_requested(["prog", "--verbose", "--noverbose"])
  assert not cli_lib.verbose_requested(["prog", "--verbose=false"])
  assert not cli_lib.verbose_requested(["prog", "--", "--verbose"])
  assert not cli_lib.verbose_requested(["prog", "--verbose_x"])


def _cli(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
  path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0", JAX_PLATFORMS="cpu", PYTHONPATH=path)
  return subprocess.run([sys.executable, "-m", f"hackable_diffusion.{module}", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


# Each CLI with an error it reports: two while parsing the command line (a broken config file), two from main().
CLI_ERRORS = [
    ("train", ["--config=bad_syntax.py", "--workdir=w"], r"^error: bad_syntax\.py:5: SyntaxError: '\(' was never "
     r"closed$"),
    ("evaluate", ["--config=raises.py", "--workdir=w"], r"^error: raises\.py:3: RuntimeError: boom at import$"),
    ("sample", ["--prompt=123"], r"^error: pass exactly one of --workdir .* and --checkpoint"),
    ("export", ["--out=o"], r"^error: --format is required"),
]


@pytest.mark.parametrize("module,args,pattern", CLI_ERRORS, ids=[c[0] for c in CLI_ERRORS])
def test_every_cli_prints_one_line_and_with_verbose_the_traceback(module, args, pattern, broken_configs):
  quiet = _cli(module, *args, cwd=broken_configs)
  assert quiet.returncode == 1, quiet.stderr[-2000:]
  lines = quiet.stderr.strip().splitlines()
  assert len(lines) == 1 and re.search(pattern, lines[0]), quiet.stderr[-3000:]
  loud = _cli(module, *args, "--verbose", cwd=broken_configs)
  assert loud.returncode == 1, loud.stderr[-2000:]
  lines = loud.stderr.strip().splitlines()
  assert lines[0] == quiet.stderr.strip(), loud.stderr[-3000:]  # the same line first
  assert "Traceback (most recent call last):" in loud.stderr and len(lines) > 3, loud.stderr[-3000:]
  assert lines[-1].startswith("hackable_diffusion.errors.ConfigError: "), lines[-1]
  assert not (broken_configs / "w").exists() and not (broken_configs / "o").exists()


def test_get_config_returning_no_config_dict_is_one_line(tmp_path):
  """absl's config flags need a ConfigDict: a dict or another mapping from get_config() is one line naming the file,
  in-process and through `train`."""
  sources = ("def get_config():\n  return {'train': {'steps': 2}}\n",
             "import types\n\n\ndef get_config():\n  return types.MappingProxyType({'train': {}})\n")
  for source in sources:
    path = tmp_path / "returns.py"
    path.write_text(source)
    with pytest.raises(ConfigError, match=r"returns\.py: get_config\(\) returned a (dict|mappingproxy), not an "
                                          r"ml_collections\.ConfigDict"):
      cli_lib.prepare_argv(["prog", f"--config={path}"])
  res = _cli("train", f"--config={path}", "--workdir=w", cwd=tmp_path)
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 1 and len(lines) == 1, res.stderr[-3000:]
  assert re.search(r"^error: .*returns\.py: get_config\(\) returned a mappingproxy", lines[0]), lines[0]


def test_trust_remote_code_is_read_from_argv():
  assert not cli_lib.trust_requested(["prog"])
  assert cli_lib.trust_requested(["prog", "--trust_remote_code"])
  assert not cli_lib.trust_requested(["prog", "--trust_remote_code", "--notrust_remote_code"])


def test_a_prompt_longer_than_the_models_positions_is_refused():
  from hackable_diffusion import sample

  class Chars:
    encode = staticmethod(lambda text: list(range(len(text))))

  sample.check_prompt_positions(Chars(), ["abc"], 3)
  with pytest.raises(ConfigError, match=r"^prompt 1 is 5 tokens, more than the model's max_position_embeddings=3"):
    sample.check_prompt_positions(Chars(), ["abc", "abcde"], 3)
