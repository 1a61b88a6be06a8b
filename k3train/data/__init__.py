"""Token data: prepare text into memory-mapped shards, open them, and stream resumable next-token batches."""

from k3train.data.builtin import prepare_builtin
from k3train.data.dataset import ShardedTokenDataset, TokenData
from k3train.data.loader import Batch, EndOfData, TokenDataLoader
from k3train.data.mixture import MixtureData, MixtureLoader
from k3train.data.prepare import prepare_dataset
from k3train.data.sources import PrepareError
from k3train.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "Batch",
    "ByteTokenizer",
    "EndOfData",
    "HFTokenizer",
    "MixtureData",
    "MixtureLoader",
    "PrepareError",
    "ShardedTokenDataset",
    "TokenData",
    "TokenDataLoader",
    "Tokenizer",
    "load_tokenizer",
    "prepare_dataset",
    "prepare_builtin",
]
