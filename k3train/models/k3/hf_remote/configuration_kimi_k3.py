"""Kimi K3's config.json for transformers' `trust_remote_code=True`: written by k3train's HF export beside the weights
of a kimi_k3-layout model (k3train/hf/write.py copies this file; config.json's auto_map names it).

transformers has no kimi_k3 model type. This file and modeling_kimi_k3.py give it one, for the layout k3train writes
(k3train/models/k3/hf_config.py): the released Kimi K3's form, the text model's fields under `text_config`. It imports
only transformers, so an export loads where k3train is not installed.
"""

from transformers import PretrainedConfig


class KimiK3TextConfig(PretrainedConfig):
    """The text model's fields, as k3train's hf_config.to_hf_config writes them (its `text` dict); read by name in
    modeling_kimi_k3.py. Every field is kept as written: the export always writes the ones the model reads."""

    model_type = "kimi_k3_text"

    def __init__(self, linear_attn_config=None, **kwargs):
        self.linear_attn_config = dict(linear_attn_config or {})
        super().__init__(**kwargs)


class KimiK3Config(PretrainedConfig):
    """config.json's top level: `text_config` (a KimiK3TextConfig) and the token ids."""

    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiK3TextConfig}

    def __init__(self, text_config=None, **kwargs):
        if isinstance(text_config, KimiK3TextConfig):
            self.text_config = text_config
        else:
            self.text_config = KimiK3TextConfig(**(text_config or {}))
        super().__init__(**kwargs)
