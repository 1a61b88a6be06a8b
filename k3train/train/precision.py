"""Mixed precision: autocast dtype per run, FSDP2's MixedPrecisionPolicy, and the fp16 GradScaler. Master weights
stay fp32."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from k3train.runtime.console import first_on_this_node
from k3train.runtime.cpu import cpu_description, matmul_slowdown

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
# Warn when a half-precision matmul is this many times slower than fp32 on the CPU (measured at start-up): on
# CPUs without native support it is 10-200x; with it, faster than fp32 (AMX) or close to it.
SLOW_CPU_RATIO = 1.5


@dataclass
class Precision:
    dtype: str = "fp32"  # fp32 | bf16 | fp16 | fp64 (weights and every sum in fp64: for equivalence checks)
    # fp16's dynamic loss scale: the first scale, and how many overflow-free updates before it doubles.
    init_scale: float = 65536.0
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"precision.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def param_dtype(self) -> torch.dtype:
        """The master weights' (and so the optimizer state's) dtype: fp64 under precision=fp64, else fp32."""
        return torch.float64 if self.dtype == "fp64" else torch.float32

    def check_device(self, device: torch.device) -> str | None:
        """Reject device/precision pairs that cannot work, before any work is done; returns a warning (also
        printed) for pairs that work but slowly: bf16/fp16 autocast on a CPU that multiplies them slower than fp32."""
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {device} is not supported: use cpu or cuda[:N]")
        if device.type == "cuda" and self.dtype == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"precision=bf16 needs a GPU with bf16 support; {torch.cuda.get_device_name(device)} has none: "
                "use precision=fp16 or precision=fp32"
            )
        if device.type != "cpu" or self.dtype in ("fp32", "fp64"):
            return None
        slowdown = matmul_slowdown(self.torch_dtype)
        if slowdown < SLOW_CPU_RATIO:
            return None
        warning = (
            f"k3train: warning: precision={self.dtype} on this CPU ({cpu_description()['cpu_model']}, "
            f"{torch.backends.cpu.get_cpu_capability()}): a {self.dtype} matmul measured {slowdown:.1f}x "
            f"slower than fp32, so autocast makes training slower, not faster; use precision=fp32"
        )
        if first_on_this_node(warning):
            print(warning, file=sys.stderr, flush=True)
        return warning

    def fsdp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's MixedPrecisionPolicy for this precision, or None (fp32 and fp64: the gathered weights are the
        master weights). bf16 and fp16: param_dtype the half dtype, so every all-gather moves half the bytes and the
        forward and backward compute with the gathered half-precision weights; reduce_dtype fp32, so the gradients
        are cast to fp32 before their reduce-scatter (and HSDP's all-reduce) and summed there, as the fp32 shards
        FSDP2 keeps for the optimizer (parameters and optimizer state stay fp32: the sharded parameters are not
        touched). torchtitan's and Megatron's (bf16 params gathered, fp32 grad reduction) recipe.

        Autocast stays on beside it (autocast()): the gathered weights are already bf16, so autocast's casts of
        them are no-ops and it holds no copy of them beside the fp32 masters (its weight cache keeps only casts of
        fp32 parameters, and FSDP2's unsharded parameters are bf16 already); what it still
        does is choose the dtype per op, as in one process: matmuls in bf16, softmax, norms and the loss in fp32 on
        the inputs it upcasts. cast_forward_inputs is off: a block's input (the residual stream, fp32 under
        autocast) is not cast to bf16 at each block, so the stream stays fp32 as in one process and the only new
        rounding is of the few weights autocast would have left fp32 (norm gains, the embedding table)."""
        if self.dtype not in ("bf16", "fp16"):
            return None
        return MixedPrecisionPolicy(param_dtype=self.torch_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)

    def autocast(self, device: torch.device):
        if self.dtype in ("fp32", "fp64"):
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.torch_dtype)

    def make_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        # Disabled scalers are pass-throughs, so the update loop has one code path for every precision.
        return torch.amp.GradScaler(
            device.type, init_scale=self.init_scale, growth_interval=self.growth_interval, enabled=self.dtype == "fp16"
        )
