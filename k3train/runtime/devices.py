"""The one parser for `device=`: train.device, and --device of generate and evaluate.

"auto" is the first GPU when CUDA is available, else the CPU; "cpu", "cuda" and "cuda:N" are checked against this
machine before any work starts, so a wrong device is a one-line error rather than a CUDA failure mid-run. `option`
names the setting in that error (train.device, --device) so the user knows what to change.
"""

from __future__ import annotations

import torch

from k3train.runtime.distributed import World


def parse_device(name: str, option: str = "train.device") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"{option}={name} is not a device: use auto, cpu, cuda or cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{option}={name}: k3train runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{option}={name} but CUDA is not available here: use {option}=cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{option}={name} but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def device_for_rank(name: str, world: World) -> torch.device:
    """train.device for this process; with several processes per node, CUDA means this process's local GPU."""
    device = parse_device(name)
    if device.type == "cuda" and world.distributed:
        if device.index is None:
            device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    return device
