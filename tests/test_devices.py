"""runtime/devices.py: the one parser for train.device and the CLIs' --device, which names the setting it refuses."""

import pytest
import torch

from k3train.runtime.devices import parse_device


def test_auto_and_cpu() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "name, option, message",
    [
        ("gpu0", "train.device", "train.device=gpu0 is not a device: use auto, cpu, cuda or cuda:N"),
        ("meta", "--device", "--device=meta: k3train runs on cpu or cuda"),
    ],
)
def test_a_device_that_is_not_one_is_refused_naming_the_setting(name: str, option: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        parse_device(name, option)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_before_any_work() -> None:
    with pytest.raises(ValueError, match=r"^--device=cuda:1 but CUDA is not available here: use --device=cpu or auto"):
        parse_device("cuda:1", "--device")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a GPU index past the last one")
def test_a_gpu_index_past_the_last_is_refused() -> None:
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"has {count} GPU"):
        parse_device(f"cuda:{count}", "--device")
