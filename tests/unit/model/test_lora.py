"""LoRA on the native model: adapters start as a no-op, only they train (gradients, optimizer, checkpoint
part), the base stays bit for bit, merging and PEFT's format give the same logits, and it composes with
autocast, activation checkpointing and torch.compile."""

from __future__ import annotations

import pytest
import torch

from kiln.config import LoraConfig, ModelConfig, OptimConfig
from kiln.errors import ConfigError
from kiln.model.hf_import import import_hf
from kiln.model.llama import Transformer
from kiln.model.lora import (
    LoraLinear,
    adapter_state_dict,
    apply_lora,
    hf_target_modules,
    is_adapter_key,
    lora_layers,
    merge_lora,
    merge_state_dict,
    trainable_summary,
)
from kiln.model.lora_peft import read_peft_adapters, write_peft_adapters
from kiln.parallel.ac import apply_ac
from kiln.state.parts import ModelState
from kiln.train.optim import build_optimizer

CFG = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)


def lora_model(seed: int = 0, cfg: ModelConfig = CFG, **lora) -> tuple[Transformer, LoraConfig]:
    torch.manual_seed(seed)
    lcfg = LoraConfig(**{"rank": 4, "alpha": 8.0, "base_dtype": "fp32", **lora})
    return apply_lora(Transformer(cfg), lcfg), lcfg


def randomize_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def tokens(seed: int = 2, shape=(2, 16)) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_adapters_start_as_the_base_model_and_keep_its_keys():
    torch.manual_seed(0)
    base = Transformer(CFG).eval()
    keys, x = set(base.state_dict()), tokens()
    expected = base(x)
    model = apply_lora(base, LoraConfig(rank=4, base_dtype="fp32"))
    state = model.state_dict()
    assert {k for k in state if not is_adapter_key(k)} == keys  # the base's keys unchanged
    assert sorted(k for k in state if is_adapter_key(k))[:2] == ["layers.0.self_attn.k_proj.lora_A.weight",
                                                                  "layers.0.self_attn.k_proj.lora_B.weight"]
    assert len(adapter_state_dict(model)) == 2 * 4 * CFG.n_layers  # A and B on q, k, v, o of each layer
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # B = 0: exactly the base
    a = model.layers[0].self_attn.q_proj.lora_A.weight
    assert a.abs().max() > 0 and a.abs().max() <= 1 / CFG.d_model ** 0.5  # PEFT's Kaiming-uniform bound
    with pytest.raises(RuntimeError, match="already applied"):
        apply_lora(model, LoraConfig(rank=4))


def test_base_frozen_in_bf16_by_default_adapters_trainable_in_fp32():
    torch.manual_seed(0)
    model = apply_lora(Transformer(CFG.model_copy(update={"tie_embeddings": True})), LoraConfig(rank=2))
    for name, p in model.named_parameters():
        assert p.requires_grad == is_adapter_key(name), name
        assert p.dtype == (torch.float32 if is_adapter_key(name) else torch.bfloat16), name
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied
    assert model.rope_cos.dtype == torch.float32  # buffers are not the base's weights
    loss = model(tokens(), tokens(3))  # a bf16 base with fp32 adapters runs without autocast
    loss.backward()
    assert torch.isfinite(loss)
    total = sum(p.numel() for p in Transformer(CFG.model_copy(update={"tie_embeddings": True})).parameters())
    adapters = CFG.n_layers * 2 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64)  # r (in + out) for q, k, v, o
    assert trainable_summary(model, LoraConfig(rank=2)).endswith(
        f"{adapters:,} trainable of {total + adapters:,} parameters ({100 * adapters / (total + adapters):.2f}%), "
        "base frozen in bf16")


def test_targets_map_to_the_layers_and_a_missing_gate_is_a_config_error():
    model, _ = lora_model(targets=["gate", "down"])
    mlp = model.layers[1].mlp
    assert isinstance(mlp.gate_proj, LoraLinear) and isinstance(mlp.down_proj, LoraLinear)
    assert not isinstance(mlp.up_proj, LoraLinear) and not isinstance(model.layers[1].self_attn.q_proj, LoraLinear)
    relu2 = CFG.model_copy(update={"mlp": "relu2"})
    with pytest.raises(ConfigError, match="no gate projection"):
        lora_model(cfg=relu2, targets=["q", "gate"])
    model, _ = lora_model(cfg=relu2, targets=["all"])
    assert sum(isinstance(m, LoraLinear) for m in model.modules()) == 6 * CFG.n_layers
    assert hf_target_modules(relu2, ["all"]) == ["down_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_only_adapters_get_gradients_are_optimized_and_checkpointed():
    model, _ = lora_model(targets=["all"])
    model(tokens(), tokens(3)).backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == is_adapter_key(name), name
    adapters = {id(p) for n, p in model.named_parameters() if is_adapter_key(n)}
    opt = build_optimizer(model, OptimConfig(), 1e-3, torch.device("cpu"))
    assert {id(p) for g in opt.param_groups for p in g["params"]} == adapters
    part = ModelState(model).state_dict()
    assert set(part) == set(adapter_state_dict(model)) and part  # the checkpoint's "model" part
    plain = Transformer(CFG)
    assert set(ModelState(plain).state_dict()) == set(plain.state_dict())  # without LoRA: every weight


def test_training_moves_adapters_and_leaves_the_base_bit_for_bit():
    model, _ = lora_model(targets=["all"], dropout=0.1)
    base = {k: v.clone() for k, v in model.state_dict().items() if not is_adapter_key(k)}
    start = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), 1e-2, torch.device("cpu"))
    first = last = None
    for step in range(8):
        loss = model(tokens(step), tokens(step + 100))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        first, last = first or loss.item(), loss.item()
    for k, v in model.state_dict().items():
        if is_adapter_key(k):
            assert not torch.equal(v, start[k]), k
        else:
            assert torch.equal(v, base[k]), k
    assert last != first


