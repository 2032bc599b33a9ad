"""Data: the tokenizer (SentencePiece or `tokenizer.json`), chat templates and the JSONL -> grain -> padded-batch SFT
pipeline."""

from hackable_diffusion.data.sft import DataError
from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.data.sft import SFTDataConfig
from hackable_diffusion.data.sft import SFTDataset
from hackable_diffusion.data.sft import SFTRecords
from hackable_diffusion.data.sft import load_records
from hackable_diffusion.data.sft import make_sft_dataset
from hackable_diffusion.data.sft import num_valid_canvases
from hackable_diffusion.data.tokenizer import Tokenizer
from hackable_diffusion.data.tokenizer import train_tokenizer

__all__ = [
    'DataError', 'SFTBatch', 'SFTDataConfig', 'SFTDataset', 'SFTRecords', 'Tokenizer',
    'load_records', 'make_sft_dataset', 'num_valid_canvases', 'train_tokenizer',
]
