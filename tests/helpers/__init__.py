"""Helpers the test files share, each module named by what it holds. No test file imports another test_*.py: what
two of them need lives here. Imported as `from helpers.NAME import ...` (conftest.py puts tests/ on sys.path).

config           composed(), model_config(): the config `python -m k3train OVERRIDES` would run
data             tiny corpora, byte streams, prepared datasets, a tiny BPE
trainer          make_trainer() and the smoke-model wrappers for in-process Trainer runs
distributed_runs `python -m k3train` in subprocesses (torchrun or one process), their losses, a killed-rank resume
kda_problems     KDA inputs, a forward+backward run and its comparison
loss_problems    linear cross-entropy problems and their F.cross_entropy reference
tiny_k3          a tiny KimiK3 with every kind of part, and a batch for it
decoding         conf/model/*.yaml models for decoding and their token-by-token logits
"""
