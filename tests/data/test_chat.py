"""tokenizer.json tokenizers, the checkpoint's chat template (vs transformers' apply_chat_template), chat SFT data."""

import json
from collections.abc import Sequence

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from hackable_diffusion.data.chat import ChatTemplate, split_chat
from hackable_diffusion.data.sft import SFTDataConfig, load_records, make_sft_dataset
from hackable_diffusion.data.tokenizer import Tokenizer, train_tokenizer
from hackable_diffusion.errors import CheckpointError, DataError

# Gemma 4's control tokens (pad 0, eos 1, bos 2, unk 3; turns are <|turn>ROLE\n ... <turn|>\n).
SPECIALS = ['<pad>', '<eos>', '<bos>', '<unk>', '<mask>', '<|turn>', '<turn|>', '<|think|>', '<|channel>',
            '<channel|>', '<|tool>', '<tool|>', '<|tool_call>', '<tool_call|>', '<|tool_response>',
            '<tool_response|>', '<|"|>', '<|image|>', '<|image>', '<image|>']
TURN_END = SPECIALS.index('<turn|>')

# A Gemma-4-style template written for these tests: bos, an optional system turn, user/model turns, assistant
# content stripped of thinking, a generation prompt; other roles raise. THINKING_OFF adds Gemma 4's empty thought
# channel to the generation prompt only (so the prompt is not a prefix of the whole conversation).
TEMPLATE = r"""{{- bos_token -}}
{%- set loop_messages = messages -%}
{%- if messages[0]['role'] in ['system', 'developer'] -%}
  {{- '<|turn>system\n' -}}
  {%- if enable_thinking is defined and enable_thinking -%}{{- '<|think|>\n' -}}{%- endif -%}
  {{- messages[0]['content'] | trim -}}
  {{- '<turn|>\n' -}}
  {%- set loop_messages = messages[1:] -%}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if message['role'] not in ['user', 'assistant'] -%}
    {{- raise_exception('Gemma test template: unsupported role ' + message['role']) -}}
  {%- endif -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{- '<|turn>' + role + '\n' -}}
  {%- if message['content'] is string -%}
    {{- message['content'] | trim -}}
  {%- else -%}
    {%- for item in message['content'] -%}
      {%- if item['type'] == 'text' -%}{{- item['text'] | trim -}}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{- '<turn|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {%- if show_image_tokens is defined -%}{{- boi_token + image_token + eoi_token -}}{%- endif -%}
  {{- '<|turn>model\n' -}}
  {%- if thinking_off_channel is defined and thinking_off_channel -%}
    {{- '<|channel>thought\n<channel|>' -}}
  {%- endif -%}
{%- endif -%}
"""
THINKING_OFF = TEMPLATE.replace('thinking_off_channel is defined and thinking_off_channel', 'true')

CORPUS = [
    'You are a helpful assistant that answers briefly.',
    'What is the capital of France? Paris is the capital of France.',
    'Please add two and three. Two plus three is five.',
    'Tell me a story about a cat and a dog who became friends.',
    'The quick brown fox jumps over the lazy dog, then naps in the sun.',
    'user model system assistant turn answer question thanks hello',
] * 4

CONVERSATIONS = [  # held out: none of these texts is in CORPUS
    [{'role': 'user', 'content': 'Hello there!'}],
    [{'role': 'system', 'content': 'Answer in French, s\'il vous plaît.  '},
     {'role': 'user', 'content': 'Quelle est la capitale de l\'Allemagne ? Berlin, naïvement.'},
     {'role': 'assistant', 'content': 'C\'est Berlin — évidemment.'},
     {'role': 'user', 'content': 'Et du Japon? 東京 ですか? 🗼'}],
    [{'role': 'user', 'content': [{'type': 'text', 'text': 'Two parts: '}, {'type': 'text', 'text': 'ünïcödé'}]},
     {'role': 'assistant', 'content': 'ok', 'reasoning_content': None},
     {'role': 'user', 'content': 'Σ αβγ\nnew line\tand tab'}],
]


