"""The Hugging Face format, both ways, for any model family that has an adapter (Kimi K3's: transformers'
`kimi_linear` and the released Kimi K3 layout, k3train/models/k3/state_dict_adapter.py).

adapter.py  the seam: what read.py and write.py ask of a family (config.json, tensor names), and nothing else
read.py     a directory -> the model, every check before the first tensor is read
write.py    the model -> a directory: config.json, shards, the tokenizer's files
shards.py   sharded safetensors: write with an index (model.safetensors.index.json), read shard by shard
mxfp4.py    compressed-tensors' mxfp4-pack-quantized experts: decode on read (and encode, for tests)
"""

from __future__ import annotations


class HFFormatError(ValueError):
    """A Hugging Face directory that cannot be read as it claims to be (a missing shard, a key its index names
    but no shard holds, an unsupported quantization, a config k3train cannot express)."""
