"""Kiln's model against Hugging Face `LlamaForCausalLM` built locally: same weights, same data, same losses."""

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from kiln.config import ModelConfig
from kiln.errors import StateError
from kiln.model.hf import from_hf_config_dict, from_hf_state_dict, hf_config, to_hf_config_dict, to_hf_state_dict
from kiln.model.llama import Transformer

transformers = pytest.importorskip("transformers")


def _stdlib_bytes(n: int) -> torch.Tensor:
    """Real text: the first n bytes of a standard-library module, as token ids 0..255."""
    data = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_bytes()[:n]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


@pytest.mark.slow  # 20 training steps of two models, each
@pytest.mark.parametrize("tied", [True, False])
def test_losses_match_hf_for_20_adamw_steps(tied):
    cfg = ModelConfig(size="tiny", vocab_size=256, tie_embeddings=tied, max_seq_len=64)
    torch.manual_seed(0)
    kiln = Transformer(cfg)
    hf = transformers.LlamaForCausalLM(hf_config(cfg))
    hf.config._attn_implementation = "sdpa"
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(kiln.state_dict(), tied), strict=False)
    assert not unexpected and all("rotary" in k or (tied and k == "lm_head.weight") for k in missing)
    B, T = 4, 64
    data = _stdlib_bytes(20 * B * (T + 1)).view(20, B, T + 1)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1) for m in (kiln, hf)]
    for step in range(20):
        x = data[step, :, :T]
        y = data[step, :, 1:].clone()
        y[:, -1] = -100  # HF's loss shifts inside and scores T-1 positions: score the same ones here
        losses = [kiln(x, y), hf(input_ids=x, labels=x).loss]
        for loss, opt in zip(losses, opts):
            opt.zero_grad()
            loss.backward()
            opt.step()
        a, b = (loss.item() for loss in losses)
        assert abs(a - b) / abs(b) < 1e-4, f"step {step}: kiln {a} vs hf {b}"
    assert a < 5.0  # it learned something: ln(256) = 5.5 at the start


def test_state_dict_round_trip_and_config():
    cfg = ModelConfig(size="tiny", vocab_size=256, tie_embeddings=False)
    sd = Transformer(cfg).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, False), False)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    as_json = json.loads(json.dumps(to_hf_config_dict(cfg)))
    again = from_hf_config_dict(as_json)
    assert again.model_dump() == cfg.model_dump() | {"size": None, "hf_model_type": "llama"}


def test_unsupported_hf_config_is_a_clear_error():
    bad = to_hf_config_dict(ModelConfig(size="tiny", vocab_size=256)) | {"rope_parameters": {"rope_type": "yarn"},
                                                                         "hidden_act": "gelu"}
    with pytest.raises(StateError, match="hidden_act=gelu, rope_parameters.rope_type=yarn"):
        from_hf_config_dict(bad)
    with pytest.raises(StateError, match="model_type 'gemma' is not one Kiln's native model imports"):
        from_hf_config_dict(bad | {"model_type": "gemma"})
    untied = to_hf_state_dict(Transformer(ModelConfig(size="tiny", vocab_size=256)).state_dict(), True)
    with pytest.raises(StateError, match="no lm_head.weight"):
        from_hf_state_dict(untied, tie_embeddings=False)