def bytelevel_bpe(specials: Sequence[str] = SPECIALS) -> tokenizers.Tokenizer:
  """A byte-level BPE tokenizer trained on CORPUS (offline), with `specials` as its first ids."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials),
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
  return tok


def _wordlevel() -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.WordLevel(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=SPECIALS, show_progress=False))
  return tok


TOKENIZER_CONFIG = {'bos_token': '<bos>', 'eos_token': '<eos>', 'pad_token': '<pad>', 'unk_token': '<unk>',
                    'mask_token': '<mask>', 'image_token': '<|image|>', 'boi_token': '<|image>',
                    'extra_special_tokens': {'eoi_token': '<image|>'}}
GENERATION_CONFIG = {'bos_token_id': 2, 'pad_token_id': 0, 'eos_token_id': [1, TURN_END]}


def write_checkpoint_dir(path, raw: tokenizers.Tokenizer, template: str = TEMPLATE, **config_overrides):
  """A checkpoint's tokenizer files as transformers 5 writes them (template in chat_template.jinja)."""
  path.mkdir(parents=True, exist_ok=True)
  (path / 'tokenizer.json').write_text(raw.to_str(), encoding='utf-8')
  config = {**TOKENIZER_CONFIG, 'tokenizer_class': 'PreTrainedTokenizerFast', **config_overrides}
  (path / 'tokenizer_config.json').write_text(json.dumps(config), encoding='utf-8')
  (path / 'generation_config.json').write_text(json.dumps(GENERATION_CONFIG), encoding='utf-8')
  (path / 'chat_template.jinja').write_text(template, encoding='utf-8')
  return path


@pytest.fixture(scope='module', params=['bpe', 'wordlevel'])
def checkpoint(request, tmp_path_factory):
  raw = bytelevel_bpe() if request.param == 'bpe' else _wordlevel()
  return write_checkpoint_dir(tmp_path_factory.mktemp(request.param), raw)


def hf_tokenizer(directory):
  from transformers import PreTrainedTokenizerFast
  return PreTrainedTokenizerFast.from_pretrained(str(directory))


def hf_ids(hf, messages, **kw):
  return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


# ------------------------------------------------------------------------------------------ tokenizer.json
def test_tokenizer_json_loads_with_gemma4_specials(checkpoint):
  tok = Tokenizer.load(checkpoint)
  assert tok.kind == 'tokenizers'
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
  assert tok.eos_ids == (1, TURN_END)
  hf = hf_tokenizer(checkpoint)
  assert tok.vocab_size == len(hf)
  assert tok.special_tokens['bos_token'] == '<bos>' and tok.special_tokens['image_token'] == '<|image|>'
  assert tok.special_tokens['eoi_token'] == '<image|>' == hf.special_tokens_map['eoi_token']
  for text in ['Paris is the capital', 'naïve 東京 🗼\n\t x', '<|turn>user\nhi<turn|>']:
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
  # the file itself loads too (not refused as 'not a valid SentencePiece model')
  assert Tokenizer.load(checkpoint / 'tokenizer.json').encode('hello') == tok.encode('hello')


def test_decode_stops_at_end_of_turn_and_skips_specials(checkpoint):
  tok = Tokenizer.load(checkpoint)
  ids = tok.encode('Paris is the capital') + [TURN_END] + tok.encode('hello')
  assert tok.decode([0, 0] + ids) == tok.decode(tok.encode('Paris is the capital'))
  assert 'hello' in tok.decode(ids, stop_at_eos=False)
  assert '<turn|>' in tok.decode(ids, stop_at_eos=False, skip_special_tokens=False)


def test_save_load_roundtrip_and_transformers_reads_our_files(checkpoint, tmp_path):
  tok = Tokenizer.load(checkpoint)
  path = tok.save(tmp_path / 'saved')
  assert path.endswith('tokenizer.json')
  again = Tokenizer.load(tmp_path / 'saved')
  hf = hf_tokenizer(tmp_path / 'saved')
  for messages in CONVERSATIONS:
    assert again.apply_chat_template(messages, add_generation_prompt=True) == hf_ids(
        hf, messages, add_generation_prompt=True)
  assert (again.pad_id, again.eos_id, again.bos_id) == (0, 1, 2)


# ------------------------------------------------------------------------------------------ chat template
@pytest.mark.parametrize('add_generation_prompt', [True, False])
@pytest.mark.parametrize('conversation', range(len(CONVERSATIONS)))
def test_apply_chat_template_matches_transformers(checkpoint, conversation, add_generation_prompt):
  tok = Tokenizer.load(checkpoint)
  hf = hf_tokenizer(checkpoint)
  messages = CONVERSATIONS[conversation]
  ours_text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
  assert ours_text == hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
  ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  assert ours == hf_ids(hf, messages, add_generation_prompt=add_generation_prompt)
  assert ours[0] == tok.bos_id
  # template kwargs reach the template (Gemma 4's thinking switch)
  kw = dict(add_generation_prompt=add_generation_prompt, enable_thinking=True, show_image_tokens=True)
  assert tok.apply_chat_template(messages, **kw) == hf_ids(hf, messages, **kw)


