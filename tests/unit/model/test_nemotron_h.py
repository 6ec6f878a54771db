"""Native Nemotron-H (hybrid Mamba-2, attention and MLP layers) against transformers' NemotronHForCausalLM built
locally: import, export, generation, and packed documents kept apart."""

import json

import pytest
import torch

from kiln.config import ModelConfig
from kiln.errors import StateError
from kiln.model.generate import generate
from kiln.model.hf import from_hf_config_dict, from_hf_state_dict, hf_config, to_hf_config_dict, to_hf_state_dict
from kiln.model.hf_import import import_hf
from kiln.model.llama import Transformer

transformers = pytest.importorskip("transformers")

# every layer kind, groups of heads, a chunk shorter than the rows; time_step_min low: transformers 5.2x clamps
# the time steps there (Kiln: at the config's time_step_limit, as Mamba-2's kernels do)
SMALL = dict(vocab_size=96, hidden_size=64, hybrid_override_pattern="M*-M-", num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16,
             ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, time_step_min=1e-6, max_position_embeddings=64,
             tie_word_embeddings=False)


def build_hf(seed=0, **over):
    config = transformers.NemotronHConfig(**{**SMALL, **over})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(config).float().eval()
    with torch.no_grad():  # every parameter random, norms, D, dt_bias and the convolution's bias too
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "dt_bias" in name or "A_log" in name else 0.1))
    return model


@pytest.fixture(scope="module")
def pair():
    """(transformers' model, Kiln's import of it): built once, the first transformers model costs seconds."""
    hf = build_hf()
    return hf, imported(hf)[1]


def imported(hf):
    cfg = from_hf_config_dict(json.loads(hf.config.to_json_string()))
    model = Transformer(cfg).eval()
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg.tie_embeddings), strict=True)
    return cfg, model


def test_import_gives_transformers_logits_and_loss(pair):
    hf, kiln = pair
    cfg = kiln.cfg
    assert cfg.layer_pattern == "M*-M-" and cfg.mamba.groups == 2 and cfg.hf_model_type == "nemotron_h"
    x = torch.randint(0, 96, (2, 21))  # 21: the last chunk of the scan is padded
    with torch.no_grad():
        out = hf(input_ids=x, labels=x)
        assert (kiln(x) - out.logits).abs().max() < 1e-5
        y = torch.cat([x[:, 1:], torch.full((2, 1), -100)], dim=1)
        assert abs(kiln(x, y).item() - out.loss.item()) < 1e-5


def test_export_loads_in_transformers_with_the_same_logits():
    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=96, norm="rmsnorm",
                      mlp="relu2", layer_pattern="M-*M", mamba=dict(heads=8, head_dim=16, state=8, groups=2, chunk=4),
                      tie_embeddings=False, max_seq_len=64)
    torch.manual_seed(0)
    kiln = Transformer(cfg).eval()
    fields = json.loads(json.dumps(to_hf_config_dict(cfg), allow_nan=False))  # config.json: strict JSON
    assert fields["model_type"] == "nemotron_h" and fields["hybrid_override_pattern"] == "M-*M"
    hf = transformers.NemotronHForCausalLM(hf_config(cfg)).eval()
    hf.load_state_dict(to_hf_state_dict(kiln.state_dict(), False), strict=True)
    x = torch.randint(0, 96, (1, 17))
    with torch.no_grad():
        assert (hf(x).logits - kiln(x)).abs().max() < 1e-5
    again = from_hf_config_dict(fields)
    assert again.model_dump() == cfg.model_dump() | {"hf_model_type": "nemotron_h"}
    clamped = cfg.model_copy(update={"mamba": cfg.mamba.model_copy(update={"dt_limit": (0.001, 10.0)})})
    written = json.loads(json.dumps(to_hf_config_dict(clamped), allow_nan=False))
    assert from_hf_config_dict(written).mamba.dt_limit == (0.001, 10.0)


