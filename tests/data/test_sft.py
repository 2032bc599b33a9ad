"""Tests for hackable_diffusion.data.sft: reading, tokenizing, errors, batching, resuming, sharding."""

import json
import logging

import numpy as np
import pytest

from hackable_diffusion.data.sft import DataError
from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.data.sft import SFTDataConfig
from hackable_diffusion.data.sft import load_records
from hackable_diffusion.data.sft import make_sft_dataset
from hackable_diffusion.data.sft import num_valid_canvases
from hackable_diffusion.data.tokenizer import train_tokenizer


@pytest.fixture(scope='module')
def tok():
  return train_tokenizer(['0123456789', 'abcdefghijklmnopqrstuvwxyz :|.'])


def write_jsonl(path, records):
  with open(path, 'w', encoding='utf-8') as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + '\n')
  return str(path)


def numbered(n):
  # record i: prompt 'p' + digits of i, completion: i % 7 + 1 copies of a letter
  return [{'prompt': f'p{i}', 'completion': 'abcdefg'[i % 7] * (i % 7 + 1)} for i in range(n)]


def config(path, **kw):
  base = dict(path=path, max_prompt_length=6, canvas_length=4, max_canvases=2, batch_size=4,
              prefetch_batches=0)
  base.update(kw)
  return SFTDataConfig(**base)


def one_line_error(excinfo, path, lineno=None):
  msg = str(excinfo.value)
  assert '\n' not in msg, msg
  assert str(path) in msg, msg
  if lineno is not None:
    assert f'{path}:{lineno}:' in msg, msg
  return msg


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize('field,value', [
    ('max_prompt_length', 0), ('canvas_length', -1), ('max_canvases', 0), ('batch_size', 0),
    ('on_overlength', 'skip'), ('on_malformed', 'ignore'), ('num_epochs', 0),
    ('chat_template', 'no placeholder'), ('chat_template', '{other}'), ('prompt_field', ''),
    ('path', []), ('prefetch_batches', -1), ('batch_size', 2.5), ('min_prompt_length', 7),
    ('min_prompt_length', -1),
])
def test_config_validation_names_field_and_value(field, value):
  with pytest.raises(ValueError) as e:
    config(**{'path': 'x.jsonl', field: value})
  assert field in str(e.value) and repr(value) in str(e.value)


def test_config_is_frozen_and_capacity():
  c = config('x.jsonl', canvas_length=8, max_canvases=3)
  assert c.completion_capacity == 24
  with pytest.raises(Exception):
    c.batch_size = 3  # type: ignore[misc]
  assert config(['a', 'b']).paths == ('a', 'b')


# ------------------------------------------------------------------------------------------ records
def test_padding_masks_eos_bos_and_template(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', [{'prompt': '12', 'completion': 'abcde'},
                                            {'prompt': '3', 'completion': ''}])
  cfg = config(path, chat_template='q:{prompt}|', add_bos=True)
  r = load_records(None, cfg, tok)
  pad, eos, bos = tok.pad_id, tok.eos_id, tok.bos_id
  p0 = [bos] + tok.encode('q:12|')  # 6 tokens = max_prompt_length
  p1 = [bos] + tok.encode('q:3|')
  np.testing.assert_array_equal(r.prompt_ids[0], p0)
  np.testing.assert_array_equal(r.prompt_ids[1], [pad] + p1)  # left-padded
  np.testing.assert_array_equal(r.prompt_mask, [[1] * 6, [0] + [1] * 5])
  np.testing.assert_array_equal(r.completion_ids[0], tok.encode('abcde') + [eos, pad, pad])
  np.testing.assert_array_equal(r.completion_ids[1], [eos] + [pad] * 7)  # right-padded
  np.testing.assert_array_equal(r.completion_mask.sum(1), [6, 1])
  assert r.prompt_ids.dtype == np.int32 and r.completion_ids.dtype == np.int32
  assert r.prompts == ['12', '3'] and r.completions == ['abcde', '']
  assert r.sources == [(path, 1), (path, 2)]
  b = r.batch([0, 1])
  assert isinstance(b, SFTBatch)
  assert b.prompt_mask.dtype == bool and b.completion_mask.dtype == bool
  np.testing.assert_array_equal(b.num_valid_canvases(4), [2, 1])
  assert b.num_valid_canvases(4).dtype == np.int32


def test_no_eos_and_num_valid_canvases_at_least_one(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', [{'prompt': '1', 'completion': ''},
                                            {'prompt': '1', 'completion': 'abcd'},
                                            {'prompt': '1', 'completion': 'abcde'}])
  r = load_records(None, config(path, append_eos=False), tok)
  np.testing.assert_array_equal(r.completion_lengths, [0, 4, 5])
  np.testing.assert_array_equal(num_valid_canvases(r.completion_mask, 4), [1, 1, 2])
  import jax.numpy as jnp
  out = num_valid_canvases(jnp.asarray(r.completion_mask), 4)
  np.testing.assert_array_equal(out, [1, 1, 2])
  assert out.dtype == jnp.int32