def test_tokenizer_object_in_memory_matches_transformers():
  from transformers import PreTrainedTokenizerFast
  raw = bytelevel_bpe()
  hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token='<bos>', eos_token='<eos>', pad_token='<pad>',
                               unk_token='<unk>')
  hf.chat_template = TEMPLATE
  tok = Tokenizer.from_tokenizers(raw, tokenizer_config=TOKENIZER_CONFIG, chat_template=TEMPLATE)
  messages = CONVERSATIONS[1]
  assert tok.apply_chat_template(messages, add_generation_prompt=True) == hf_ids(
      hf, messages, add_generation_prompt=True)


@pytest.mark.parametrize('template', [TEMPLATE, THINKING_OFF], ids=['prefix', 'thinking_off'])
def test_split_chat_prompt_is_the_generation_prompt(checkpoint, tmp_path, template):
  raw = tokenizers.Tokenizer.from_file(str(checkpoint / 'tokenizer.json'))
  directory = write_checkpoint_dir(tmp_path / 'ckpt', raw, template)
  tok, hf = Tokenizer.load(directory), hf_tokenizer(directory)
  messages = CONVERSATIONS[1] + [{'role': 'assistant', 'content': '  東京です。 '}]
  split = split_chat(tok.chat_template, messages, 'x.jsonl:1')
  # the encoder prompt is exactly what transformers gives a model at inference
  assert tok.encode_batch([split.prompt], parse_special_tokens=True)[0] == hf_ids(
      hf, messages[:-1], add_generation_prompt=True)
  assert split.completion == '東京です。<turn|>\n'  # the template trims content; its end-of-turn markup follows
  assert split.last_user.startswith('Et du Japon') and split.last_assistant == '  東京です。 '
  if template == TEMPLATE:  # prompt + completion is the whole conversation, as TRL splits it
    assert split.prompt + split.completion == hf.apply_chat_template(messages, tokenize=False)


# ------------------------------------------------------------------------------------------ SentencePiece
def test_sentencepiece_with_chat_template_parses_control_tokens(tmp_path):
  sp = train_tokenizer(['hello world', 'abc<|turn><turn|>'], user_defined_symbols=['<|turn>', '<turn|>'])
  sp.save(tmp_path)
  template = "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}<turn|>\n{% endfor %}"
  (tmp_path / 'chat_template.jinja').write_text(template)
  tok = Tokenizer.load(tmp_path)
  assert tok.kind == 'sentencepiece' and tok.chat_template is not None
  ids = tok.apply_chat_template([{'role': 'user', 'content': 'hello'}])
  assert ids[0] == tok.bos_id and ids[1] == tok.piece_to_id('<|turn>')
  assert tok.encode('hello') == sp.encode('hello')


# ------------------------------------------------------------------------------------------ checks
def test_generation_config_must_agree_with_tokenizer(tmp_path):
  raw = _wordlevel()
  directory = write_checkpoint_dir(tmp_path / 'a', raw)
  (directory / 'generation_config.json').write_text(json.dumps({'eos_token_id': [TURN_END], 'bos_token_id': 2}))
  with pytest.raises(CheckpointError) as e:
    Tokenizer.load(directory)
  msg = str(e.value)
  assert '\n' not in msg and 'generation_config.json' in msg and 'eos_token_id' in msg and '(id 1)' in msg
  (directory / 'generation_config.json').write_text(json.dumps({'bos_token_id': 5}))
  with pytest.raises(CheckpointError, match='bos_token_id 5'):
    Tokenizer.load(directory)


def test_check_model_ids(checkpoint):
  tok = Tokenizer.load(checkpoint)
  tok.check_model_ids(pad_token_id=0, eos_token_id=(1, TURN_END), bos_token_id=2)
  tok.check_model_ids(pad_token_id=None, eos_token_id=1, bos_token_id=None)
  with pytest.raises(CheckpointError) as e:
    tok.check_model_ids(pad_token_id=0, eos_token_id=[TURN_END], bos_token_id=2, where='ckpt/config.json')
  assert str(e.value).startswith('ckpt/config.json: eos_token_id') and "'<eos>' (id 1)" in str(e.value)
  with pytest.raises(CheckpointError, match="bos_token_id 5 does not match the tokenizer's bos token '<bos>'"):
    tok.check_model_ids(pad_token_id=0, eos_token_id=1, bos_token_id=5)


