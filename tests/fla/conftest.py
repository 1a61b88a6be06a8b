"""FLA's own Triton kernels on a CPU, through Triton's interpreter: k3train's FLA paths (models/kda/fla.py, the KDA
layer's fused ops, the loss) against its pure-PyTorch ones. Runs only when asked for:

    pip install --target .fla-interpreter --no-deps triton==3.9.0 flash-linear-attention==0.6.0 fla-core==0.6.0 einops
    TRITON_INTERPRET=1 PYTHONPATH=.fla-interpreter python -m pytest -q tests/fla

(.ci/run does this after the main suite.) Elsewhere every test here skips, saying so.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("fla") is not None
if INTERPRETING:
    from interpreter_shim import install

    install()


def pytest_collection_modifyitems(config, items):
    if INTERPRETING:
        return
    skip = pytest.mark.skip(
        reason="runs FLA's Triton kernels in Triton's interpreter: needs TRITON_INTERPRET=1 and flash-linear-attention "
        "on PYTHONPATH (tests/fla/conftest.py says how)"
    )
    for item in items:
        if "tests/fla/" in str(item.fspath):
            item.add_marker(skip)
