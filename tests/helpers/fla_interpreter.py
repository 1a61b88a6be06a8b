"""FLA's own Triton kernels on CPU tensors, through Triton's interpreter, for tests/fla (k3train's FLA paths against
its pure-PyTorch ones). Each test module there imports this first: with TRITON_INTERPRET=1 set and FLA importable it
patches the interpreter (install(), below) before anything imports fla; otherwise NEEDS_INTERPRETER skips the
module's tests, saying how to run them:

    pip install --target .fla-interpreter --no-deps triton==3.9.0 flash-linear-attention==0.6.0 fla-core==0.6.0 einops
    TRITON_INTERPRET=1 PYTHONPATH=.fla-interpreter python -m pytest -q tests/fla

(.ci/run does this after the main suite.) Pinned to those versions: the patches reach into Triton's interpreter.

1. The autotuner benchmarks every config through the active driver, and a CPU-only machine has none ("0 active
   drivers"): keep only the first config, so nothing is benchmarked.
2. Compiled Triton hands a `for i in range(n)` loop a tensor (FLA's kernels call `i_t.to(tl.int64)`); the
   interpreter hands it a Python int: wrap it at the top of each loop body (not tl.static_range's, a constexpr in
   compiled Triton too).
3. FLA binds `gather = tl.gather` at import; the interpreter patches attributes of tl, never such an alias, so a
   kernel calling it raises: rebind each alias to a jit function that looks tl.gather up when called.
4. The interpreter allows only tf32 / tf32x3 / ieee as tl.dot's input_precision; FLA's safe-gate kernels ask for
   bf16x3. Its dot is a numpy fp32 matmul whatever the name, so the name is allowed.

What this does not reproduce: a GPU's rounding (tf32, bf16x3: the interpreter's dot is exact fp32), nor the
GPU's tiling (FLA picks smaller tiles without shared-memory figures, and only the first autotune config runs).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import sys

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("fla") is not None
NEEDS_INTERPRETER = pytest.mark.skipif(
    not INTERPRETING,
    reason="runs FLA's Triton kernels in Triton's interpreter: needs TRITON_INTERPRET=1 and flash-linear-attention "
    "on PYTHONPATH (tests/helpers/fla_interpreter.py says how)",
)


def install() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the FLA interpreter checks need TRITON_INTERPRET=1 set before Python starts")
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda self, kwargs, *a, **kw: prune(self, kwargs, *a, **kw)[:1]  # 1.

    def visit_for(self, node):  # 2.
        node = self.generic_visit(node)
        if isinstance(node.target, ast.Name) and not _is_static_range(node.iter):
            as_tensor = ast.parse(f"{node.target.id} = interpreter_semantic.to_tensor({node.target.id}, False)")
            node.body.insert(0, ast.copy_location(as_tensor.body[0], node))
        return node

    interpreter.ASTTransformer.visit_For = visit_for

    import triton
    import triton.language as tl

    globals()["tl"] = tl  # 3. the interpreter looks tl up in the kernel function's globals: this module's
    gather = triton.jit(_gather)

    import fla  # noqa: F401  (imports fla.ops.*, which binds the aliases)

    for name, module in list(sys.modules.items()):
        if name.startswith("fla") and getattr(module, "gather", None) is tl.gather:
            module.gather = gather

    options = interpreter.interpreter_builder.options  # 4.
    interpreter.interpreter_builder.options = dataclasses.replace(
        options, allowed_dot_input_precisions=(*options.allowed_dot_input_precisions, "bf16x3", "bf16x6")
    )


def _gather(src, index, axis: tl.constexpr):  # noqa: F821 (tl: set by install(), with triton imported)
    """FLA's module-level `gather = tl.gather` alias as a kernel function, which the interpreter can run."""
    return tl.gather(src, index, axis)  # noqa: F821


def _is_static_range(call: ast.expr) -> bool:
    func = call.func if isinstance(call, ast.Call) else None
    return (isinstance(func, ast.Attribute) and func.attr == "static_range") or (
        isinstance(func, ast.Name) and func.id == "static_range"
    )


if INTERPRETING:  # on import, before a test reaches fla (k3train imports it only when a call needs it)
    install()
