"""kiln.model.hf_auto: transformers causal LMs behind Kiln's model call (model.hf_class=auto)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.config import LoraConfig, ModelConfig, OptimConfig, load_config
from kiln.errors import ConfigError, StateError
from kiln.model.hf_auto import auto_config, build_auto, decoder_layers, doc_positions
from kiln.model.hf_import import resolve_init_from
from kiln.parallel.ac import apply_ac
from kiln.train.optim import build_optimizer
from kiln.train.run import with_init_from

transformers = pytest.importorskip("transformers")

TINY = {
    "gpt2": dict(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=48, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0),
    "llama": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=48),
    "phi": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=48, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "gemma": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=48),
    "bloom": dict(vocab_size=64, hidden_size=32, n_layer=2, n_head=2),  # ALiBi; its forward takes no position_ids
}


def hf_dir(root: Path, kind: str) -> Path:
    config = transformers.AutoConfig.for_model(kind, **TINY[kind])
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / kind)
    return root / kind


def model_cfg(path: Path, **extra) -> ModelConfig:
    return auto_config(ModelConfig(init_from=str(path), hf_class="auto", **extra))


def test_doc_positions_restart_at_every_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert doc_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_auto_config_takes_vocab_and_context_and_refuses_native_fields(tmp_path):
    path = hf_dir(tmp_path, "gpt2")
    cfg = model_cfg(path)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.hf_class) == (64, 48, "auto")
    assert model_cfg(path, max_seq_len=32).max_seq_len == 32
    with pytest.raises(ConfigError, match="max_seq_len=64 beside .* longer than the model's 48 positions"):
        model_cfg(path, max_seq_len=64)
    with pytest.raises(ConfigError, match="longer than the model's 48 positions.*to extend the context, edit a copy"):
        model_cfg(path, max_seq_len=96, rope_scaling={"type": "linear", "factor": 2.0})  # was 'remove those fields'
    with pytest.raises(ConfigError, match="model.d_model"):
        model_cfg(path, d_model=64)


def test_auto_config_reads_back_a_runs_config_yaml(tmp_path):
    """A run's config.yaml records every model field, as auto_config left them: `kiln train RUN_DIR` read it
    back and refused to resume ('the config also sets model.attention_bias, model.d_model, ...')."""
    from kiln.config import load_config

    path = hf_dir(tmp_path, "llama")
    cfg = load_config(None, ["train.seq_len=32"]).model_copy(update={"model": model_cfg(path)})
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    again = load_config(tmp_path / "config.yaml")
    assert auto_config(again.model) == cfg.model
    with pytest.raises(ConfigError, match=r"sets model.n_layers: remove"):
        auto_config(load_config(tmp_path / "config.yaml", ["model.n_layers=3"]).model)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "phi", "gemma"])
def test_loss_is_cross_entropy_of_the_models_logits(tmp_path, kind):
    cfg = model_cfg(hf_dir(tmp_path, kind))
    model = build_auto(cfg).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / kind).eval()
    x = torch.randint(0, 64, (2, 12))
    y = torch.randint(0, 64, (2, 12))
    y[0, :3] = -100  # not counted
    with torch.no_grad():
        logits = ref(input_ids=x).logits
        want = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        torch.testing.assert_close(model(x), logits)
        torch.testing.assert_close(model(x, y), want)
    assert decoder_layers(model.hf) is model.layers and len(model.layers) == 2


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bloom"])  # bloom: each document run alone (hf_packing)
def test_documents_in_a_packed_row_do_not_see_each_other(tmp_path, kind):
    context = {"max_seq_len": 48} if kind == "bloom" else {}  # ALiBi: its config.json names no context length
    model = build_auto(model_cfg(hf_dir(tmp_path, kind), **context)).eval()
    a, b = torch.randint(0, 64, (1, 7)), torch.randint(0, 64, (1, 9))
    row, docs = torch.cat([a, b], 1), torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        packed = model(row, doc_ids=docs)
        torch.testing.assert_close(packed[:, 7:], model(b), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[:, :7], model(a), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model(row)[:, 7:], model(b), atol=1e-3)  # without doc_ids: one sequence


def test_activation_checkpointing_keeps_the_gradients(tmp_path):
    cfg = model_cfg(hf_dir(tmp_path, "llama"))
    x, y = torch.randint(0, 64, (2, 10)), torch.randint(0, 64, (2, 10))
    grads = []
    for mode in ("none", "full", "selective"):
        model = apply_ac(build_auto(cfg), mode)
        model(x, y, torch.tensor([[0] * 4 + [1] * 6] * 2)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, msg=name)


def test_unsupported_architecture_suggests_the_auto_path(tmp_path):
    path = hf_dir(tmp_path, "gpt2")
    with pytest.raises(StateError, match="'gpt2'.*model.hf_class=auto"):
        resolve_init_from(ModelConfig(init_from=str(path)))


def test_pickled_weights_are_refused(tmp_path):
    path = hf_dir(tmp_path, "gpt2")
    state = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    cfg = model_cfg(path)
    with pytest.raises(StateError, match="pickled"):
        build_auto(cfg)
    assert build_auto(cfg.model_copy(update={"allow_pickle": True}), weights=True).param_count() > 0


def test_weights_the_files_do_not_hold_are_refused_not_left_random(tmp_path):
    from safetensors.torch import load_file, save_file

    path = hf_dir(tmp_path, "llama")
    state = load_file(str(path / "model.safetensors"))  # the same tensors under another model's names
    save_file({k.replace("model.", "decoder."): v for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(StateError, match=r"weights of the model are not in its files .* tensors the model does not"):
        build_auto(model_cfg(path))


REMOTE_CONFIG = '''
from transformers import PretrainedConfig


class TinyRemoteConfig(PretrainedConfig):
    model_type = "kiln_tiny_remote"

    def __init__(self, vocab_size=64, hidden_size=16, num_hidden_layers=2, max_position_embeddings=32, **kw):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.max_position_embeddings = num_hidden_layers, max_position_embeddings
        super().__init__(**kw)
'''
REMOTE_MODEL = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tiny import TinyRemoteConfig


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class TinyRemoteForCausalLM(PreTrainedModel):
    config_class = TinyRemoteConfig
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config.hidden_size) for _ in range(config.num_hidden_layers))
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, **kwargs):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return CausalLMOutput(logits=self.head(x))
'''


def remote_dir(root: Path) -> Path:
    """A model directory that ships its own code (config.json auto_map), written here."""
    d = root / "remote"
    d.mkdir()
    (d / "configuration_tiny.py").write_text(textwrap.dedent(REMOTE_CONFIG))
    (d / "modeling_tiny.py").write_text(textwrap.dedent(REMOTE_MODEL))
    (d / "config.json").write_text(json.dumps({
        "model_type": "kiln_tiny_remote", "architectures": ["TinyRemoteForCausalLM"], "vocab_size": 64,
        "hidden_size": 16, "num_hidden_layers": 2, "max_position_embeddings": 32,
        "auto_map": {"AutoConfig": "configuration_tiny.TinyRemoteConfig",
                     "AutoModelForCausalLM": "modeling_tiny.TinyRemoteForCausalLM"}}))
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file({"embed.weight": torch.randn(64, 16, generator=g), "head.weight": torch.randn(64, 16, generator=g),
               **{f"blocks.{i}.fc.{k}": torch.randn(*((16, 16) if k == "weight" else (16,)), generator=g)
                  for i in range(2) for k in ("weight", "bias")}}, str(d / "model.safetensors"))
    return d


def test_remote_code_is_refused_unless_trusted(tmp_path):
    path = remote_dir(tmp_path)
    with pytest.raises(ConfigError, match="ships its own model code.*model.trust_remote_code=true"):
        model_cfg(path)
    cfg = model_cfg(path, trust_remote_code=True)
    assert cfg.trust_remote_code and cfg.max_seq_len == 32
    model = build_auto(cfg)
    assert type(model.base).__name__ == "TinyRemoteForCausalLM" and len(model.layers) == 2
    x = torch.randint(0, 64, (1, 8))
    loss = model(x, x)
    assert torch.isfinite(loss)
    with pytest.raises(ConfigError, match="trust_remote_code"):  # a config edited afterwards is checked again
        build_auto(cfg.model_copy(update={"trust_remote_code": False}))


@pytest.mark.parametrize("targets,names", [(["q", "v"], {"q_proj", "v_proj"}),
                                           (["all"], {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"})])
def test_peft_lora_trains_only_the_adapters(tmp_path, targets, names):
    pytest.importorskip("peft")
    cfg = model_cfg(hf_dir(tmp_path, "llama"))
    model = build_auto(cfg, LoraConfig(rank=4, alpha=8, targets=targets, base_dtype="fp32"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n in trainable} == names
    opt = build_optimizer(model, OptimConfig(), 1e-3, torch.device("cpu"))
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in model.named_parameters() if n in trainable}
    x = torch.randint(0, 64, (2, 8))
    model(x, x).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    assert len(model.layers) == 2  # the blocks are found inside PEFT's wrapper


def test_lora_base_is_bf16_and_adapters_fp32(tmp_path):
    pytest.importorskip("peft")
    model = build_auto(model_cfg(hf_dir(tmp_path, "llama")), LoraConfig(rank=2))
    dtypes = {p.dtype for n, p in model.named_parameters() if p.requires_grad}
    frozen = {p.dtype for n, p in model.named_parameters() if not p.requires_grad}
    assert dtypes == {torch.float32} and frozen == {torch.bfloat16}


def test_activation_checkpointing_replays_dropout(tmp_path):
    """Blocks with dropout (GPT-2's defaults) recompute with the same dropout masks under checkpointing."""
    config = transformers.GPT2Config(**{**TINY["gpt2"], "resid_pdrop": 0.3, "attn_pdrop": 0.3})
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "drop")
    cfg = model_cfg(tmp_path / "drop")
    x, y = torch.randint(0, 64, (2, 10)), torch.randint(0, 64, (2, 10))
    grads = []
    for mode in ("none", "full"):
        model = apply_ac(build_auto(cfg), mode).train()
        torch.manual_seed(1)
        model(x, y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


@pytest.mark.slow
def test_compiled_blocks_match_eager(tmp_path):
    from kiln.parallel.compile import apply_compile

    cfg = model_cfg(hf_dir(tmp_path, "llama"))
    x, y, docs = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12)), torch.tensor([[0] * 5 + [1] * 7] * 2)
    eager, compiled = build_auto(cfg), apply_compile(build_auto(cfg))
    keys = list(compiled.state_dict())
    for model in (eager, compiled):
        model(x, y, docs).backward()
    assert list(compiled.state_dict()) == keys == list(eager.state_dict())
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_auto_needs_a_model_directory():
    from kiln.config import load_config

    with pytest.raises(ConfigError, match="model.hf_class=auto trains a Hugging Face model directory"):
        load_config(None, ["model.hf_class=auto"])


