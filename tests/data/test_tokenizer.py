"""Tests for hackable_diffusion.data.tokenizer."""

import numpy as np
import pytest

from hackable_diffusion.data.tokenizer import Tokenizer
from hackable_diffusion.data.tokenizer import train_tokenizer

SUDOKU_PUZZLE = '530070000600195000098000060800060003400803001700020006060000280000419005000080079'


@pytest.fixture(scope='module')
def digit_tok():
  return train_tokenizer([SUDOKU_PUZZLE, '0123456789', '12 34|.'])


def test_special_ids_match_diffusiongemma_defaults(digit_tok):
  assert (digit_tok.pad_id, digit_tok.eos_id, digit_tok.bos_id, digit_tok.unk_id) == (0, 1, 2, 3)
  # 4 specials + 10 digits + ' ', '|', '.'
  assert digit_tok.vocab_size == 17


def test_char_model_one_id_per_digit_no_dummy_prefix(digit_tok):
  ids = digit_tok.encode(SUDOKU_PUZZLE)
  assert len(ids) == 81
  pieces = [digit_tok.id_to_piece(i) for i in ids]
  assert pieces == list(SUDOKU_PUZZLE)
  assert '\u2581' not in pieces
  digit_ids = digit_tok.token_ids_for('0123456789')
  assert ids == [digit_ids[int(c)] for c in SUDOKU_PUZZLE]
  assert digit_tok.decode(ids) == SUDOKU_PUZZLE


def test_spaces_roundtrip_exactly(digit_tok):
  text = '1 2  3 '
  ids = digit_tok.encode(text)
  assert len(ids) == len(text)
  assert digit_tok.decode(ids) == text
  assert digit_tok.token_ids_for(' ') == [digit_tok.piece_to_id('\u2581')]


def test_decode_drops_pad_and_stops_at_eos(digit_tok):
  ids = digit_tok.encode('123')
  pad, eos = digit_tok.pad_id, digit_tok.eos_id
  seq = [pad, pad] + ids + [eos] + digit_tok.encode('45') + [pad]
  assert digit_tok.decode(seq) == '123'
  assert digit_tok.decode(np.asarray(seq)) == '123'
  assert digit_tok.decode(seq, stop_at_eos=False) == '12345'


def test_decode_out_of_range_ids_as_unk(digit_tok):
  ids = digit_tok.encode('12') + [digit_tok.vocab_size + 5]
  text = digit_tok.decode(ids)
  assert text.startswith('12') and len(text) > 2


def test_token_ids_for_unknown_char_raises_naming_it(digit_tok):
  with pytest.raises(ValueError, match="'x'"):
    digit_tok.token_ids_for('12x')


def test_save_load_roundtrip(tmp_path, digit_tok):
  path = digit_tok.save(tmp_path / 'tok')
  assert path.endswith('tokenizer.model')
  for where in (tmp_path / 'tok', path):
    loaded = Tokenizer.load(where)
    assert loaded.vocab_size == digit_tok.vocab_size
    assert loaded.encode(SUDOKU_PUZZLE) == digit_tok.encode(SUDOKU_PUZZLE)


def test_train_writes_out_path(tmp_path):
  tok = train_tokenizer(['abc'], tmp_path / 'd')
  assert Tokenizer.load(tmp_path / 'd').encode('cab') == tok.encode('cab')
  tok2 = train_tokenizer(['abc'], tmp_path / 'x.model')
  assert Tokenizer.load(tmp_path / 'x.model').encode('cab') == tok2.encode('cab')


def test_user_defined_symbols_and_custom_special_ids():
  tok = train_tokenizer(['ab', 'ba'], user_defined_symbols=['<sep>'], pad_id=0, eos_id=1,
                        bos_id=-1, unk_id=2)
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, -1, 2)
  ids = tok.encode('a<sep>b')
  assert len(ids) == 3 and tok.id_to_piece(ids[1]) == '<sep>'


def test_bpe_needs_vocab_size_and_trains():
  with pytest.raises(ValueError, match='vocab_size'):
    train_tokenizer(['hello world'], model_type='bpe')
  tok = train_tokenizer(['hello world hello there'] * 20, model_type='bpe', vocab_size=24)
  assert tok.vocab_size == 24
  assert tok.decode(tok.encode('hello world')) == 'hello world'


def test_bad_inputs():
  with pytest.raises(ValueError, match='distinct'):
    train_tokenizer(['ab'], pad_id=1, eos_id=1)
  with pytest.raises(ValueError, match='non-empty'):
    train_tokenizer(['', ''])
  with pytest.raises(FileNotFoundError):
    Tokenizer.load('/nonexistent/tokenizer.model')


def test_load_invalid_model_file(tmp_path):
  bad = tmp_path / 'tokenizer.model'
  bad.write_bytes(b'not a model')
  with pytest.raises(ValueError, match='tokenizer.model'):
    Tokenizer.load(bad)


def test_a_trained_tokenizer_is_never_written_through_a_symbolic_link(tmp_path):
  from hackable_diffusion.errors import UnsafePathError

  victim = tmp_path / 'victim'
  victim.write_text('keep')
  (tmp_path / 'tok.model').symlink_to(victim)
  with pytest.raises(UnsafePathError):
    train_tokenizer(['abc'], tmp_path / 'tok.model')
  assert victim.read_text() == 'keep'
