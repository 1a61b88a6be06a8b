"""Hugging Face formats, both ways: transformers' `kimi_linear` and the released Kimi K3 layout.

shards.py   sharded safetensors: write with an index (model.safetensors.index.json), read shard by shard
mxfp4.py    compressed-tensors' mxfp4-pack-quantized experts: decode on read (and encode, for tests)
"""

from __future__ import annotations


class HFFormatError(ValueError):
    """A Hugging Face directory that cannot be read as it claims to be (a missing shard, a key its index names
    but no shard holds, an unsupported quantization, a config k3train cannot express)."""