def test_checkpoint_part_restores_adapters_into_a_fresh_lora_model():
    model, _ = lora_model(targets=["q", "v"])
    randomize_adapters(model)
    saved = {k: v.clone() for k, v in ModelState(model).state_dict().items()}
    other, _ = lora_model(targets=["q", "v"], seed=5)  # other weights everywhere: then the same base
    other.load_state_dict({k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}, strict=False)
    assert not torch.equal(other(tokens()), model(tokens()))
    ModelState(other).load_state_dict(saved)
    x = tokens()
    torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)


def test_merged_model_equals_the_lora_model():
    model, lcfg = lora_model(targets=["all"])
    randomize_adapters(model)
    model.eval()
    x = tokens()
    merged = merge_lora(model)
    assert type(merged) is Transformer and not any(is_adapter_key(k) for k in merged.state_dict())
    torch.testing.assert_close(merged(x), model(x), rtol=0, atol=1e-5)
    from_dict = Transformer(CFG)
    from_dict.load_state_dict(merge_state_dict(model.state_dict(), lcfg))
    torch.testing.assert_close(from_dict.eval()(x), model(x), rtol=0, atol=1e-5)
    assert merge_lora(Transformer(CFG)).__class__ is Transformer  # nothing to merge: the model itself


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "nemotron", "qwen3", "phi3", "gemma2", "gemma3"])
def test_peft_loads_the_adapters_onto_the_base_with_equal_logits(arch, hf_model, tmp_path):
    peft = pytest.importorskip("peft")
    hf = hf_model(arch)
    hf.save_pretrained(tmp_path / "base")
    cfg, state = import_hf(tmp_path / "base")
    model = Transformer(cfg)
    model.load_state_dict(state)
    lcfg = LoraConfig(rank=4, alpha=16.0, dropout=0.05, targets=["all"], base_dtype="fp32")
    apply_lora(model, lcfg)
    randomize_adapters(model)
    out = write_peft_adapters(adapter_state_dict(model), cfg, lcfg, str(tmp_path / "base"), tmp_path / "adapter")
    adapters, config = read_peft_adapters(out)
    assert config["r"] == 4 and config["lora_alpha"] == 16.0 and config["base_model_name_or_path"].endswith("base")
    assert all(torch.equal(adapters[k], v) for k, v in adapter_state_dict(model).items())
    loaded = peft.PeftModel.from_pretrained(hf, out).eval()
    assert not loaded.peft_config["default"].target_modules ^ set(hf_target_modules(cfg, ["all"]))
    x = tokens(shape=(2, 24))
    with torch.no_grad():
        ours = model.eval()(x)
        theirs = loaded(input_ids=x).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (ours - Transformer(cfg).eval()(x)).abs().max() > 1e-3  # the adapters do change the output


def test_the_adapters_of_a_run_that_extended_its_bases_context_are_refused(hf_model, tmp_path):
    """PEFT puts the adapters on the base as stored, with its 64 positions and plain rotary tables: for a run that
    extended the context (model.max_seq_len 128 with linear scaling) that is another model than the one trained, so
    no adapters are written for it (they used to be, silently); the run keeping its base's context writes them."""
    from kiln.config import RopeScaling
    from kiln.errors import StateError
    from kiln.model.hf_import import load_init_weights, resolve_init_from
    from kiln.model.lora_peft import peft_config, save_peft

    peft = pytest.importorskip("peft")
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "base")
    base = str(tmp_path / "base")
    cfg = resolve_init_from(ModelConfig(init_from=base, max_seq_len=128, rope_scaling=RopeScaling(type="linear",
                                                                                                  factor=2.0)))
    model = Transformer(cfg)
    load_init_weights(model, cfg)
    lcfg = LoraConfig(rank=4, alpha=16.0, targets=["q", "v"], base_dtype="fp32")
    apply_lora(model, lcfg)
    randomize_adapters(model)
    with pytest.raises(StateError, match="extended the context.*from its 64 positions to model.max_seq_len=128"):
        write_peft_adapters(adapter_state_dict(model), cfg, lcfg, base, tmp_path / "adapter")
    out = save_peft(adapter_state_dict(model), peft_config(cfg, lcfg, base), tmp_path / "anyway")
    x = tokens(shape=(1, 48))
    with torch.no_grad():  # written anyway, they give other logits (equal within 1e-5 where the context is kept)
        assert (peft.PeftModel.from_pretrained(hf, out).eval()(input_ids=x).logits - model.eval()(x)).abs().max() > 1e-4
    kept = resolve_init_from(ModelConfig(init_from=base, max_seq_len=32))  # bounded below: the base's context
    assert write_peft_adapters(adapter_state_dict(model), kept, lcfg, base, tmp_path / "kept").is_dir()


