"""Each class of bad input is refused with its exit status and key words, and changes no file (fault_inputs.py)."""

import fault_inputs as fi
import pytest
import torch

pytestmark = [pytest.mark.fault, pytest.mark.slow]


@pytest.fixture(scope="session")
def inputs_work(tmp_path_factory):
    return tmp_path_factory.mktemp("bad-input")


@pytest.mark.parametrize("case", fi.BAD_INPUTS, ids=lambda c: c.name.replace(" ", "_"))
def test_bad_input_is_refused_and_touches_nothing(case, inputs_work, k3_cache):
    if case.name == "train.device=cuda on CPU" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: train.device=cuda is not a bad input here")
    if case.missing():
        pytest.skip(case.missing())
    problems, damaged = fi.run_bad_input(case, inputs_work, k3_cache)
    assert not problems and damaged == 0, "\n".join([case.name, *problems])
