"""A real two-process JAX job on CPU (`jax.distributed` with gloo, one CPU device per process): the `train` CLI run
as a multi-host job does (`$JAX_COORDINATOR_ADDRESS`, `$JAX_NUM_PROCESSES`, `$JAX_PROCESS_ID`, `mesh.data=-1`).

- A workdir locked by another run: process 0 is refused (the lock is its alone) and process 1, which takes no lock,
  stops at once with one line naming process 0's refusal, instead of running on into its first collective and
  failing there with a gloo timeout (what it did before `runs/workdir.py` made the processes agree).
- Then, the lock released, the same command trains, checkpoints and finishes on both processes.
- Process 1 cannot make its data (a test task that fails there): process 0, which holds the lock and would have
  gone on to its first collective, stops with one line naming process 1 and releases the lock.
- A workdir the hosts do not share (a relative `--workdir` in another directory on each process), whose copy on
  process 0 holds a checkpoint: both stop with one line saying so, before any restore (which would fail inside
  orbax with a message that calls the checkpoint damaged) and without touching it.
- Evaluating that workdir: process 1 finds no config.json while parsing its flags, joins the job to say so, and
  process 0 stops at once (`sharding.tell_job_and_leave`; it does not wait out the 5-minute initialization timeout).
  With the run's files but no checkpoints on process 1, both stop at `load_run`'s agreement point (after joining,
  before the restore's collectives); with only an older checkpoint there, both say the hosts see different steps.
- `sharding.first_failure` itself across the two processes: no failure, one (a message longer than the exchange
  holds, cut and marked), two (the lower process wins); `stop_together` relaying a bug's exception type;
  `sharding.agree_on` with and without a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from hackable_diffusion.sharding.mesh import MESSAGE_BYTES
from hackable_diffusion.training import logging as log_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.runs.workdir import WorkdirLock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, "tests")
PROCESSES = 2
STEPS = 6


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _job(args: list[str], cwd: str | list[str], timeout: float = 240) -> list[subprocess.CompletedProcess]:
  """Starts the processes of one job together (same `args`; one `cwd` or one per process) and waits for all."""
  port = _free_port()
  cwds = [cwd] * PROCESSES if isinstance(cwd, str) else cwd
  procs = []
  for index, cwd in enumerate(cwds):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
               JAX_NUM_PROCESSES=str(PROCESSES), JAX_PROCESS_ID=str(index),  # tests/: custom_components
               PYTHONPATH=os.pathsep.join(p for p in (REPO, TESTS, os.environ.get("PYTHONPATH")) if p))
    procs.append(subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True))
  results = []
  for proc in procs:
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      pytest.fail(f"a process of the {PROCESSES}-process job did not end within {timeout} s")
    results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
  return results


def _train_job(workdir: str, cwd: str | list[str], *more: str) -> list[subprocess.CompletedProcess]:
  return _job([sys.executable, "-m", "hackable_diffusion.train", "--config=tiny.py", f"--workdir={workdir}",
               "--config.mesh.data=-1", f"--config.train.steps={STEPS}", f"--config.train.checkpoint_every={STEPS // 2}",
               "--config.train.log_every=2", "--config.train.eval_at_end=false", "--no_progress", *more], cwd)


def test_a_failure_on_process_1_while_setting_up_stops_process_0_too(tmp_path):
  workdir = tmp_path / "run"
  first, second = _train_job(str(workdir), str(tmp_path),
                             "--config.data.generator=custom_components:DigitsMissingOnProcess")
  for res in (first, second):
    assert res.returncode == 1, res.stderr[-3000:]
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr[-3000:]
  missing = f"{workdir}/data: no data on process 1 (custom_components.DigitsMissingOnProcess)"
  assert second.stderr == f"error: {missing}\n", second.stderr
  assert first.stderr == f"error: process 1 of {PROCESSES} stopped before training: {missing}\n", first.stderr
  assert (workdir / "config.json").exists() and not (workdir / ".lock").exists()  # process 0 let the workdir go
  assert not (workdir / "checkpoints").exists()


FIRST_FAILURE_SCRIPT = """
import json, os
from hackable_diffusion import sharding as sh
from hackable_diffusion.sharding.mesh import MESSAGE_BYTES
sh.maybe_initialize_distributed()
me = int(os.environ["JAX_PROCESS_ID"])
long = "\u00e9" * MESSAGE_BYTES  # 2 bytes each in utf-8: twice what one process can tell the others
told = [sh.first_failure(None), sh.first_failure(long if me == 1 else None), sh.first_failure(f"process {me} failed")]
try:  # a bug (not a project error) with a two-line message on process 1: the others' line names its type
  sh.stop_together(RuntimeError("no x\\nsecond line") if me == 1 else None)