def test_blank_lines_and_bom_are_fine_multi_file(tmp_path, tok):
  a = tmp_path / 'a.jsonl'
  a.write_bytes(b'\xef\xbb\xbf{"prompt": "1", "completion": "a"}\r\n\n   \n'
                b'{"prompt": "2", "completion": "b"}')
  b = write_jsonl(tmp_path / 'b.jsonl', [{'prompt': '3', 'completion': 'c', 'extra': 1}])
  r = load_records([str(a), b], config('unused'), tok)
  assert r.prompts == ['1', '2', '3']
  assert r.sources == [(str(a), 1), (str(a), 4), (b, 1)]


def test_other_field_names(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', [{'q': '1', 'a': 'b'}])
  r = load_records(None, config(path, prompt_field='q', completion_field='a'), tok)
  assert r.completions == ['b']


# ------------------------------------------------------------------------------------------ errors
def test_missing_file(tmp_path, tok):
  path = tmp_path / 'nope.jsonl'
  with pytest.raises(DataError) as e:
    load_records(None, config(str(path)), tok)
  assert 'not found' in one_line_error(e, path)


def test_empty_file(tmp_path, tok):
  path = tmp_path / 'empty.jsonl'
  path.write_text('\n\n')
  with pytest.raises(DataError) as e:
    load_records(None, config(str(path)), tok)
  assert 'no records' in one_line_error(e, path)


GOOD = json.dumps({'prompt': '1', 'completion': 'a'})


@pytest.mark.parametrize('bad_line,expected', [
    (b'{"prompt": "1", "completion": "\xff\xfe"}', 'UTF-8'),
    (b'{"prompt": "1", "completion": ', 'invalid JSON'),
    (b'["prompt", "completion"]', 'JSON object'),
    (b'{"prompt": "1"}', "missing field 'completion'"),
    (b'{"prompt": 5, "completion": "a"}', "'prompt' must be a string"),
    (b'{"prompt": "1", "completion": null}', "'completion' must be a string"),
])
def test_malformed_line_error_names_file_and_line(tmp_path, tok, bad_line, expected):
  path = tmp_path / 'bad.jsonl'
  path.write_bytes(GOOD.encode() + b'\n' + GOOD.encode() + b'\n' + bad_line + b'\n' +
                   GOOD.encode() + b'\n')
  with pytest.raises(DataError) as e:
    load_records(None, config(str(path)), tok)
  assert isinstance(e.value, ValueError)
  msg = one_line_error(e, path, 3)
  assert expected in msg and 'on_malformed' in msg


def test_malformed_skip_counts_and_logs_once(tmp_path, tok, caplog):
  path = tmp_path / 'bad.jsonl'
  path.write_bytes(b'\n'.join([GOOD.encode(), b'{bad', b'\xff', GOOD.encode(), b'{"prompt": "1"}']))
  with caplog.at_level(logging.INFO):
    r = load_records(None, config(str(path), on_malformed='skip'), tok)
  assert len(r) == 2 and [n for _, n in r.sources] == [1, 4]
  assert r.stats == {'skipped_malformed': 3, 'truncated_prompts': 0, 'truncated_completions': 0, 'unk_tokens': 0}
  msgs = [rec.getMessage() for rec in caplog.records if 'skipped_malformed=3' in rec.getMessage()]
  assert len(msgs) == 1


def test_all_lines_skipped_is_an_error(tmp_path, tok):
  path = tmp_path / 'bad.jsonl'
  path.write_text('{bad\n[1]\n')
  with pytest.raises(DataError) as e:
    load_records(None, config(str(path), on_malformed='skip'), tok)
  assert 'no valid records' in one_line_error(e, path)


def test_overlong_prompt_error(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', [GOOD, {'prompt': '1234567', 'completion': 'a'}])
  with pytest.raises(DataError) as e:
    load_records(None, config(path), tok)
  msg = one_line_error(e, path, 2)
  assert '7 tokens' in msg and 'max_prompt_length=6' in msg and 'on_overlength' in msg


def test_short_prompt_under_min_prompt_length_is_an_error_that_counts_unknown_characters(tmp_path, tok):
  """A model's attention structure reads the first W prompt slots: a shorter prompt would be left-padded out of
  place. Here the second line's '#' and '~' are unknown to the tokenizer and collapse into one unk token, so its
  4 characters become 3 tokens (the first line, 4 known characters, passes)."""
  path = write_jsonl(tmp_path / 'd.jsonl', [{'prompt': '1234', 'completion': 'a'},
                                             {'prompt': '1#~2', 'completion': 'a'}])
  assert len(load_records(None, config(path, min_prompt_length=3), tok).prompts) == 2
  with pytest.raises(DataError) as e:
    load_records(None, config(path, min_prompt_length=4), tok)
  msg = one_line_error(e, path, 2)
  assert 'prompt is 3 tokens (1 of its tokens are unk' in msg and 'min_prompt_length=4' in msg, msg


def test_unknown_characters_are_counted_and_logged_with_the_first_line(tmp_path, tok, caplog):
  """Characters the tokenizer does not know become unk tokens (a run of them one token): never silent, the summary
  warning counts them and names the first line that has one."""
  path = write_jsonl(tmp_path / 'd.jsonl', [GOOD, {'prompt': '1#2', 'completion': 'a'},
                                             {'prompt': '1', 'completion': 'a~~b'}])
  with caplog.at_level(logging.INFO):
    r = load_records(None, config(path), tok)
  assert r.stats['unk_tokens'] == 2
  warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
  assert len(warnings) == 1 and 'unk_tokens=2' in warnings[0] and f'first at {path}:2' in warnings[0], warnings


def test_overlong_completion_error(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', [{'prompt': '1', 'completion': 'abcdefgh'}])
  with pytest.raises(DataError) as e:
    load_records(None, config(path), tok)
  msg = one_line_error(e, path, 1)
  assert '9 tokens' in msg and '=8' in msg and 'max_canvases' in msg


def test_truncate_counts_and_keeps_prompt_end_completion_start(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', [{'prompt': '1234567', 'completion': 'abcdefgh'},
                                            {'prompt': '12', 'completion': 'abcdefg'}])
  r = load_records(None, config(path, on_overlength='truncate'), tok)
  assert r.stats == {'skipped_malformed': 0, 'truncated_prompts': 1, 'truncated_completions': 1, 'unk_tokens': 0}
  np.testing.assert_array_equal(r.prompt_ids[0], tok.encode('234567'))
  # truncated completion: first 8 tokens, no eos; the other fits exactly with its eos
  np.testing.assert_array_equal(r.completion_ids[0], tok.encode('abcdefgh'))
  np.testing.assert_array_equal(r.completion_ids[1], tok.encode('abcdefg') + [tok.eos_id])
  np.testing.assert_array_equal(r.completion_lengths, [8, 8])


# ------------------------------------------------------------------------------------------ batching
def all_rows(batches):
  return [tuple(row) for b in batches for row in b.prompt_ids]


def test_one_epoch_covers_every_record_once(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', numbered(10))
  ds = make_sft_dataset(config(path, num_epochs=1, drop_remainder=False, seed=3), tok)
  batches = list(ds.iterator())
  assert [b.prompt_ids.shape[0] for b in batches] == [4, 4, 2]
  rows = all_rows(batches)
  assert sorted(rows) == sorted(tuple(r) for r in ds.records.prompt_ids)
  assert rows != [tuple(r) for r in ds.records.prompt_ids]  # shuffled
  assert ds.num_records == 10 and ds.num_batches == 3
  assert ds.stats['skipped_malformed'] == 0


def test_drop_remainder_and_no_shuffle_order(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', numbered(10))
  ds = make_sft_dataset(config(path, num_epochs=1, shuffle=False), tok)
  batches = list(ds.iterator())
  assert len(batches) == 2
  assert all_rows(batches) == [tuple(r) for r in ds.records.prompt_ids[:8]]


def test_deterministic_by_seed_and_epochs_reshuffle(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', numbered(12))

  def first(seed, n=6):
    it = make_sft_dataset(config(path, seed=seed), tok).iterator()
    return all_rows(next(it) for _ in range(n))

  a, b, c = first(0), first(0), first(1)
  assert a == b and a != c
  # forever: epoch 1 (rows 0..11) and epoch 2 (12..23) are different permutations of the records
  assert sorted(a[:12]) == sorted(a[12:]) and a[:12] != a[12:]


def test_resume_from_json_state_gives_same_batches(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', numbered(11))
  cfg = config(path, seed=7, prefetch_batches=2)
  it = make_sft_dataset(cfg, tok).iterator()
  for _ in range(4):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(5)]
  # a fresh process: new dataset object, restored iterator
  resumed = make_sft_dataset(cfg, tok).iterator(state)
  got = [next(resumed) for _ in range(5)]
  for e, g in zip(expected, got):
    for field in ('prompt_ids', 'prompt_mask', 'completion_ids', 'completion_mask'):
      np.testing.assert_array_equal(getattr(e, field), getattr(g, field))
  # set_state on an existing iterator works too, and a fresh iterator would differ
  it2 = make_sft_dataset(cfg, tok).iterator()
  fresh = next(it2)
  it2.set_state(state)
  np.testing.assert_array_equal(next(it2).prompt_ids, expected[0].prompt_ids)
  assert not np.array_equal(fresh.prompt_ids, expected[0].prompt_ids)


def test_sharding_disjoint_equal_sizes(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', numbered(11))
  shards = [make_sft_dataset(config(path, batch_size=1), tok, shard_index=i, shard_count=3)
            for i in range(3)]
  assert [s.num_records for s in shards] == [3, 3, 3]
  srcs = [[n for _, n in s.records.sources] for s in shards]
  assert srcs == [[1, 4, 7], [2, 5, 8], [3, 6, 9]]
  assert shards[0].total_records == 11
  with pytest.raises(ValueError, match='shard_index'):
    make_sft_dataset(config(path), tok, shard_index=3, shard_count=3)


def test_no_batch_possible_is_an_error(tmp_path, tok):
  path = write_jsonl(tmp_path / 'd.jsonl', numbered(3))
  with pytest.raises(DataError) as e:
    make_sft_dataset(config(path, num_epochs=1, batch_size=4), tok)
  assert 'batch_size=4' in one_line_error(e, path)
  # repeating forever, a batch can be filled from two epochs
  ds = make_sft_dataset(config(path, batch_size=4), tok)
  assert next(ds.iterator()).prompt_ids.shape == (4, 6)


def test_pinned_field_marks_completion_tokens(tmp_path, tok):
  path = write_jsonl(tmp_path / 'p.jsonl', [
      {'prompt': '12', 'completion': '3456', 'pins': '1001'},
      {'prompt': '7', 'completion': '89', 'pins': '01'},
  ])
  records = load_records(None, config(path, pinned_field='pins', canvas_length=4, max_canvases=2), tok)
  np.testing.assert_array_equal(records.completion_pinned[:, :5], [[1, 0, 0, 1, 0], [0, 1, 0, 0, 0]])
  assert not records.completion_pinned[:, 5:].any()  # eos and padding are never pinned
  batch = records.batch([1, 0])
  np.testing.assert_array_equal(batch.completion_pinned[0, :2], [False, True])


def test_pinned_field_errors_name_file_and_line(tmp_path, tok):
  path = write_jsonl(tmp_path / 'p.jsonl', [{'prompt': '1', 'completion': '23', 'pins': '1'}])
  with pytest.raises(DataError) as e:
    load_records(None, config(path, pinned_field='pins'), tok)
  one_line_error(e, path, 1)
  assert "'pins' has 1 entries but the completion has 2 tokens" in str(e.value)
  bad = write_jsonl(tmp_path / 'q.jsonl', [{'prompt': '1', 'completion': '23', 'pins': '1x'}])
  with pytest.raises(DataError) as e:
    load_records(None, config(bad, pinned_field='pins'), tok)
  one_line_error(e, bad, 1)
  none = write_jsonl(tmp_path / 'r.jsonl', [{'prompt': '1', 'completion': '23'}])
  with pytest.raises(DataError) as e:
    load_records(None, config(none, pinned_field='pins'), tok)
  assert "missing field 'pins' (pinned_field; set data.pinned_field=''" in one_line_error(e, none, 1)


# ------------------------------------------------------------------------------------------ streaming
def test_a_large_jsonl_is_streamed_not_held_in_memory(tmp_path, tok):
  """50k records with a long extra field (a 45 MB file): reading holds the token arrays and an index of byte offsets,
  never the records' texts (the peak of Python allocations stays far below the file's size), and a record's texts
  and fields read back from its line on demand."""
  import os
  import tracemalloc

  n, note = 50_000, 'x' * 880
  path = tmp_path / 'large.jsonl'
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines(f'{{"prompt": "p{i % 1000}", "completion": "ab", "note": "{note}", "id": {i}}}\n' for i in range(n))
  size = os.path.getsize(path)
  cfg = config(str(path), max_prompt_length=6, canvas_length=4, max_canvases=1)
  tracemalloc.start()
  try:
    r = load_records(None, cfg, tok)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  arrays = sum(a.nbytes for a in (r.prompt_ids, r.completion_ids, r.prompt_lengths, r.completion_lengths))
  assert len(r) == n and size > 40e6
  # the arrays and the index (twice while the chunks are joined) plus one chunk of texts, not every record
  assert peak < 2 * (arrays + 16 * n) + size / 8, (peak, arrays, size)
  assert not isinstance(r.prompts, list) and not isinstance(r.sources, list)
  last = r.text_record(n - 1)
  assert (last.prompt, last.completion, last.fields['id']) == (f'p{(n - 1) % 1000}', 'ab', n - 1)
  assert r.sources[n - 1] == (str(path), n) and r.prompts[5] == 'p5'
  shard = r.select(np.arange(1, n, 2))
  assert shard.prompts[:2] == ['p1', 'p3'] and shard.text_record(0).fields['id'] == 1
