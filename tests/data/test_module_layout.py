"""The public names of hackable_diffusion.data.sft / .tokenizer stay importable from there after the split into
modules (they are re-exported from the modules that own them)."""

import importlib

import pytest

from hackable_diffusion.data import sft
from hackable_diffusion.data import tokenizer

_OWNERS = {
    sft: {
        'SFTDataConfig': 'sft_data_config', 'read_records': 'text_records', 'TextRecord': 'text_records',
        'load_records': 'sft_records', 'SFTRecords': 'sft_records', 'SFTBatch': 'sft_records',
        'num_valid_canvases': 'sft_records', 'format_prompt': 'chat', 'chat_template_kind': 'chat',
    },
    tokenizer: {
        'find_tokenizer_file': 'tokenizer_files', 'TOKENIZER_FILENAME': 'tokenizer_files',
        'TOKENIZER_JSON_FILENAME': 'tokenizer_files',
    },
}


@pytest.mark.parametrize('module', [sft, tokenizer], ids=lambda m: m.__name__)
def test_every_public_name_is_importable(module):
  for name in module.__all__:
    assert getattr(module, name) is not None, name


@pytest.mark.parametrize('module', [sft, tokenizer], ids=lambda m: m.__name__)
def test_re_exports_are_the_owning_modules_objects(module):
  for name, owner in _OWNERS[module].items():
    assert name in module.__all__
    assert getattr(module, name) is getattr(importlib.import_module(f'hackable_diffusion.data.{owner}'), name)