except Exception as e:
  told.append([type(e).__name__, str(e)])
told.append(sh.agree_on(lambda: me * 10, together=True, before="x"))  # no failure: each its own result
def fails_on_0():
  if me == 0:
    raise FileNotFoundError("eval.jsonl: no such file")
  return me
try:
  told.append(sh.agree_on(fails_on_0, together=True, before="evaluating"))
except Exception as e:
  told.append([type(e).__name__, str(e)])
print(json.dumps(told))
"""


def test_first_failure_tells_every_process_the_lowest_failing_one(tmp_path):
  results = _job([sys.executable, "-c", FIRST_FAILURE_SCRIPT], str(tmp_path), timeout=120)
  cut = "\u00e9" * ((MESSAGE_BYTES - 3) // 2) + "..."  # whole characters only: none is split in two
  for res in results:
    assert res.returncode == 0, res.stderr[-3000:]
    told = json.loads(res.stdout.strip().splitlines()[-1])
    assert told[:3] == [None, [1, cut], [0, "process 0 failed"]]
  assert json.loads(results[1].stdout.strip().splitlines()[-1])[3] == ["RuntimeError", "no x\nsecond line"]
  assert json.loads(results[0].stdout.strip().splitlines()[-1])[3] == [
      "TrainingError", "process 1 of 2 stopped before training: RuntimeError: no x second line"]
  # `agree_on`: the results when every process succeeded; else the failing process its own error, the others a line
  assert [json.loads(res.stdout.strip().splitlines()[-1])[4:] for res in results] == [
      [0, ["FileNotFoundError", "eval.jsonl: no such file"]],
      [10, ["TrainingError", "process 0 of 2 stopped before evaluating: FileNotFoundError: eval.jsonl: no such file"]]]


@pytest.mark.slow  # three two-process jobs, one of them training
def test_a_refused_lock_stops_every_process_then_the_job_trains_and_an_unshared_workdir_is_refused(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  with WorkdirLock(str(workdir)):  # another run holds the workdir
    first, second = _train_job(str(workdir), str(tmp_path))
  owner = f"is in use by another training run (pid {os.getpid()} on host"
  for res in (first, second):
    assert res.returncode == 1, res.stderr[-3000:]
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr[-3000:]
  assert first.stderr.startswith(f"error: workdir {workdir} {owner}"), first.stderr
  assert second.stderr.startswith(f"error: process 0 of {PROCESSES} stopped before training: workdir {workdir} "
                                  f"{owner}"), second.stderr
  assert os.listdir(workdir) == []  # refused before anything was written; the holder's lock file went with it

  results = _train_job(str(workdir), str(tmp_path))
  for res in results:
    assert res.returncode == 0, res.stderr[-3000:]
  done = [next(line for line in res.stdout.splitlines() if line.startswith("done: ")) for res in results]
  assert done[0].startswith(f"done: {workdir} (loss=")
  # the loss is the global batch's on both processes (tokens/s and steps/s are each process's own clock)
  assert done[0].split(", tokens_per_s=")[0] == done[1].split(", tokens_per_s=")[0], done
  assert run_lib.load_run(str(workdir)).step == STEPS
  steps = [r["step"] for r in log_lib.read_metrics(str(workdir)) if "train/loss" in r]
  assert steps == list(range(2, STEPS + 1, 2))  # written once (process 0), no step twice
  with open(workdir / "config.json") as f:
    assert json.load(f)["mesh"]["data"] == -1
  assert not (workdir / ".lock").exists()  # released at the end

  # a workdir each host sees its own copy of: process 0's holds the checkpoint, process 1's is empty
  hosts = [tmp_path / "host0", tmp_path / "host1"]
  for host in hosts:
    host.mkdir()
  shutil.copytree(workdir, hosts[0] / "run")
  before = sorted(os.listdir(hosts[0] / "run" / "checkpoints"))
  results = _train_job("run", [str(h) for h in hosts])  # the same command again
  seen = (f"checkpoints: the processes of this job see different checkpoints (process 0: step {STEPS}, process 1: "
          "none); a multi-host run needs its workdir on a file system that every host shares")
  for host, res in zip(hosts, results):
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stderr == f"error: {host / 'run'}/{seen}\n", res.stderr
  assert sorted(os.listdir(hosts[0] / "run" / "checkpoints")) == before
  assert run_lib.load_run(str(hosts[0] / "run")).step == STEPS

  # evaluating it there: process 1 has no config.json, so it fails while parsing its flags, before it joins the job.
  # It joins to say so and process 0 stops at once (had process 1 not joined, process 0 would wait in
  # jax.distributed.initialize until the 5-minute timeout aborts it with a C++ check failure), before restoring anything.
  if (hosts[1] / "run" / "config.json").exists():
    os.remove(hosts[1] / "run" / "config.json")
  results = _job([sys.executable, "-m", "hackable_diffusion.evaluate", "--workdir=run", "--out=report"],
                 [str(h) for h in hosts], timeout=120)
  missing = ("run/config.json: no such file; pass --config=FILE or a --workdir written by "
             "hackable_diffusion.train")
  assert [r.returncode for r in results] == [1, 1], [r.stderr[-3000:] for r in results]
  assert results[1].stderr == f"error: {missing}\n", results[1].stderr
  stopped = f"error: process 1 of {PROCESSES} stopped before the job started: {missing}\n"
  assert results[0].stderr == stopped, results[0].stderr
  assert not list((hosts[0] / "report").glob("*"))  # nothing evaluated (the directory is checked writable first)

  # process 1's copy has the run's files but no checkpoints: it fails reading them after joining, and process 0
  # stops at the agreement point of `load_run` instead of waiting for process 1 inside the restore's collectives
  shutil.copytree(hosts[0] / "run", hosts[1] / "run", dirs_exist_ok=True, ignore=shutil.ignore_patterns("checkpoints"))
  evaluate = [sys.executable, "-m", "hackable_diffusion.evaluate", "--workdir=run", "--out=report"]
  results = _job(evaluate, [str(h) for h in hosts], timeout=120)
  none = f"{hosts[1] / 'run' / 'checkpoints'}: no checkpoint directory (has this workdir been trained?)"
  assert [r.returncode for r in results] == [1, 1], [r.stderr[-3000:] for r in results]
  assert results[1].stderr == f"error: {none}\n", results[1].stderr
  assert results[0].stderr == f"error: process 1 of {PROCESSES} stopped before restoring the checkpoint: {none}\n", (
      results[0].stderr)

  # only the older checkpoint on process 1: each host's latest step differs, which every host reports (restoring
  # different steps would give the hosts different weights, or fail inside orbax)
  older = str(STEPS // 2)
  shutil.copytree(hosts[0] / "run" / "checkpoints" / older, hosts[1] / "run" / "checkpoints" / older)
  results = _job(evaluate, [str(h) for h in hosts], timeout=120)
  assert [r.returncode for r in results] == [1, 1], [r.stderr[-3000:] for r in results]
  for host, res in zip(hosts, results):
    assert res.stderr == (f"error: {host / 'run' / 'checkpoints'}: the processes of this job see different checkpoints "
                          f"(process 0: step {STEPS}, process 1: step {older}); a multi-host run needs its workdir on "
                          "a file system that every host shares\n"), res.stderr
  assert not list((hosts[0] / "report").glob("*"))


def test_a_failing_process_prints_its_line_before_it_waits_for_the_job(tmp_path):
  """A process that fails before joining prints its one line first, then joins to tell the others: when they were
  never started, the join waits (until JAX's timeout), and the user has the line meanwhile."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"localhost:{_free_port()}",
             JAX_NUM_PROCESSES=str(PROCESSES), JAX_PROCESS_ID="1")  # process 0 never starts
  proc = subprocess.Popen([sys.executable, "-m", "hackable_diffusion.evaluate", "--workdir=run"], env=env,
                          cwd=str(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.append(proc.stderr.readline()), daemon=True)
  reader.start()
  reader.join(timeout=60)
  still_waiting = proc.poll() is None
  proc.kill()
  proc.wait()
  assert lines == ["error: run/config.json: no such file; pass --config=FILE or a --workdir written by "
                   "hackable_diffusion.train\n"]
  assert still_waiting  # it went on to join the job (and would tell process 0, had that started)
