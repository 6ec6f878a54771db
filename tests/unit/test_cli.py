"""The CLI prints user errors as one message and exits 2; --debug keeps the traceback."""

import subprocess
import sys

from kiln import __version__


def kiln(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_version():
    r = kiln("--version")
    assert r.returncode == 0 and __version__ in r.stdout


def test_config_error_is_one_message_exit_2(tmp_path):
    r = kiln("train", "train.max_stpes=3", "model.n_layers=x", cwd=tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "train.max_stpes" in r.stderr and "did you mean 'train.max_steps'" in r.stderr
    assert "model.n_layers" in r.stderr
    assert not (tmp_path / "runs").exists()  # nothing started


def test_debug_shows_traceback(tmp_path):
    r = kiln("--debug", "train", "train.max_stpes=3", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" in r.stderr and "ConfigError" in r.stderr


def test_missing_config_file(tmp_path):
    r = kiln("train", "nope.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "nope.yaml" in r.stderr and "Traceback" not in r.stderr


def test_generate_on_a_dir_without_model(tmp_path):
    r = kiln("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "no saved model" in r.stderr and "Traceback" not in r.stderr


def test_help_has_examples():
    for cmd in ("train", "generate"):
        r = kiln(cmd, "--help")
        assert r.returncode == 0 and "Example" in r.stdout


def test_help_config_lists_documented_keys():
    r = kiln("train", "--help-config")
    assert r.returncode == 0 and "train.lr" in r.stdout and "Peak learning rate" in r.stdout
