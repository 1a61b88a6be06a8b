"""Mixed precision: autocast dtype per run, and the fp16 GradScaler. Master weights stay fp32."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Precision:
    dtype: str = "fp32"  # fp32 | bf16 | fp16
    # fp16's dynamic loss scale: the first scale, and how many overflow-free updates before it doubles.
    init_scale: float = 65536.0
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"precision.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def check_device(self, device: torch.device) -> None:
        """Reject device/precision pairs that cannot work, before any work is done."""
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {device} is not supported: use cpu or cuda[:N]")
        if device.type == "cuda" and self.dtype == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"precision=bf16 needs a GPU with bf16 support; {torch.cuda.get_device_name(device)} has none: "
                "use precision=fp16 or precision=fp32"
            )

    def autocast(self, device: torch.device):
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.torch_dtype)

    def make_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        # Disabled scalers are pass-throughs, so the update loop has one code path for every precision.
        return torch.amp.GradScaler(device.type, init_scale=self.init_scale, growth_interval=self.growth_interval,
                                    enabled=self.dtype == "fp16")