def test_packed_documents_give_what_they_give_alone(pair):
    _, kiln = pair
    first, second = torch.randint(0, 96, (1, 11)), torch.randint(0, 96, (1, 14))
    row = torch.cat([first, second], dim=1)
    docs = torch.tensor([[0] * 11 + [1] * 14])
    with torch.no_grad():
        packed = kiln(row, doc_ids=docs)
        assert (packed[:, 11:] - kiln(second)).abs().max() < 1e-5
        assert (packed[:, :11] - kiln(first)).abs().max() < 1e-5
        assert (kiln(row)[:, 11:] - kiln(second)).abs().max() > 1e-3  # without the ids the state carries over


def test_greedy_generation_matches_transformers(pair):
    """transformers generates step by step from its cached states (the recurrent form); Kiln recomputes the row."""
    hf, kiln = pair
    prompt = [5, 17, 3, 44, 60]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert generate(kiln, prompt, 8, temperature=0.0) == want


def test_a_saved_directory_imports(tmp_path, pair):
    hf, _ = pair
    hf.save_pretrained(tmp_path)  # names the decoder backbone., as the released checkpoints do
    cfg, state = import_hf(tmp_path)
    model = Transformer(cfg)
    model.load_state_dict(state, strict=True)
    assert torch.equal(model.norm.weight, hf.model.norm_f.weight)
    from kiln.parallel.materialize import load_shards

    with torch.device("meta"):  # the path FSDP takes: each parameter's rows read straight from the file
        sharded = Transformer(cfg)
    sharded.to_empty(device="cpu")
    load_shards(sharded, tmp_path, allow_pickle=False, tied=False)
    assert all(torch.equal(a, b) for a, b in zip(sharded.state_dict().values(), model.state_dict().values()))


def test_what_the_native_model_lacks_is_refused(pair):
    fields = json.loads(pair[0].config.to_json_string())
    moe = fields | {"layers_block_type": ["linear_attention", "moe"]}
    with pytest.raises(StateError, match="mixture-of-experts.*hf_class=auto"):
        from_hf_config_dict(moe)
    with pytest.raises(StateError, match="mlp_hidden_act=silu"):
        from_hf_config_dict(fields | {"mlp_hidden_act": "silu"})


def test_init_covers_every_parameter_once():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, layer_pattern="M*-", mlp="relu2",
                      mamba=dict(head_dim=8, state=4, groups=2))
    model = Transformer(cfg)
    order = [p for p, _ in model.init_order()]
    assert len(order) == len({id(p) for p in order}) == len({id(p) for p in model.parameters()})
    mixer = model.layers[0].mixer
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1.0, 9.0)))
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert (dt >= 1e-3 - 1e-7).all() and (dt <= 0.1 + 1e-6).all()


def hybrid_cfg(**over):
    return ModelConfig(**{**dict(vocab_size=64, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, ffn_hidden=48,
                                 mlp="relu2", layer_pattern="M*-M", tie_embeddings=False,
                                 mamba=dict(head_dim=8, state=4, groups=2, chunk=4)), **over})


@pytest.mark.parametrize("over", [{}, dict(tie_embeddings=True, mlp_bias=True,
                                           mamba=dict(head_dim=8, state=4, groups=2, proj_bias=True, conv_bias=False))])