def test_a_damaged_weight_file_is_a_clear_error_not_a_traceback(tmp_path):
    """A truncated safetensors file (a copy cut short) raised safetensors' own SafetensorError out of `kiln train`
    on this path, with a traceback; the native import already said which file to copy again."""
    path = hf_dir(tmp_path, "llama")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(StateError, match="its weights cannot be read .*copy them again"):
        build_auto(model_cfg(path))


def test_a_model_that_is_no_causal_lm_is_refused_as_such(tmp_path):
    """An encoder-decoder (T5) was told to try model.hf_class=auto, which then asked for a context length and,
    given one, failed after the data was prepared with transformers' list of 200 configuration classes."""
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    for hf_class in ("native", "auto"):
        with pytest.raises(StateError, match="model_type 't5' is not a causal language model") as e:
            with_init_from(load_config(None, [f"model.init_from={tmp_path / 't5'}", f"model.hf_class={hf_class}"]))
        assert "Set model.hf_class=auto" not in str(e.value) and "Bart" not in str(e.value)


def test_a_row_longer_than_the_models_context_names_what_this_path_takes(tmp_path):
    """The auto path keeps its model's context; the error told to extend it with model.max_seq_len and
    model.rope_scaling, which this path then refuses."""
    from tokenizers import Tokenizer, models

    path = hf_dir(tmp_path, "llama")
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="train.seq_len=64 is longer than the 48 positions") as e:
        with_init_from(load_config(None, [f"model.init_from={path}", "model.hf_class=auto", "train.seq_len=64"]))
    assert "rope_scaling)" not in str(e.value) and "edit a copy of the model's config.json" in str(e.value)


def test_a_model_type_transformers_does_not_know_is_refused_before_the_data(tmp_path):
    """A model_type neither Kiln nor transformers knows was told to try model.hf_class=auto, which failed after
    the data was prepared."""
    path = hf_dir(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "foobar_lm"}))
    for hf_class in ("native", "auto"):
        with pytest.raises(StateError, match="'foobar_lm' is a model_type transformers .* does not know") as e:
            with_init_from(load_config(None, [f"model.init_from={path}", f"model.hf_class={hf_class}"]))
        assert "Set model.hf_class=auto" not in str(e.value) and "trust_remote_code" in str(e.value)
