"""The JSONL dataset writer and its CLI."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hackable_diffusion.tasks.sudoku import dataset, formatting, generator

REPO = pathlib.Path(__file__).resolve().parents[3]
SCRIPT = REPO / 'scripts' / 'make_sudoku_dataset.py'
SPLITS = ('train', 'validation', 'test')


def read_split(path) -> list[dict]:
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f]


def is_complete_valid(text: str) -> bool:
  g = np.array([int(ch) for ch in text]).reshape(9, 9)
  units = [g[r] for r in range(9)] + [g[:, c] for c in range(9)]
  units += [g[r : r + 3, c : c + 3].ravel() for r in (0, 3, 6) for c in (0, 3, 6)]
  return all(sorted(u.tolist()) == list(range(1, 10)) for u in units)


def bucket_of(givens: int) -> str:
  return 'easy' if givens >= 40 else ('medium' if givens >= 30 else 'hard')


def write(out_dir, **kwargs):
  args = dict(num_train=9, num_validation=6, num_test=6, seed=0, show_progress=False)
  args.update(kwargs)
  return dataset.write_dataset(out_dir, **args)


def test_writes_three_consistent_disjoint_splits(tmp_path):
  paths = write(tmp_path, bucket_weights={'easy': 1, 'medium': 1, 'hard': 1})
  assert paths == {s: tmp_path / f'{s}.jsonl' for s in SPLITS}
  assert sorted(os.listdir(tmp_path)) == ['test.jsonl', 'train.jsonl', 'validation.jsonl']
  prompts = {}
  for split, n in zip(SPLITS, (9, 6, 6)):
    records = read_split(paths[split])
    assert len(records) == n
    for rec in records:
      assert set(rec) == {'prompt', 'completion', 'givens', 'pinned'}
      assert rec['pinned'] == ''.join('0' if p == '0' else '1' for p in rec['prompt'])  # the givens
      prompt, completion = rec['prompt'], rec['completion']
      assert len(prompt) == len(completion) == 81 and prompt.isdigit() and completion.isdigit()
      assert is_complete_valid(completion)
      assert all(p == '0' or p == c for p, c in zip(prompt, completion))  # givens kept
      assert rec['givens'] == 81 - prompt.count('0')
    buckets = [bucket_of(r['givens']) for r in records]
    for bucket in ('easy', 'medium', 'hard'):
      assert buckets.count(bucket) == n // 3
    prompts[split] = [r['prompt'] for r in records]
  all_prompts = sum(prompts.values(), [])
  assert len(set(all_prompts)) == len(all_prompts)  # disjoint splits, no repeats


def test_deterministic_and_independent_of_workers(tmp_path):
  write(tmp_path / 'a', seed=3)
  write(tmp_path / 'b', seed=3, workers=2, chunk_size=2)  # several chunks per split
  write(tmp_path / 'c', seed=4)
  for split in SPLITS:
    a = (tmp_path / 'a' / f'{split}.jsonl').read_bytes()
    assert a == (tmp_path / 'b' / f'{split}.jsonl').read_bytes()
    assert a != (tmp_path / 'c' / f'{split}.jsonl').read_bytes()


def test_eval_splits_do_not_depend_on_num_train(tmp_path):
  write(tmp_path / 'small', num_train=3)
  write(tmp_path / 'big', num_train=12)
  for split in ('validation', 'test'):
    assert (tmp_path / 'small' / f'{split}.jsonl').read_bytes() == (
        tmp_path / 'big' / f'{split}.jsonl'
    ).read_bytes()
  assert len(read_split(tmp_path / 'big' / 'train.jsonl')) == 12


def test_training_mix_leaves_the_eval_splits_alone(tmp_path):
  mix = {'easy': 1.0, 'medium': 1.0}
  write(tmp_path / 'same', num_train=8, bucket_weights=mix)
  write(tmp_path / 'hard', num_train=8, bucket_weights=mix, train_bucket_weights={'medium': 1.0, 'hard': 3.0})
  for split in ('validation', 'test'):
    assert (tmp_path / 'same' / f'{split}.jsonl').read_bytes() == (tmp_path / 'hard' / f'{split}.jsonl').read_bytes()
  train = [bucket_of(r['givens']) for r in read_split(tmp_path / 'hard' / 'train.jsonl')]
  assert sorted(train) == ['hard'] * 6 + ['medium'] * 2  # exact counts of the training mix
  assert {bucket_of(r['givens']) for r in read_split(tmp_path / 'same' / 'test.jsonl')} == {'easy', 'medium'}


def test_repeated_puzzles_are_redrawn_in_the_same_bucket():
  config = generator.GeneratorConfig()
  first = generator.generate_dataset(6, seed=9, config=config)
  taken = {formatting.puzzle_to_prompt(first.puzzles[k]) for k in (0, 4)}
  seen = set(taken)
  redrawn = dataset._generate_split(
      6, seed=9, seen=seen, bucket_weights=None, config=config, workers=1, chunk_size=64,
      progress=lambda n: None,
  )
  prompts = [formatting.puzzle_to_prompt(p) for p in redrawn.puzzles]
  assert not taken & set(prompts)
  for k in (1, 2, 3, 5):  # the rest is untouched
    np.testing.assert_array_equal(redrawn.puzzles[k], first.puzzles[k])
  assert redrawn.buckets == first.buckets
  assert seen == taken | set(prompts)


def test_refuses_to_overwrite(tmp_path):
  write(tmp_path)
  before = {s: (tmp_path / f'{s}.jsonl').read_bytes() for s in SPLITS}
  with pytest.raises(FileExistsError, match='overwrite=True'):
    write(tmp_path, seed=1)
  assert before == {s: (tmp_path / f'{s}.jsonl').read_bytes() for s in SPLITS}
  write(tmp_path, seed=1, overwrite=True)
  assert before['train'] != (tmp_path / 'train.jsonl').read_bytes()


def test_one_existing_file_is_enough_to_refuse(tmp_path):
  (tmp_path / 'test.jsonl').write_text('mine\n')
  with pytest.raises(FileExistsError):
    write(tmp_path)
  assert os.listdir(tmp_path) == ['test.jsonl']
  assert (tmp_path / 'test.jsonl').read_text() == 'mine\n'


def test_interrupted_run_leaves_no_file(tmp_path, monkeypatch):
  real = dataset._write_jsonl
  calls = []

  def flaky(path, data):
    calls.append(path)
    if len(calls) == 2:
      raise KeyboardInterrupt
    real(path, data)

  monkeypatch.setattr(dataset, '_write_jsonl', flaky)
  with pytest.raises(KeyboardInterrupt):
    write(tmp_path)
  assert len(calls) == 2
  assert os.listdir(tmp_path) == []  # neither final nor temporary files


def test_ensure_dataset(tmp_path):
  kwargs = dict(num_validation=3, num_test=3, show_progress=False)
  paths = dataset.ensure_dataset(tmp_path / 'd', num_train=3, **kwargs)
  stamp = {s: p.stat().st_mtime_ns for s, p in paths.items()}
  again = dataset.ensure_dataset(tmp_path / 'd', num_train=5, **kwargs)
  assert again == paths
  assert stamp == {s: p.stat().st_mtime_ns for s, p in again.items()}
  assert len(read_split(paths['train'])) == 3  # existing data is used as is
  paths['validation'].unlink()
  with pytest.raises(FileExistsError, match='incomplete'):
    dataset.ensure_dataset(tmp_path / 'd', num_train=3, num_validation=3, num_test=3)


def test_negative_counts_rejected(tmp_path):
  with pytest.raises(ValueError, match='num_validation must be >= 0, got -1'):
    write(tmp_path, num_validation=-1)


def run_cli(*args):
  return subprocess.run(
      [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, timeout=120
  )


def test_cli(tmp_path):
  args = [f'--out_dir={tmp_path}', '--num_train=6', '--num_validation=2', '--num_test=2', '--seed=5']
  args += ['--workers=1', '--easy_weight=1', '--medium_weight=0', '--hard_weight=1']
  result = run_cli(*args)
  assert result.returncode == 0, result.stderr
  train = read_split(tmp_path / 'train.jsonl')
  assert sorted(bucket_of(r['givens']) for r in train) == ['easy'] * 3 + ['hard'] * 3
  assert len(read_split(tmp_path / 'test.jsonl')) == 2
  # The same arguments through the library give the same bytes.
  dataset.write_dataset(
      tmp_path / 'lib', num_train=6, num_validation=2, num_test=2, seed=5,
      bucket_weights={'easy': 1, 'medium': 0, 'hard': 1}, show_progress=False,
  )
  for split in SPLITS:
    cli_bytes = (tmp_path / f'{split}.jsonl').read_bytes()
    assert cli_bytes == (tmp_path / 'lib' / f'{split}.jsonl').read_bytes()

  refused = run_cli(*args, '--seed=6')
  assert refused.returncode != 0
  assert 'refusing to overwrite' in refused.stderr
  assert train == read_split(tmp_path / 'train.jsonl')
  assert run_cli(*args, '--seed=6', '--overwrite').returncode == 0
  assert train != read_split(tmp_path / 'train.jsonl')

  bad = run_cli(f'--out_dir={tmp_path / "x"}', '--hard_givens=10,20')
  assert bad.returncode != 0 and 'hard_givens must be' in bad.stderr


def test_a_split_is_never_written_through_a_symbolic_link(tmp_path):
  from hackable_diffusion.errors import UnsafePathError

  victim = tmp_path / 'victim'
  victim.write_text('keep')
  out_dir = tmp_path / 'd'
  out_dir.mkdir()
  (out_dir / f'train.jsonl.tmp-{os.getpid()}').symlink_to(victim)  # planted at the temporary name of this process
  with pytest.raises(UnsafePathError):
    write(out_dir, num_train=3)
  assert victim.read_text() == 'keep' and not any(p.name.endswith('.jsonl') for p in out_dir.iterdir())
