"""The bytes this rank sends by all-to-all (forward and backward), counted where torch dispatches them: what the
planner's expert-parallel exchanges are checked against (test_plan.py, test_plan_pp.py)."""

from torch.utils._python_dispatch import TorchDispatchMode


class AllToAllBytes(TorchDispatchMode):
    """Each all-to-all's input bytes (what this rank sends), the backward's too."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_to_all" in func.name() or "alltoall" in func.name():
            tensors = args[1] if "alltoall" in func.name() else args[0]  # c10d: (outputs, inputs, ...)
            self.bytes += tensors.nbytes
        return func(*args, **(kwargs or {}))
