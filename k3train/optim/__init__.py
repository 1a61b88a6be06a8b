"""Optimizers: Muon + AdamW in one optimizer (muon.py), the parameter partition (param_groups.py), Hydra targets
(build.py); the LR schedule (schedule.py) and QK-Clip (qk_clip.py)."""

from k3train.optim.muon import MuonAdamW, zeropower_via_newtonschulz5
from k3train.optim.param_groups import ParamAssignment, check_partition, partition_parameters

__all__ = ["MuonAdamW", "ParamAssignment", "check_partition", "partition_parameters", "zeropower_via_newtonschulz5"]
