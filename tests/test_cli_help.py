"""--help says what a newcomer needs: `python -m k3train --help` is k3train's page (conf/hydra/help/k3train.yaml:
what it is, the main overrides, the config groups, where the docs are), not Hydra's default; every other CLI shows
each option's default."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from k3train.config import register_configs

REPO = Path(__file__).resolve().parents[1]
MAIN_OVERRIDES = ("model=", "optim.lr=", "train.max_steps=", "resume=auto", "-m ", "hydra/launcher=slurm")


def test_the_composed_help_is_k3trains_and_names_its_overrides_and_docs():
    register_configs()
    with initialize_config_module(config_module="k3train.conf", version_base="1.3"):
        help_cfg = compose("config", return_hydra_config=True).hydra.help
    page = help_cfg.template.replace("${hydra.help.header}", help_cfg.header)
    page = page.replace("${hydra.help.footer}", help_cfg.footer)
    assert help_cfg.app_name == "k3train" and "powered by Hydra" not in page
    for override in MAIN_OVERRIDES:
        assert override in page, override
    assert "$APP_CONFIG_GROUPS" in page  # Hydra fills in the groups and their options
    for doc in ("README.md", "docs/", "configuration.md"):
        assert doc in page, doc
    # Every doc the page names exists (the page is the first thing a newcomer reads).
    for name in help_cfg.footer.replace(",", " ").split():
        if name.endswith(".md") and "/" not in name:
            assert (REPO / "docs" / name).is_file() or (REPO / name).is_file(), name


@pytest.mark.slow
def test_python_m_k3train_help_prints_k3trains_page_with_the_config_groups():
    proc = subprocess.run(
        [sys.executable, "-m", "k3train", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("k3train: train Kimi K3-style language models"), proc.stdout[:200]
    for text in (*MAIN_OVERRIDES, "model: ", "k3_tiny", "docs/", "--hydra-help"):
        assert text in proc.stdout, text


@pytest.mark.slow
def test_help_into_a_pipe_that_closes_early_ends_quietly():
    """`python -m k3train --help | head -3`: once head has left, the page meets a closed pipe, which is no error of
    the user's (no traceback, status 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3train", "--help"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # the reader leaves before the page is written (a pipe's buffer would hold all of it)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(build, monkeypatch) -> argparse.ArgumentParser:
    """The parser a CLI builds, caught at parse_args (nothing runs)."""

    def catch(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    try:
        build()
    except _Parsed as parsed:
        return parsed.parser
    raise AssertionError(f"{build} built no parser")


def _cli_parsers():
    from k3train import consolidate, evaluate, export, generate, import_hf, ladder, mup_check
    from k3train.data import prepare
    from k3train.plan import __main__ as plan
    from k3train.report import cli as report

    return {
        "generate": lambda: generate.parse_args([]),
        "evaluate": lambda: evaluate.parse_args([]),
        "export": lambda: export.parse_args([]),
        "consolidate": lambda: consolidate.main([]),
        "import_hf": lambda: import_hf.main([]),
        "prepare": lambda: prepare._parser().parse_args([]),
        "report": lambda: report.main([]),
        "plan": lambda: plan.parse([]),
        "ladder": lambda: ladder.main([]),
        "mup_check": lambda: mup_check.main([]),
    }


@pytest.mark.parametrize("cli", sorted(_cli_parsers()))
def test_every_option_with_a_default_shows_it_in_help(cli, monkeypatch):
    parser = _parser_of(_cli_parsers()[cli], monkeypatch)
    formatter = parser._get_formatter()
    for action in parser._actions:
        default = action.default
        if action.help == argparse.SUPPRESS or default in (None, argparse.SUPPRESS, []) or default is False:
            continue  # unset, a flag, or --help itself: nothing to show
        shown = formatter._expand_help(action) if action.help else ""  # the help text as --help prints it
        assert str(default) in shown, f"{cli} {'/'.join(action.option_strings) or action.dest}: {shown!r}"
