"""k3train/runtime/console.py: a message every local rank of a launch would print is printed by the first alone."""

import subprocess
import sys

from k3train.runtime import console


def test_the_first_rank_on_a_node_says_a_message_and_the_others_do_not(monkeypatch, tmp_path):
    monkeypatch.setattr(console.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(console, "_shares_stderr_with", lambda pid: True)  # the ranks' shared terminal
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert console.first_on_this_node("error: x") and console.first_on_this_node("error: x")  # one rank: always
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert console.first_on_this_node("error: x")
    assert not console.first_on_this_node("error: x")  # the second rank of the same launch: said already
    assert console.first_on_this_node("error: y")  # a rank's own message gets through


def test_another_launch_says_it_again(monkeypatch, tmp_path):
    """The marker belongs to the launch (its agent's pid and start time): a child process is another 'launch'."""
    monkeypatch.setattr(console.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(console, "_shares_stderr_with", lambda pid: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert console.first_on_this_node("error: z")
    code = f"import tempfile; tempfile.tempdir = {str(tmp_path)!r}; from k3train.runtime import console; "
    code += "print(console.first_on_this_node('error: z'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_a_rank_whose_stderr_is_its_own_file_always_says_it(monkeypatch, tmp_path):
    """torchrun --redirects gives each rank a log file: each must hold the rank's own line."""
    monkeypatch.setattr(console.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    code = "from k3train.runtime import console; console.first_on_this_node('error: w'); "
    code += "print(console.first_on_this_node('error: w'))"
    with open(tmp_path / "stderr.log", "w") as own:  # the child's stderr: not its parent's
        out = subprocess.run([sys.executable, "-c", code], stderr=own, capture_output=False, stdout=subprocess.PIPE)
    assert out.stdout.decode().strip() == "True"
