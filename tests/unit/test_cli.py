"""The CLI prints user errors as one message and exits 2; --debug keeps the traceback."""

import subprocess
import sys

import pytest

from kiln import __version__

from ..conftest import kiln_here


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
    r = kiln_here("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "no saved model" in r.stderr and "Traceback" not in r.stderr


def test_help_has_examples():
    for cmd in ("train", "generate"):
        r = kiln(cmd, "--help")
        assert r.returncode == 0 and "Example" in r.stdout


def test_help_config_lists_documented_keys():
    r = kiln("train", "--help-config")
    assert r.returncode == 0 and "train.lr" in r.stdout and "Peak learning rate" in r.stdout


def plain_env() -> dict:
    """The environment of a user whose stderr is a pipe: no COLUMNS to widen rich's 80 columns."""
    import os

    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}


@pytest.mark.parametrize("override,key", [("train.lr=-1", "train.lr"), ("train.batch_size=0", "train.batch_size"),
                                          ("data.vocab_size=100", "data.vocab_size")])
def test_a_bad_value_stops_before_anything_is_written_or_prepared(tmp_path, override, key):
    r = kiln("train", override, f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert key in r.stderr and "1 problem(s)" in r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_error_messages_are_not_wrapped_inside_paths(tmp_path):
    deep = tmp_path / ("a_rather_long_directory_name_" * 3) / "config"
    deep.mkdir(parents=True)
    bad = deep / "broken.yaml"
    bad.write_text("train:\n  lr: 1\n   max_steps: [\n")
    assert len(str(bad)) > 80
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "train", str(bad)], capture_output=True, text=True,
                       timeout=120, env=plain_env())
    assert r.returncode == 2 and f"{bad}:3:" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny model whose vocabulary (320) is padded beyond its tokenizer's (300)."""
    import torch

    from kiln.config import ModelConfig
    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.model.llama import Transformer
    from kiln.state.weights import save_model

    tok = train_bpe(["def f(x):\n    return x * 2\n", "class A:\n    pass\n"] * 50, 300)
    assert tok.vocab_size <= 300
    torch.manual_seed(0)
    model = Transformer(ModelConfig(size="tiny", vocab_size=320))
    out = tmp_path_factory.mktemp("run")
    save_model(model, model.cfg, tok, out / "model")
    return out


@pytest.mark.parametrize("args,option", [(["--top-k", "-1"], "--top-k"), (["--temperature", "-0.5"], "--temperature"),
                                         (["-n", "0"], "--max-new-tokens"), (["--threads", "0"], "--threads")])
