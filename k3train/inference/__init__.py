"""After training: load a run's checkpoint or an exported model, sample from it, evaluate it, export it.

The commands are k3train/generate.py, k3train/evaluate.py and k3train/export.py; this package holds what they
share: loading.py (a run directory, checkpoint or export -> model, tokenizer, data config) and sampling.py.
"""
