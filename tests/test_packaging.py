"""A wheel ships every config group: pyproject.toml lists each conf/ folder as a package (k3train.conf.<group>)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

REPO = Path(__file__).resolve().parents[1]


def test_every_config_group_folder_is_a_listed_package():
    packages = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    groups = {f"k3train.conf.{d.name}" for d in (REPO / "conf").iterdir() if d.is_dir() and any(d.glob("*.yaml"))}
    assert groups and not groups - packages, f"add {sorted(groups - packages)} to [tool.setuptools] packages"
