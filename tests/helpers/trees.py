"""Two checkpoint trees compared: tensors bit for bit, everything else equal."""

import torch


def assert_same_tree(a, b, where=""):
    """Assert that `a` and `b` (nested dicts, lists, tensors and plain values) are the same, tensors bitwise; a
    difference names its path."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}/{i}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b or (a != a and b != b), where  # NaN == NaN here
