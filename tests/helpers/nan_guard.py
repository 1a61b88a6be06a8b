"""The NaN guard: uninitialised memory reads as NaN during the tests (installed by tests/conftest.py at import, and by
the gloo ranks tests/helpers/spawn.py starts, which do not import conftest).

As flash-linear-attention's tests/conftest.py does for its ops: during the tests torch.empty, torch.empty_like and
Tensor.new_empty return tensors filled with NaN (floating and complex dtypes) or with their dtype's largest value
(integer dtypes: an index out of range, a count no layer produces), so a kernel, a layer or a collective that
reads memory it never wrote fails a test instead of passing on whatever the allocator left there (often zeros).
Unlike FLA's, it is on for every caller, k3train's code, the tests' and torch's own Python code, and for the
whole session: it is patched at conftest's import, before any test module is collected, so `from torch import empty`
sees it too, and so do the gloo ranks that conftest's run_on_gloo_ranks spawns (they import conftest) and
helpers/spawn.py's (they install it first). The `python -m k3train` subprocesses do not. K3TRAIN_NAN_EMPTY=0 turns
it off (docs/testing.md).
Only the Python attributes are replaced: torch's C++ code allocates through at::empty and its Python bindings
through torch._C._VariableFunctions, neither of which looks these names up, so the outputs and scratch buffers
of torch's own ops are untouched. Left alone: a tensor that holds no memory (meta device, no elements), a
non-strided layout, bool and quantized dtypes. Under torch.compile dynamo keeps the call in its graph, unbroken
(tests/test_loss.py's compile test), and the graph's tensors come filled too; were dynamo to trace into the
wrapper instead, it would step aside and leave dynamo the plain op.
"""

import functools
import os

import torch
import torch.utils._device

NAN_EMPTY = os.environ.get("K3TRAIN_NAN_EMPTY", "1") != "0"


def _garbage(dtype: torch.dtype):
    """What the guard fills a new tensor of dtype with, or None to leave it as allocated."""
    if dtype.is_complex:
        return complex(float("nan"), float("nan"))
    if dtype.is_floating_point:
        return float("nan")
    if dtype in _INTEGERS:
        return torch.iinfo(dtype).max
    return None


_INTEGERS = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64}


def _poisoned(tensor):
    if tensor.layout is not torch.strided or tensor.device.type == "meta" or tensor.numel() == 0:
        return tensor
    value = _garbage(tensor.dtype)
    if value is not None:
        with torch.no_grad():  # a leaf that requires grad (torch.empty(..., requires_grad=True)) takes it too
            tensor.fill_(value)
    return tensor


def _guarded(original):
    @functools.wraps(original)
    def allocate(*args, **kwargs):
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        return _poisoned(original(*args, **kwargs))

    allocate.unguarded = original
    return allocate


def install() -> None:
    """Patch torch.empty, torch.empty_like and Tensor.new_empty (once; nothing with K3TRAIN_NAN_EMPTY=0)."""
    if not NAN_EMPTY or hasattr(torch.empty, "unguarded"):
        return
    # torch keeps sets of its factory functions, built on first use, that it matches the function a mode is handed
    # against, which is always the original builtin: `with torch.device("meta")` injects its device only into the
    # calls it finds in _device_constructors(). Built after the patch, that set would hold the wrappers, and a model
    # built under torch.device("meta") (k3train.plan's) would allocate on the CPU: build it now, from the originals.
    torch.utils._device._device_constructors()
    torch.empty = _guarded(torch.empty)
    torch.empty_like = _guarded(torch.empty_like)
    torch.Tensor.new_empty = _guarded(torch.Tensor.new_empty)
    probe = torch.empty(2, 2)
    assert probe.isnan().all() and torch.empty_like(probe).isnan().all() and probe.new_empty(1).isnan().all()