def test_named_token_missing_from_vocabulary(tmp_path):
  directory = write_checkpoint_dir(tmp_path / 'a', _wordlevel(), bos_token='<start_of_turn>')
  with pytest.raises(CheckpointError) as e:
    Tokenizer.load(directory)
  assert "bos_token '<start_of_turn>' is not in the vocabulary" in str(e.value)
  assert 'tokenizer_config.json' in str(e.value)


def test_invalid_tokenizer_json_names_file(tmp_path):
  (tmp_path / 'tokenizer.json').write_text('{"not": "a tokenizer"}')
  with pytest.raises(ValueError) as e:
    Tokenizer.load(tmp_path)
  assert 'tokenizer.json' in str(e.value) and 'SentencePiece' not in str(e.value)


# ------------------------------------------------------------------------------------------ chat SFT data
def write_jsonl(path, records):
  with open(path, 'w', encoding='utf-8') as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + '\n')
  return str(path)


def sft_config(path, **kw):
  base = dict(path=path, max_prompt_length=160, canvas_length=8, max_canvases=6, batch_size=2,
              prefetch_batches=0, shuffle=False)
  base.update(kw)
  return SFTDataConfig(**base)


CHAT_RECORDS = [
    {'messages': [{'role': 'system', 'content': 'Be brief.'},
                  {'role': 'user', 'content': 'PINEAPPLE question one'},
                  {'role': 'assistant', 'content': 'first answer'},
                  {'role': 'user', 'content': 'ZEBRA question two ünï'},
                  {'role': 'assistant', 'content': 'Paris is the capital'}]},
    {'messages': [{'role': 'user', 'content': 'KIWI greetings'},
                  {'role': 'assistant', 'content': 'hello there friends'}], 'id': 7},
]


def test_chat_batch_has_loss_only_on_the_final_assistant_turn(checkpoint, tmp_path):
  tok, hf = Tokenizer.load(checkpoint), hf_tokenizer(checkpoint)
  path = write_jsonl(tmp_path / 'chat.jsonl', CHAT_RECORDS)
  ds = make_sft_dataset(sft_config(path, add_bos=True, num_epochs=1), tok)
  batch = next(iter(ds.iterator()))
  for row, record in enumerate(CHAT_RECORDS):
    messages = record['messages']
    prompt = batch.prompt_ids[row][batch.prompt_mask[row]].tolist()
    assert prompt == hf_ids(hf, messages[:-1], add_generation_prompt=True)  # bos not doubled by add_bos
    in_loss = batch.completion_ids[row][batch.completion_mask[row]].tolist()
    assert in_loss[-1] == tok.eos_id
    assert in_loss[:-1] == tok.encode(messages[-1]['content'] + '<turn|>\n')
    text = tok.decode(in_loss, stop_at_eos=False, skip_special_tokens=False)
    if checkpoint.name.startswith('bpe'):  # byte-level BPE decodes exactly (WordLevel has unknown words)
      assert text == messages[-1]['content'] + '<turn|>\n<eos>'
    for m in messages[:-1]:  # no user/system/earlier-assistant token can be in the loss
      for word in m['content'].split():
        assert word not in text, (word, text)
    assert not batch.completion_ids[row][~batch.completion_mask[row]].any()  # the rest is pad (id 0)
  assert ds.records.prompts[0] == 'ZEBRA question two ünï' and ds.records.completions[0] == 'Paris is the capital'


def test_prompt_completion_records_with_the_tokenizer_template(checkpoint, tmp_path):
  tok, hf = Tokenizer.load(checkpoint), hf_tokenizer(checkpoint)
  path = write_jsonl(tmp_path / 'pc.jsonl', [{'prompt': 'hello there', 'completion': 'Paris'},
                                             CHAT_RECORDS[1]])
  r = load_records(None, sft_config(path, chat_template='tokenizer'), tok)
  prompt0 = r.prompt_ids[0][r.prompt_mask[0]].tolist()
  assert prompt0 == hf_ids(hf, [{'role': 'user', 'content': 'hello there'}], add_generation_prompt=True)
  assert r.completion_ids[0][r.completion_mask[0]].tolist() == tok.encode('Paris') + [tok.eos_id]
  # a jinja template in the data config replaces the tokenizer's
  custom = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}" \
           "[assistant]{% endif %}"
  r = load_records(None, sft_config(path, chat_template=custom), tok)
  assert r.prompt_ids[1][r.prompt_mask[1]].tolist() == tok.encode('[user]KIWI greetings[assistant]')
  assert r.completion_ids[1][r.completion_mask[1]].tolist() == tok.encode('hello there friends') + [tok.eos_id]


