"""LoRA under DDP and FSDP2 (2 gloo processes): frozen base parameters are accepted, only the adapters are
reduced, optimized and checkpointed, and the losses and adapters equal one process's with the same global
batch; FSDP with a bf16 base and fp32 adapters in one shard unit trains too; so does QLoRA (an NF4 base) under
both, equal to one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.parallel.mesh import Mesh

from .lora_workers import lora_run
from .test_parallelize import torchrun

HERE = Path(__file__).parent
LORA = {"rank": 4, "alpha": 8.0, "targets": ["all"], "base_dtype": "fp32"}
CASES = {
    "ddp": {"batch_size": 2, "grad_accum": 1, "dist": {"strategy": "ddp"}, "lora": LORA},
    "fsdp": {"batch_size": 1, "grad_accum": 2, "dist": {"strategy": "fsdp"}, "lora": LORA},
    "fsdp_bf16_base": {"batch_size": 2, "grad_accum": 1, "dist": {"strategy": "fsdp"},
                       "lora": {**LORA, "base_dtype": "bf16"}, "train": {"activation_checkpointing": "full"}},
}
# QLoRA: an NF4 base (torchao) wide enough that FSDP2 splits each layer's codes and scales evenly over 2 ranks;
# its values and the other weights in fp32, so that one process and two compute alike (bf16 would round a batch
# split in two otherwise)
QLORA = {**LORA, "base_dtype": "fp32", "quantize_base": "nf4"}
WIDE = {"d_model": 256, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 512}
CASES.update({name: {"batch_size": 2, "grad_accum": 1, "dist": {"strategy": name.split("_")[1]}, "lora": QLORA,
                     "model": WIDE} for name in ("qlora_ddp", "qlora_fsdp")})


@pytest.mark.slow
def test_lora_under_ddp_and_fsdp_matches_one_process(tmp_path):
    ref = lora_run({"batch_size": 4, "grad_accum": 1, "lora": LORA}, Mesh())
    assert ref["losses"][-1] < ref["losses"][0]
    assert ref["part"] == sorted(ref["adapters"]) and all(".lora_" in k for k in ref["part"])
    out = tmp_path / "out.json"
    done = torchrun([str(HERE / "lora_workers.py"), str(out), json.dumps(CASES)])
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    for name in ("ddp", "fsdp"):
        got = results[name]
        assert got["wrapper"] == {"ddp": "DistributedDataParallel", "fsdp": "FSDPTransformer"}[name]
        assert got["part"] == ref["part"], name  # the checkpoint's model part: the adapters alone
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-5), name
        assert got["adapters"].keys() == ref["adapters"].keys() and got["frozen_ok"], name
        for key, value in ref["adapters"].items():  # gathered on rank 0 (full_model)
            assert got["adapters"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (name, key)
    qlora = lora_run({"batch_size": 4, "grad_accum": 1, "lora": QLORA, "model": WIDE}, Mesh())
    assert qlora["part"] == ref["part"]  # (learning is shown end to end: tests/integration/test_qlora_train.py)
    for name in ("qlora_ddp", "qlora_fsdp"):  # the same quantized base on every rank (FSDP: its shards)
        got = results[name]
        assert got["part"] == qlora["part"] and got["frozen_ok"], name
        assert got["losses"] == pytest.approx(qlora["losses"], rel=1e-5, abs=1e-5), name
        for key, value in qlora["adapters"].items():
            assert got["adapters"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (name, key)
    mixed = results["fsdp_bf16_base"]
    assert mixed["part"] == ref["part"]
    assert mixed["losses"][-1] < mixed["losses"][0]
    assert mixed["losses"] == pytest.approx(ref["losses"], rel=2e-2)  # a bf16 base: close, not equal
