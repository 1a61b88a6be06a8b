"""A byte-level BPE tokenizer trained on a corpus with the `tokenizers` library (`python -m k3train.tokenizer
train`): GPT-2's byte-level scheme (every UTF-8 byte a token of its own, so any text encodes and decodes back
exactly), merges learned from the corpus up to the vocabulary size asked for, and the end-of-document token as its
one special token, the last id, which prepare then appends after every document (`--eod-token`).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BYTES = 256
EOD_TOKEN = "<|endoftext|>"


def smallest_vocabulary(special_tokens: int = 1) -> int:
    """Every byte a token, and the special tokens: no merge fits in less."""
    return BYTES + special_tokens


def train_byte_bpe(texts: Iterable[str], vocab_size: int, eod_token: str = EOD_TOKEN) -> Tokenizer:
    """A tokenizer of `vocab_size` ids at most (fewer when the corpus runs out of pairs to merge): the 256 bytes,
    the merges, `eod_token`."""
    if vocab_size < smallest_vocabulary():
        raise ValueError(
            f"a vocabulary of {vocab_size} cannot hold byte-level BPE's {BYTES} byte tokens and the end-of-document "
            f"token: ask for at least {smallest_vocabulary()}"
        )
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: a document's first word is encoded as it stands, so decoding gives back the exact text
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the special token is added after the merges: ids 0 .. vocab_size - 2, then it
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens([eod_token])
    return tokenizer
