"""The final model's weights: a round trip, and damaged files reported as StateError."""

import pytest
import torch
from safetensors.torch import save_file

from kiln.config import ModelConfig
from kiln.errors import StateError
from kiln.model import Transformer
from kiln.state.weights import final_model_errors, load_model, save_model


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip(tmp_path, tied):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(size="tiny", vocab_size=97, tie_embeddings=tied))
    save_model(model, model.cfg, None, tmp_path / "model")
    loaded, tok = load_model(tmp_path)
    x = torch.randint(0, 97, (2, 9))
    assert tok is None and torch.equal(loaded(x), model(x))
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied


def test_damaged_files_are_state_errors(tmp_path):
    model = Transformer(ModelConfig(size="tiny", vocab_size=97))
    out = save_model(model, model.cfg, None, tmp_path / "model")
    named = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(named, out / "model.safetensors")  # another tool's names (Hugging Face's): a KeyError before
    with pytest.raises(StateError, match=r"model.safetensors does not match .*: 21 tensor\(s\) missing "
                       r"\(e.g. embed_tokens.weight, .*\), 20 unknown \(e.g. model.embed_tokens.weight, .*delete that"):
        load_model(tmp_path)
    (out / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(StateError, match="model.safetensors is damaged"):
        load_model(tmp_path)
    (out / "model_config.json").write_text("{")
    with pytest.raises(StateError, match="model_config.json is not a valid model config"):
        load_model(tmp_path)
    with pytest.raises(StateError, match="no saved model"):
        load_model(tmp_path / "nowhere")


def test_identical_models_save_byte_identical_files(tmp_path):
    import hashlib

    torch.manual_seed(0)
    model = Transformer(ModelConfig(size="tiny", vocab_size=97))
    digests = set()
    for i in range(12):  # safetensors' metadata order changed from one save to the next (1 in 2 each time)
        out = save_model(model, model.cfg, None, tmp_path / f"m{i}")
        digests.add(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1


def test_the_saved_and_exported_weights_get_the_mode_of_a_new_file(tmp_path):
    """safetensors creates its file 0600: a model/ or an export only its owner could read."""
    import os
    import stat

    from kiln.files import umask
    from kiln.state.export import export_hf

    model = Transformer(ModelConfig(size="tiny", vocab_size=64))
    old = os.umask(0o022)
    try:
        save_model(model, model.cfg, None, tmp_path / "model")
        export_hf(model, model.cfg, None, tmp_path / "hf")
        assert umask() == 0o022
    finally:
        os.umask(old)
    for path in (tmp_path / "model" / "model.safetensors", tmp_path / "hf" / "model.safetensors"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_a_final_model_the_disk_cannot_hold_is_a_state_error(tmp_path):
    """A real 1 MiB disk (tmpfs; needs root): a final save whose weights do not fit, then one whose weights fit but
    not its tokenizer. Both raised the writer's own error with a traceback (safetensors' SafetensorError, the
    tokenizer's plain Exception), and the second left a partial tokenizer.json after model_config.json, a model/
    that read as complete. Now a StateError that says what to do, no partial file, and model/ not complete."""
    import subprocess
    import sysconfig
    from pathlib import Path

    from kiln.data.prepare.tokenizer import train_bpe
    from kiln.state.rundir import model_saved

    run = tmp_path / "run"
    run.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(run)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(size="tiny", vocab_size=300))
        tok = train_bpe([(Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()], 300)
        out = run / "model"
        (run / "filler").write_bytes(b"0" * (1 << 20))  # the disk full to the last block: nothing fits
        with pytest.raises(StateError, match=rf"writing the final model to {out} failed: .*No space left on device"
                                             rf".*`kiln train {run}` writes model/"):
            with final_model_errors(run):
                save_model(model, model.cfg, tok, out)
        assert list(out.iterdir()) == []  # the partial weights gave their room back
        (run / "filler").unlink()
        save_model(model, model.cfg, None, tmp_path / "weights")
        weights = (tmp_path / "weights" / "model.safetensors").stat().st_size
        free = subprocess.run(["df", "-B1", "--output=avail", str(run)], capture_output=True, text=True)
        room = int(free.stdout.split()[-1]) - weights - 8192  # the weights fit, not the tokenizer (~10 KB)
        (run / "filler").write_bytes(b"0" * room)
        with pytest.raises(StateError, match="No space left on device"):
            with final_model_errors(run):
                save_model(model, model.cfg, tok, out)
        assert not model_saved(out) and sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    finally:
        subprocess.run(["umount", "-l", str(run)], capture_output=True)