def test_param_count_and_flops_know_the_mamba_layers(over):
    from kiln.model.lora import lora_flops_per_token
    from kiln.model.registry import flops_per_token, param_count

    cfg = hybrid_cfg(**over)
    model = Transformer(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert param_count(cfg) == n
    T, m = 16, cfg.mamba
    H, P, N, G, L = cfg.mamba_heads, m.head_dim, m.state, m.groups, min(m.chunk, T)
    scan = 6 * (L * G * N + L * H * P + 2 * H * P * N + T / L**2 * H * P * N)
    matmul = n - (0 if cfg.tie_embeddings else 64 * 32)
    want = 6 * matmul + 12 * 2 * 16 * T + 2 * scan  # one attention layer of 2 heads of 16, two Mamba layers
    assert flops_per_token(cfg, T) == pytest.approx(want)
    assert lora_flops_per_token(want, cfg, T, 0) == pytest.approx(want - 2 * matmul)


def test_lora_on_every_projection_trains_the_adapters_and_merges():
    from kiln.config import LoraConfig
    from kiln.errors import ConfigError
    from kiln.model.lora import LoraLinear, apply_lora, hf_target_modules, merge_lora

    cfg = hybrid_cfg()
    torch.manual_seed(0)
    model = apply_lora(Transformer(cfg), LoraConfig(rank=4, targets=["all"], base_dtype="fp32"))
    adapted = {n for n, mod in model.named_modules() if isinstance(mod, LoraLinear)}
    assert {"layers.0.mixer.in_proj", "layers.0.mixer.out_proj", "layers.1.mixer.q_proj", "layers.1.mixer.o_proj",
            "layers.2.mixer.up_proj", "layers.2.mixer.down_proj"} <= adapted and len(adapted) == 10
    assert hf_target_modules(cfg, ["in_proj", "out_proj", "q"]) == ["in_proj", "out_proj", "q_proj"]
    x = torch.randint(0, 64, (2, 12))
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(x, x).backward()
    opt.step()
    assert all(torch.equal(frozen[k], v) for k, v in model.state_dict().items() if k in frozen)
    with torch.no_grad():
        assert (merge_lora(model)(x) - model(x)).abs().max() < 1e-5
    with pytest.raises(ConfigError, match="no layer of this model"):
        apply_lora(Transformer(hybrid_cfg(layer_pattern="M-M-")), LoraConfig(rank=4, targets=["q", "in_proj"]))


def test_peft_adapters_are_written_only_where_peft_loads_them(pair, tmp_path):
    """PEFT refuses LoRA on a Mamba layer's out_proj (transformers' fused Mamba kernels read its weight directly):
    a run with lora.targets=[all] wrote PEFT adapters that PeftModel.from_pretrained then rejected. They are refused
    with what to do; without out_proj they are written, and PEFT loads them onto the base with Kiln's logits."""
    peft = pytest.importorskip("peft")
    from kiln.config import LoraConfig
    from kiln.model.lora import adapter_state_dict, apply_lora
    from kiln.model.lora_peft import write_peft_adapters

    hf, _ = pair
    hf.save_pretrained(tmp_path / "base")
    cfg = imported(hf)[0]
    for targets in (["all"], ["in_proj", "q", "down"]):
        lcfg = LoraConfig(rank=2, targets=targets, base_dtype="fp32")
        torch.manual_seed(0)
        model = apply_lora(imported(hf)[1], lcfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        if "all" in targets:
            with pytest.raises(StateError, match="PEFT refuses LoRA on a Mamba layer's out_proj.*lora.targets"):
                write_peft_adapters(adapter_state_dict(model), cfg, lcfg, str(tmp_path / "base"), tmp_path / "all")
            continue
        out = write_peft_adapters(adapter_state_dict(model), cfg, lcfg, str(tmp_path / "base"), tmp_path / "some")
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
        loaded = peft.PeftModel.from_pretrained(base, out).eval()
        x = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=x).logits, model.eval()(x), rtol=0, atol=1e-5)


def test_an_export_names_the_tensors_as_nemotron_h_files_do(tmp_path, pair):
    """The released checkpoints and transformers' own save_pretrained name the decoder `backbone.`; the export wrote
    `model.`, which transformers 5 renames on load but transformers 4 and converters reading those files do not know.
    Import then export gives back the file's names and tensors."""
    from safetensors.torch import load_file

    from kiln.state.export import export_hf

    hf, kiln = pair
    hf.save_pretrained(tmp_path / "hf")
    cfg, state = import_hf(tmp_path / "hf")
    export_hf(state, cfg, None, tmp_path / "out")
    saved, exported = (load_file(tmp_path / name / "model.safetensors") for name in ("hf", "out"))
    assert sorted(exported) == sorted(saved) and any(k.startswith("backbone.") for k in exported)
    assert all(torch.equal(saved[k], exported[k]) for k in saved)