def test_phi3_targets_as_users_write_them_adapt_its_fused_layers_and_load_in_peft(hf_model, tmp_path):
    """Phi-3 keeps qkv_proj and gate_up_proj fused: lora.targets in Hugging Face's names (or Kiln's) adapt them
    whole, PEFT loads the adapters onto Phi3ForCausalLM with the same logits, and the plan counts them."""
    peft = pytest.importorskip("peft")
    from kiln.model.lora import trainable_count
    from kiln.plan.memory import Lora, lora_params

    hf = hf_model("phi3")
    hf.save_pretrained(tmp_path / "base")
    cfg, state = import_hf(tmp_path / "base")
    for targets, adapted in ((["q"], {"qkv_proj"}), (["q", "k", "v", "o"], {"qkv_proj", "o_proj"}),
                             (["up", "down"], {"gate_up_proj", "down_proj"})):
        model, lcfg = lora_model(cfg=cfg, targets=targets)
        assert {n.rsplit(".", 1)[1] for n in lora_layers(model)} == adapted
        assert lora_params(cfg, Lora(lcfg.rank, tuple(lcfg.targets))) == trainable_count(model)
    lcfg = LoraConfig(rank=4, alpha=16.0, targets=["qkv_proj", "gate_up_proj", "o_proj", "down_proj"],
                      base_dtype="fp32")
    assert lcfg.targets == ["q", "k", "v", "gate", "up", "o", "down"]
    model = Transformer(cfg)
    model.load_state_dict(state)
    apply_lora(model, lcfg)
    assert {n.split("layers.0.")[1] for n in lora_layers(model) if n.startswith("layers.0.")} == {
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}
    randomize_adapters(model)
    out = write_peft_adapters(adapter_state_dict(model), cfg, lcfg, str(tmp_path / "base"), tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(hf, out).eval()
    assert loaded.peft_config["default"].target_modules == {"qkv_proj", "gate_up_proj", "o_proj", "down_proj"}
    assert "(layers down_proj, gate_up_proj, o_proj, qkv_proj: a fused one adapted whole)" in trainable_summary(
        model, lcfg)
    x = tokens(shape=(2, 24))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, model.eval()(x), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="unknown LoRA target.*qkv_proj"):
        LoraConfig(rank=4, targets=["qkv"])


def test_bf16_autocast_gives_fp32_gradients_to_the_adapters():
    model, _ = lora_model(base_dtype="bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens(), tokens(3))
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if is_adapter_key(n)]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().max() > 0 for g in grads)


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_replays_the_adapter_dropout(mode):
    plain, _ = lora_model(targets=["all"], dropout=0.5)
    randomize_adapters(plain)
    ckpt, _ = lora_model(targets=["all"], dropout=0.5)
    ckpt.load_state_dict(plain.state_dict())
    apply_ac(ckpt, mode)
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(7)  # the same dropout masks in both forwards
        model(tokens(), tokens(3)).backward()
        grads.append(_adapter_grads(model))
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:  # the recomputed forward drew the same masks as the first one
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_compiled_blocks_match_eager():
    from kiln.parallel.compile import apply_compile

    eager, _ = lora_model(targets=["all"])
    randomize_adapters(eager)
    compiled, _ = lora_model(targets=["all"])
    compiled.load_state_dict(eager.state_dict())
    apply_ac(compiled, "selective")
    apply_compile(compiled)
    assert set(compiled.state_dict()) == set(eager.state_dict())  # keys unchanged by compile
    losses = []
    for model in (eager, compiled):
        loss = model(tokens(), tokens(3))
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    g0, g1 = _adapter_grads(eager), _adapter_grads(compiled)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6)


def test_flops_and_training_memory_count_a_frozen_base():
    from kiln.model.lora import lora_flops_per_token, trainable_count, training_bytes
    from kiln.model.registry import flops_per_token, param_count

    model, _ = lora_model(base_dtype="bf16")
    trainable = trainable_count(model)
    assert trainable == CFG.n_layers * 4 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64)
    assert training_bytes(model) == 2 * param_count(CFG) + 16 * trainable  # bf16 base; fp32 adapters + Adam
    attention = 12.0 * CFG.n_layers * CFG.d_model * 32
    n = param_count(CFG)  # tied embeddings: the table is the head, a matrix product counted once
    full = flops_per_token(CFG, 32)
    assert full == 6.0 * n + attention
    # forward and input gradients of the base (4 N), all three products of the adapters, attention unchanged
    assert lora_flops_per_token(full, CFG, 32, trainable) == pytest.approx(4.0 * n + 6.0 * trainable + attention)
