"""QLoRA end to end (lora.quantize_base=nf4): a random Llama in the Hugging Face layout is imported, its blocks'
linear layers quantized to NF4 as they load, and adapted for a few steps on the CPU. The loss falls, the base
stays frozen and 4-bit, a crashed run resumes to the very same adapters, the merged export is the dequantized
base plus the adapters (transformers gives Kiln's logits within 1e-5), and the adapters in PEFT's format load
onto the unquantized base."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kiln.model.hf_import import import_hf
from kiln.model.lora import adapter_state_dict, merge_lora, merge_state_dict
from kiln.model.quant import is_nf4, round_trip
from kiln.state.export import export_from
from kiln.state.rundir import checkpoints
from kiln.train.run import run

from .test_lora_train import Keep, config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("torchao")
pytestmark = pytest.mark.slow
NF4 = ("lora.quantize_base=nf4", "lora.base_dtype=bf16", "lora.dropout=0")


@pytest.fixture(scope="module")
def bf16_base(hf_llama, tmp_path_factory) -> Path:
    """hf_llama's model stored in bf16, as real bases are (the embeddings, norms and lm_head train as stored)."""
    out = tmp_path_factory.mktemp("bf16") / "model"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_llama / "model", dtype=torch.bfloat16)
    model.save_pretrained(out)
    shutil.copy(hf_llama / "model" / "tokenizer.json", out)
    return out


@pytest.fixture(scope="module")
def trained(hf_llama, bf16_base, tmp_path_factory):
    keep = Keep()
    run_dir = run(config(hf_llama, tmp_path_factory.mktemp("runs") / "run", *NF4, base=bf16_base), callbacks=[keep])
    return run_dir, keep


def test_qlora_trains_the_adapters_on_a_frozen_4bit_base(bf16_base, trained):
    run_dir, keep = trained
    _, stored = import_hf(bf16_base)
    quantized = {n: p for n, p in keep.model.named_parameters() if is_nf4(p)}
    # the seven linear layers of both blocks, adapted or not; embeddings, norms and lm_head are not
    assert len(quantized) == 14 and not any(p.requires_grad for p in quantized.values())
    for name, p in quantized.items():  # still exactly what quantizing the stored weight gives
        torch.testing.assert_close(p.get_original_weight(), round_trip(stored[name], torch.bfloat16), rtol=0, atol=0)
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight"):
        p = dict(keep.model.named_parameters())[name]
        assert not p.requires_grad and p.dtype == torch.bfloat16 and torch.equal(p, stored[name].bfloat16())
    assert keep.val_losses[-1] < keep.val_losses[0] - 0.01
    assert min(keep.losses.values()) < keep.losses[1]
    assert all(p.requires_grad == (".lora_" in n) for n, p in keep.model.named_parameters())


def test_qlora_resume_after_a_crash_gives_the_same_adapters(hf_llama, bf16_base, trained, tmp_path):
    _, full = trained
    cfg = config(hf_llama, tmp_path / "run", *NF4, base=bf16_base)
    with pytest.raises(RuntimeError, match="injected failure"):
        run(cfg, callbacks=[Keep(crash_at=6)])
    again = Keep()
    run(cfg, callbacks=[again])
    assert min(again.losses) in (5, 7)  # resumed from the step-4 checkpoint
    for step, loss in again.losses.items():
        assert loss == full.losses[step], step
    ours, theirs = adapter_state_dict(again.model), adapter_state_dict(full.model)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_qlora_exports_the_dequantized_base_merged_and_adapters_peft_loads(hf_llama, bf16_base, trained, tmp_path):
    run_dir, keep = trained
    model = keep.model.eval()
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = merge_lora(model).eval()(x)  # the NF4 base dequantized, plus the adapters, in fp32
        live = model(x).float()  # the bf16 base computes in bf16
    assert (live - ours).abs().max() < 0.02
    # from the checkpoint in fp32: the merge itself, transformers' logits within 1e-5 of Kiln's
    out = export_from(checkpoints(run_dir)[-1], tmp_path / "m-fp32", dtype="fp32")
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, ours, rtol=0, atol=1e-5)
    # the run's model/ (and its export) in the base's own bf16: the same merge, rounded once
    _, exported = import_hf(export_from(run_dir, tmp_path / "m-run"))
    want = merge_lora(model).state_dict()
    assert all(v.dtype == torch.bfloat16 for v in exported.values())
    for key, value in exported.items():
        assert torch.equal(value, want[key].bfloat16()), key
    # the adapters in PEFT's format, onto the base as stored (unquantized): PEFT computes exactly the adapters
    # merged onto that base; it differs from the QLoRA model by the quantization of the base alone
    adapters = export_from(run_dir, tmp_path / "a", adapters=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(bf16_base, dtype=torch.float32)
    with_peft = peft.PeftModel.from_pretrained(base, adapters).eval()
    _, stored = import_hf(bf16_base)
    plain = transformers.AutoModelForCausalLM.from_pretrained(bf16_base, dtype=torch.float32).eval()
    merged = merge_state_dict({**stored, **adapter_state_dict(model)}, config(hf_llama, tmp_path / "x").lora)
    plain.load_state_dict({("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v
                           for k, v in merged.items()})
    with torch.no_grad():
        theirs, truth = with_peft(input_ids=x).logits, plain(input_ids=x).logits
    torch.testing.assert_close(theirs, truth, rtol=0, atol=1e-5)
    noise = ((theirs - ours).norm() / ours.norm()).item()
    # NF4's rounding of the base, nothing more: 0.10 of the logits' norm measured on this random 64-wide model
    assert 0 < noise < 0.2, noise