def test_messages_field_name_is_configurable(checkpoint, tmp_path):
  tok = Tokenizer.load(checkpoint)
  path = write_jsonl(tmp_path / 'c.jsonl', [{'conversation': CHAT_RECORDS[1]['messages']}])
  r = load_records(None, sft_config(path, messages_field='conversation'), tok)
  assert r.completions == ['hello there friends']


@pytest.mark.parametrize('messages,expected', [
    ([{'content': 'hi'}, {'role': 'assistant', 'content': 'x'}], "message 0 has no 'role'"),
    ([{'role': 'user'}, {'role': 'assistant', 'content': 'x'}], "message 0 has no 'content'"),
    ([{'role': 'wizard', 'content': 'hi'}, {'role': 'assistant', 'content': 'x'}], "unknown role 'wizard'"),
    ([{'role': 'user', 'content': 'hi'}], 'last message must be the assistant'),
    ([{'role': 'system', 'content': 'hi'}, {'role': 'assistant', 'content': 'x'}], 'no user message'),
    ([{'role': 'user', 'content': 5}, {'role': 'assistant', 'content': 'x'}], 'content must be a string'),
    ('hello', 'non-empty list'),
    ([], 'non-empty list'),
    (['hi', {'role': 'assistant', 'content': 'x'}], 'message 0 must be an object'),
    # a role the template does not support: the template raises
    ([{'role': 'user', 'content': 'q'}, {'role': 'tool', 'content': '42'}, {'role': 'assistant', 'content': 'x'}],
     'unsupported role tool'),
])
def test_bad_chat_records_are_one_line_errors_naming_file_and_line(checkpoint, tmp_path, messages, expected):
  tok = Tokenizer.load(checkpoint)
  path = write_jsonl(tmp_path / 'bad.jsonl', [CHAT_RECORDS[1], {'messages': messages}])
  with pytest.raises(DataError) as e:
    load_records(None, sft_config(path), tok)
  msg = str(e.value)
  assert '\n' not in msg and f'{path}:2:' in msg and expected in msg, msg
  assert 'on_malformed' in msg
  r = load_records(None, sft_config(path, on_malformed='skip'), tok)  # or skipped and counted
  assert len(r) == 1 and r.stats['skipped_malformed'] == 1


def test_template_errors_name_the_template_and_line(checkpoint, tmp_path):
  tok = Tokenizer.load(checkpoint)
  path = write_jsonl(tmp_path / 'c.jsonl', [CHAT_RECORDS[1]])
  broken = "{{ messages[0]['content'] | no_such_filter }}"
  with pytest.raises(ValueError) as e:
    sft_config(path, chat_template='{% for m in messages %}{{ m }')
  assert 'chat_template' in str(e.value) and '\n' not in str(e.value)
  with pytest.raises(ValueError, match='no_such_filter'):
    sft_config(path, chat_template=broken)
  raising = "{{ raise_exception('this template refuses everything') }}"
  with pytest.raises(DataError) as e:
    load_records(None, sft_config(path, chat_template=raising), tok)
  msg = str(e.value)
  assert '\n' not in msg and f'{path}:1:' in msg and 'refuses everything' in msg and 'chat_template' in msg


def test_chat_record_without_any_template_is_an_error(tmp_path):
  tok = Tokenizer.from_tokenizers(_wordlevel(), tokenizer_config=TOKENIZER_CONFIG)
  assert tok.chat_template is None
  path = write_jsonl(tmp_path / 'c.jsonl', [{'prompt': 'a', 'completion': 'b'}, CHAT_RECORDS[1]])
  with pytest.raises(DataError) as e:
    load_records(None, sft_config(path), tok)
  assert f'{path}:2:' in str(e.value) and 'needs a jinja chat template' in str(e.value)
  with pytest.raises(CheckpointError, match='no chat template'):
    tok.apply_chat_template(CHAT_RECORDS[1]['messages'])


def test_chat_template_kinds():
  from hackable_diffusion.data.sft import chat_template_kind
  assert chat_template_kind(None) is None
  assert chat_template_kind('tokenizer') == 'tokenizer'
  assert chat_template_kind('<|turn>user\n{prompt}<turn|>\n') == 'format'
  assert chat_template_kind('{{ bos_token }}{% for m in messages %}{% endfor %}') == 'jinja'
  assert chat_template_kind('{{prompt}}') == 'jinja'
  assert ChatTemplate(source='{{ x }}').render([{'role': 'user', 'content': 'a'}], x='y') == 'y'
  np.testing.assert_equal(chat_template_kind('no placeholder'), 'format')