def test_generate_refuses_bad_sampling_options(model_dir, args, option):
    r = kiln_here("generate", str(model_dir), "--prompt", "def ", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and option in r.stderr


def test_generate_greedy_with_threads(model_dir):
    r = kiln_here("generate", str(model_dir), "--prompt", "def ", "-n", "5", "--temperature", "0", "--top-k", "0",
                  "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ")
    again = kiln_here("generate", str(model_dir), "--prompt", "def ", "-n", "5", "--temperature", "0", "--seed", "3")
    assert again.stdout == r.stdout  # greedy: the seed does not matter


def test_generate_at_a_vanishing_temperature_is_greedy_and_nan_is_refused(model_dir):
    greedy = kiln_here("generate", str(model_dir), "--prompt", "def ", "-n", "5", "--temperature", "0")
    tiny = kiln_here("generate", str(model_dir), "--prompt", "def ", "-n", "5", "--temperature", "1e-40")
    assert tiny.returncode == 0 and "Traceback" not in tiny.stderr, tiny.stderr
    assert tiny.stdout == greedy.stdout
    r = kiln_here("generate", str(model_dir), "--prompt", "def ", "--temperature", "nan")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--temperature" in r.stderr


def test_generate_samples_as_the_models_generation_config_says_unless_told(model_dir, tmp_path):
    """Its generation_config.json's do_sample false and max_new_tokens 4: greedy, 4 tokens, whatever the seed; an
    option given wins. Before, Kiln's own defaults (temperature 0.8, 100 tokens) ignored the file."""
    import shutil

    from typer.testing import CliRunner

    from kiln.cli.app import app

    run = tmp_path / "run"
    shutil.copytree(model_dir, run)
    (run / "model" / "generation_config.json").write_text('{"do_sample": false, "max_new_tokens": 4}')

    def out(*args):
        r = CliRunner().invoke(app, ["generate", str(run), "--prompt", "def ", *args])
        assert r.exit_code == 0, r.output
        return r.stdout

    assert out("--seed", "1") == out("--seed", "2") == out("--temperature", "0", "-n", "4")
    assert out("--seed", "1", "--temperature", "1", "-n", "12") != out("--seed", "2", "--temperature", "1", "-n", "12")
    assert "generation_config.json" in CliRunner().invoke(app, ["generate", "--help"]).stdout


def test_generate_stopped_by_ctrl_c_prints_what_it_sampled(model_dir, monkeypatch):
    """Ctrl-C in a long `kiln generate` lost every token sampled so far: they are printed, and it exits 130."""
    from typer.testing import CliRunner

    from kiln.cli.app import app
    from kiln.model.llama import Transformer

    greedy = CliRunner().invoke(app, ["generate", str(model_dir), "-p", "def ", "-n", "3", "--temperature", "0",
                                      "--ignore-eos"])
    forward, calls = Transformer.forward, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 3:  # Ctrl-C as the fourth token is sampled
            raise KeyboardInterrupt
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", interrupted)
    r = CliRunner().invoke(app, ["generate", str(model_dir), "-p", "def ", "-n", "50", "--temperature", "0",
                                 "--ignore-eos"])
    assert r.exit_code == 130 and r.stdout == greedy.stdout  # the three tokens sampled before it


def test_generate_help_says_zero_is_greedy():
    r = kiln("generate", "--help")
    assert r.returncode == 0 and "greedy" in r.stdout and "--threads" in r.stdout


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "abc"}, {"WORLD_SIZE": "2", "RANK": "x", "LOCAL_RANK": "y"}])
def test_an_error_is_shown_as_one_message_whatever_torchruns_variables_hold(monkeypatch, capsys, env):
    """WORLD_SIZE=abc turned the error message of `kiln train` (and of --nproc) into a ValueError traceback."""
    from kiln import cli

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["kiln", "train", "train.lr=abc"])
    monkeypatch.setattr("kiln.parallel.launch.torchrun.wait_for_first_rank", lambda: None)
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "train.lr" in err


def test_a_sighup_that_stops_a_command_exits_with_its_status(model_dir, tmp_path, monkeypatch, capsys):
    """`kiln eval` reads its --data with kiln prepare's readers, which SIGHUP (a closed terminal) now interrupts as
    SIGTERM does, cleanup running: kiln's main said 'interrupted' and exited 130 for any such interrupt."""
    import os
    import signal

    from kiln import cli
    from kiln.data.read import readers

    real = readers.read_text

    def hung_up(*args, **kw):
        os.kill(os.getpid(), signal.SIGHUP)  # the terminal closes as the text is read
        return real(*args, **kw)

    (tmp_path / "held-out.txt").write_text("def g(y):\n    return y\n" * 20)
    monkeypatch.setattr(readers, "read_text", hung_up)
    monkeypatch.setattr(sys, "argv", ["kiln", "eval", str(model_dir), "--data", str(tmp_path / "held-out.txt")])
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 128 + signal.SIGHUP
    assert "interrupted (SIGHUP)" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["file", "directory"])
def test_train_keeps_the_users_config_file_in_its_run_directory(tmp_path, monkeypatch, capsys, given):
    """`kiln train exp/config.yaml train.run_dir=exp` and `kiln train exp/` wrote the run's resolved config over
    the user's exp/config.yaml."""
    from kiln import cli

    (tmp_path / "config.yaml").write_text("# my experiment\ntrain: {max_steps: 3}\n")
    args = [str(tmp_path / "config.yaml"), f"train.run_dir={tmp_path}"] if given == "file" else [str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["kiln", "train", *args])
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 2 and "is your config file" in capsys.readouterr().err
    assert (tmp_path / "config.yaml").read_text() == "# my experiment\ntrain: {max_steps: 3}\n"
